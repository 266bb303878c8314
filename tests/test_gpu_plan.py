"""The staged GPU plan (scripts/gpu/) tried on the CPU, so a broken step is found here, not in a
30-minute GPU window: every step runs with GPU_DRY_RUN=1 (the same commands; pytest only collects,
so paths, -k selections and markers are checked and GPU cases are skipped; the smoke run trains a
tiny model for 2 steps) and must exit 0 leaving exactly one archive with its log and environment.
The plan's shape is checked too: numbered steps that start with the shared prelude, state an
estimate of at most 9 minutes, wrap pytest in the prelude's helper (timeout -s INT, --maxfail, never
-x), and estimates that add up to less than the 30 minutes of a device session."""

import os
import re
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "scripts", "gpu")
STEPS = sorted(f for f in os.listdir(GPU) if re.fullmatch(r"\d\d_\w+\.sh", f))


def _estimate(text):
    m = re.search(r"estimate (\d+) min", text)
    return int(m.group(1)) if m else None


def test_plan_shape():
    assert [s[:2] for s in STEPS] == ["00", "10", "11", "12", "20", "21", "30", "40"], STEPS
    total = 0
    for step in STEPS:
        text = open(os.path.join(GPU, step)).read()
        code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert any(line.startswith("source ") and "prelude.sh" in line for line in code[:3]), step
        est = _estimate(text)
        assert est is not None and est <= 9, (step, est)
        total += est
        assert " -x" not in text and "--exitfirst" not in text, step
        for line in code:  # pytest only through run_pytest (timeout -s INT, --maxfail, junit, archive)
            assert "-m pytest" not in line, (step, line)
    assert total < 30, total
    readme = open(os.path.join(GPU, "README.md")).read()
    for step in STEPS:
        assert step in readme, step


def _dry_run(step, out):
    env = dict(os.environ, GPU_DRY_RUN="1", OUT=out, PY=sys.executable)
    for key in ("TRITON_INTERPRET", "SCRATCHFORMER_AUTOTUNE", "PYTHONPATH"):
        env.pop(key, None)
    return subprocess.run(["bash", os.path.join(GPU, step)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_step_dry_run(tmp_path):
    outs = {step: str(tmp_path / step[:2]) for step in STEPS}
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(STEPS, pool.map(lambda s: _dry_run(s, outs[s]), STEPS), strict=True))
    failed = {s: (p.stdout[-2500:] + p.stderr[-1500:]) for s, p in results.items() if p.returncode != 0}
    assert not failed, "\n\n".join(f"== {s}\n{log}" for s, log in failed.items())
    for step in STEPS:
        files = os.listdir(outs[step])
        assert files == [step.replace(".sh", ".tar.gz")], (step, files)
        with tarfile.open(os.path.join(outs[step], files[0])) as tar:
            names = {os.path.normpath(n) for n in tar.getnames()}
        assert {"log.txt", "env.txt"} <= names, (step, names)
        log = results[step].stdout
        assert "| extension" in log and "nvidia-smi" in log, step  # the prelude's versions ran
        if "run_pytest" in open(os.path.join(GPU, step)).read():
            assert re.search(r"\d+(/\d+)? tests? collected", log), (step, log[-2000:])
    assert "smoke_eager" in results["40_smoke_train.sh"].stdout


def test_dry_run_catches_a_broken_selection(tmp_path):
    """A step whose pytest selection matches nothing (a renamed file, a stale -k) fails the dry run."""
    step = tmp_path / "99_broken.sh"
    body = "run_pytest 60 1 broken tests/test_metrics.py -k no_test_has_this_name"
    step.write_text(f'source "{GPU}/prelude.sh"\n{body}\n')
    env = dict(os.environ, GPU_DRY_RUN="1", OUT=str(tmp_path / "out"), PY=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(["bash", str(step)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stdout[-2000:]
    assert os.listdir(tmp_path / "out") == ["99_broken.tar.gz"]  # packed even when failing
