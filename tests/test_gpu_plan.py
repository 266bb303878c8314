"""The staged GPU plan (scripts/gpu/) tried on the CPU, so a broken step is found here, not in a
15-minute GPU window: every step runs with GPU_DRY_RUN=1 (the same commands; pytest only collects,
so paths, -k selections and markers are checked and GPU cases are skipped; the smoke run trains a
tiny model for 2 steps) and must exit 0 leaving exactly one archive with its log and environment.
The plan's shape is checked too: numbered steps that start with the shared prelude, state an
estimate of at most 9 minutes, wrap pytest in the prelude's helper (timeout -s INT, --maxfail, never
-x), and the README's windows: every call's steps fit its CALL_SECONDS, and every window's calls,
with the machine's start and a turnaround a call, fit the 15 minutes of device time a task has."""

import gzip
import itertools
import json
import lzma
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "scripts", "gpu")
STEPS = sorted(f for f in os.listdir(GPU) if re.fullmatch(r"\d\d_\w+\.sh", f))
FIRST_WINDOW = [s for s in STEPS if s < "50"]  # tests and benchmarks; 50_train (issue 18) is for later windows
DEVICE_SECONDS = 15 * 60  # a task's device time, every call, start and idle together
START_SECONDS, TURNAROUND_SECONDS = 90, 30  # a cold machine's start; a call's transfers and the gap before the next
SPARE_SECONDS = 60  # left over: a window must not end on its last second


def _estimate(text):
    m = re.search(r"estimate (\d+) min", text)
    return int(m.group(1)) if m else None


def _windows(readme):
    """The README's window table -> {window: [(CALL_SECONDS, [step numbers])]}."""
    windows = {}
    for window, command in re.findall(r"^\| ([^|]+?) \| [A-Z] \| `([^`]*run\.sh[^`]*)` \|", readme, re.M):
        seconds = int(re.search(r"CALL_SECONDS=(\d+)", command)[1])
        steps = command.split("run.sh", 1)[1].split()
        windows.setdefault(window.split(" (")[0], []).append((seconds, steps))
    return windows


def test_plan_shape():
    assert [s[:2] for s in STEPS] == ["00", "10", "20", "21", "30", "31", "32", "40", "50"], STEPS
    estimates = {}
    for step in STEPS:
        text = open(os.path.join(GPU, step)).read()
        code = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert any(line.startswith("source ") and "prelude.sh" in line for line in code[:3]), step
        estimates[step[:2]] = _estimate(text)
        assert estimates[step[:2]] is not None and estimates[step[:2]] <= 9, (step, estimates[step[:2]])
        assert " -x" not in text and "--exitfirst" not in text, step
        for line in code:  # pytest only through run_pytest (timeout -s INT, --maxfail, junit, archive)
            assert "-m pytest" not in line, (step, line)
    readme = open(os.path.join(GPU, "README.md")).read()
    for step in STEPS:
        assert step in readme, step
    windows = _windows(readme)
    assert len(windows) >= 3 and {s[:2] for s in STEPS} == {n for calls in windows.values() for _, steps in calls
                                                           for n in steps}, windows
    for window, calls in windows.items():
        used = START_SECONDS + sum(seconds + TURNAROUND_SECONDS for seconds, _ in calls)
        assert used <= DEVICE_SECONDS - SPARE_SECONDS, (window, used)
        for seconds, steps in calls:  # a call's steps fit its deadline (50 stops itself at any deadline)
            assert sum(estimates[n] for n in steps if n != "50") * 60 <= seconds, (window, steps, seconds)


def _step_env(**extra):
    """The environment of a step run as on the GPU machine, from a shell: without this suite's
    settings (the interpreter, pinned tiles, paths) nor pytest's own (an xdist worker's
    PYTEST_XDIST_WORKER makes the steps' pytest-benchmark runs refuse --benchmark-only). The recipes
    launch their steps here (CUDA_GRAPHS=0: a CPU captures no CUDA graph) unless a test says otherwise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    for key in ("TRITON_INTERPRET", "SCRATCHFORMER_AUTOTUNE", "PYTHONPATH"):
        env.pop(key, None)
    return {**env, "GPU_DRY_RUN": "1", "PY": sys.executable, "CUDA_GRAPHS": "0", **extra}


def _dry_run(step, out, **extra):
    env = _step_env(OUT=out, **extra)
    return subprocess.run(["bash", os.path.join(GPU, step)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def _prelude_step(step: Path, body: str, out: Path) -> subprocess.CompletedProcess:
    """`step`, a step script of the prelude and `body`, written and run as a step (`_step_env`, OUT=out)."""
    step.write_text(f'source "{GPU}/prelude.sh"\n{body}')
    return subprocess.run(["bash", str(step)], cwd=REPO, env=_step_env(OUT=str(out)), capture_output=True,
                          text=True, timeout=300)


def test_every_step_dry_run(tmp_path):
    outs = {step: str(tmp_path / step[:2]) for step in FIRST_WINDOW}
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(FIRST_WINDOW, pool.map(lambda s: _dry_run(s, outs[s]), FIRST_WINDOW), strict=True))
    failed = {s: (p.stdout[-2500:] + p.stderr[-1500:]) for s, p in results.items() if p.returncode != 0}
    assert not failed, "\n\n".join(f"== {s}\n{log}" for s, log in failed.items())
    for step in FIRST_WINDOW:
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
    for step in FIRST_WINDOW:  # no checkpoint travels back (the smoke runs save theirs): the 64 MiB are the results'
        with tarfile.open(os.path.join(outs[step], step.replace(".sh", ".tar.gz"))) as tar:
            assert not [n for n in tar.getnames() if n.endswith(".pt")], step
    # steps 30 and 32 split the training-step cases: launched (less the recomputed layers') and graphed
    cases = {}
    for step in ("30_bench_train_step.sh", "32_bench_train_step_graph.sh"):
        with tarfile.open(os.path.join(outs[step], step.replace(".sh", ".tar.gz"))) as tar:
            listing = tar.extractfile("./bench_train_step.txt").read().decode()
        cases[step[:2]] = set(re.findall(r"::(test_\w+)\[", listing))
    assert cases == {"30": {"test_train_step"}, "32": {"test_train_step_graph"}}, cases
    # step 31's profile: the report in profile-<shape>.txt, the command's log beside it under its own
    # name (a cut run's traceback must not sit in a file named like a profile: collect.py files those)
    with tarfile.open(os.path.join(outs["31_bench_generate_profile.sh"], "31_bench_generate_profile.tar.gz")) as tar:
        profile = tar.extractfile("./profile-small-multi30k.txt").read().decode()
        assert "./profile_log-small-multi30k.txt" in tar.getnames()
        host = tar.extractfile("./host_overhead.txt").read().decode()  # bench/host_overhead.py, stubbed
    assert profile.startswith("training step profile:"), profile[:500]
    assert host.startswith("host time per call,") and "| triton |" in host, host[:500]


def test_targets_get_only_the_json_that_hold_something(tmp_path):
    """pytest-benchmark (the GPU machine's version) creates its --benchmark-json at startup and leaves
    it empty when it saves nothing (step 30's bench_generate.json on 2026-11-26): the prelude's
    run_targets names such a file and runs bench/targets.py on the others; with none, it skips."""
    case = _bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)]).replace("attention", "train_step")
    body = (f"printf '%s' '{case}' > \"$WORK/bench_train_step.json\"\n"
            ': > "$WORK/bench_generate.json"\nrun_targets\n')
    step = tmp_path / "98_targets.sh"
    p = _prelude_step(step, body, tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:]
    assert "bench_generate.json: empty (nothing saved), left out" in p.stdout
    targets = re.search(r"== \S+ targets \(limit \d+s\): (.*)", p.stdout)[1]
    assert "bench_train_step.json" in targets and "bench_generate.json" not in targets, targets
    files, _ = _archive(str(tmp_path / "out"), "98_targets.sh")
    assert "targets.md" in files
    p = _prelude_step(step, ': > "$WORK/bench_generate.json"\nrun_targets\n', tmp_path / "out2")
    assert p.returncode == 0 and "== targets: skipped" in p.stdout, p.stdout[-3000:]


def test_tests_step_runs_the_named_part(tmp_path):
    """TEST_PATHS runs a part of the suite in step 10 (the files of the kernels changed since a
    full run), and a path that does not exist fails the step rather than collecting nothing."""
    part = "tests/test_attention_tma.py tests/test_metrics.py"
    p = _dry_run("10_tests.sh", str(tmp_path / "part"), TEST_PATHS=part)
    assert p.returncode == 0, p.stdout[-2000:]
    with tarfile.open(tmp_path / "part" / "10_tests.tar.gz") as tar:  # pytest's whole output (the log has its tail)
        listing = tar.extractfile("./tests.txt").read().decode()
    collected = set(re.findall(r"^(tests/\w+\.py)::", listing, re.M))
    assert collected == set(part.split()), collected
    p = _dry_run("10_tests.sh", str(tmp_path / "bad"), TEST_PATHS="tests/test_no_such_file.py")
    assert p.returncode != 0, p.stdout[-2000:]


def test_bench_step_runs_the_named_groups(tmp_path):
    """BENCH_GROUPS picks step 21's benchmark groups (one kernel measured again after a change);
    a group it does not have fails the step by name."""
    p = _dry_run("21_bench_norm_ffn_embed.sh", str(tmp_path / "one"), BENCH_GROUPS="add_layer_norm")
    assert p.returncode == 0, p.stdout[-2000:]
    assert "pytest bench_add_layer_norm" in p.stdout
    assert "bench_ffn" not in p.stdout and "bench_embed" not in p.stdout
    p = _dry_run("21_bench_norm_ffn_embed.sh", str(tmp_path / "bad"), BENCH_GROUPS="add_layer_norm layernorm")
    assert p.returncode != 0 and "no group 'layernorm'" in p.stderr + p.stdout


def test_dry_run_catches_a_broken_selection(tmp_path):
    """A step whose pytest selection matches nothing (a renamed file, a stale -k) fails the dry run."""
    body = "run_pytest 60 1 broken tests/test_metrics.py -k no_test_has_this_name\n"
    p = _prelude_step(tmp_path / "99_broken.sh", body, tmp_path / "out")
    assert p.returncode != 0, p.stdout[-2000:]
    assert os.listdir(tmp_path / "out") == ["99_broken.tar.gz"]  # packed even when failing


def test_a_step_terminated_still_packs_its_archive(tmp_path):
    """SIGTERM to a step's process group (a kill at a limit, timeout(1)'s way) still packs its archive,
    whose log says the step was stopped: the group's tee of the log died with it, the exit trap's
    first line then raised SIGPIPE, and the step ended with no archive at all (its log and results
    lost; the trap had also read exit 0)."""
    import signal
    import time

    step = tmp_path / "97_term.sh"
    step.write_text(f'source "{GPU}/prelude.sh"\nrun_cmd 100 nap sleep 3\necho "== after the nap"\n')
    out, printed = tmp_path / "out", tmp_path / "stdout.txt"
    with open(printed, "w") as stdout:
        proc = subprocess.Popen(["bash", str(step)], cwd=REPO, env=_step_env(OUT=str(out)), stdout=stdout,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 240
            while " nap (limit" not in printed.read_text() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143 and os.listdir(out) == ["97_term.tar.gz"], (rc, printed.read_text()[-2000:])
    _, log = _archive(str(out), "97_term.sh")
    assert "== 97_term: exit 143 after" in log and "== after the nap" not in log, log[-2000:]


def _archive(out, step):
    with tarfile.open(os.path.join(out, step.replace(".sh", ".tar.gz"))) as tar:
        return {os.path.normpath(m.name): m for m in tar.getmembers()}, tar.extractfile("./log.txt").read().decode()


def _translation_data(folder, broken_test_input: bool = False) -> list[str]:
    """Tiny iwslt2017_en_de and multi30k folders for step 50's rehearsal -> the test inputs' ids
    (`broken_test_input`: a last test line that is not JSON, on which `generate` fails)."""
    ids = [f"t{i}" for i in range(5)]
    pairs = [{"src": f"a man number {i} rides a bike", "tgt": f"ein mann nummer {i} faehrt rad"} for i in range(40)]
    for name in ("iwslt2017_en_de", "multi30k"):
        data = folder / name
        data.mkdir(parents=True)
        for split, rows in (("train", pairs[:32]), ("validation", pairs[32:])):
            (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        opener, suffix = (lzma.open, "xz") if name == "iwslt2017_en_de" else (gzip.open, "gz")  # packed either way
        with opener(data / f"test_inputs.jsonl.{suffix}", "wt") as f:
            f.writelines(json.dumps({"id": i, "src": f"a woman number {i}"}) + "\n" for i in ids)
            f.write("{not json\n" if broken_test_input else "")
    return ids


def _cut_python(folder):
    """A python whose evaluate is cut at once (timeout's 124), or hangs (EVAL_SLEEP set); the rest runs."""
    fake = folder / "python"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.evaluate ]; then\n'
                    '  if [ -n "${EVAL_SLEEP:-}" ]; then exec sleep "$EVAL_SLEEP"; fi; exit 124; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


@pytest.fixture(scope="module")
def scoring_cut(tmp_path_factory):
    """50_train's first call on iwslt whose scoring the call's deadline cuts at once (evaluate exits 124):
    the run trains to its end and nothing is scored -> (folder, the call). The tests that start from a
    run finished training (its step checkpoints, best.pt and average, nothing scored) copy its run
    folder (`_finished_run`) rather than train the same tiny model again each."""
    folder = tmp_path_factory.mktemp("scoring_cut")
    _translation_data(folder / "data")
    call = _dry_run("50_train.sh", str(folder / "o1"), GPU_DATA=str(folder / "data"), GPU_RUNS=str(folder / "runs"),
                    RECIPE="iwslt", PY=str(_cut_python(folder)))
    return folder, call


def _finish_on_cpu(recipe: str, weights, finish, data) -> subprocess.CompletedProcess:
    """scripts/gpu/finish_on_cpu.sh RECIPE WEIGHTS FINISH on DATA (SCRATCHFORMER_DATA), asserted to succeed."""
    done = subprocess.run(["bash", os.path.join(GPU, "finish_on_cpu.sh"), recipe, str(weights), str(finish)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SCRATCHFORMER_DATA": str(data), "PY": sys.executable})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _finished_run(rehearsal, runs, scored=False):
    """A fixture's run folder copied to RUNS/iwslt -> that folder: `scoring_cut`'s (finished training,
    nothing scored), or `predictions_cut`'s (`scored`: every candidate scored, no test predictions)."""
    run = runs / "iwslt"
    shutil.copytree(rehearsal[0] / "runs" / "iwslt", run)
    assert (run / "metrics.final.json").exists() and not (run / "test_predictions.jsonl").exists(), os.listdir(run)
    assert bool(list(run.glob("*/metrics.validation.json"))) == scored, os.listdir(run)
    return run


@pytest.fixture(scope="module")
def predictions_cut(tmp_path_factory, scoring_cut):
    """50_train's call on `scoring_cut`'s run (finished training, nothing scored) with a test input that
    `generate` cannot read: every candidate is scored, the test predictions fail -> (folder, the call).
    The tests of what such a call brings back share it (scoring the run once, not each)."""
    folder = tmp_path_factory.mktemp("predictions_cut")
    _translation_data(folder / "data", broken_test_input=True)
    _finished_run(scoring_cut, folder / "runs")
    call = _dry_run("50_train.sh", str(folder / "o1"), GPU_DATA=str(folder / "data"), GPU_RUNS=str(folder / "runs"),
                    RECIPE="iwslt")
    return folder, call


def test_train_step_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """50_train (issue 18) in pieces: a call stopped by its time limit leaves a checkpoint on the
    machine, says to call again and brings back the average of its step checkpoints (which
    finish_on_cpu.sh scores and predicts with); the next call resumes, finishes, predicts every blind test
    input; archives never hold checkpoints. A grid recipe (Multi30k on our kernels and on eager)
    runs its variants and writes their summary."""
    ids = _translation_data(tmp_path / "data")
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt")
    first = _dry_run("50_train.sh", str(tmp_path / "o1"), TRAIN_SECONDS="0.001", **env)
    assert first.returncode == 0, first.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert "iwslt: not finished, call again" in log and "run/test_predictions.jsonl" not in files
    assert os.path.exists(tmp_path / "runs" / "iwslt" / "last.pt")
    # the unfinished call brings back the average of its step checkpoints: a model that runs
    from scratchformer.checkpoint import load_checkpoint, step_checkpoints
    from scratchformer.evaluation.evaluate import load_run

    monkeypatch.syspath_prepend(GPU)
    import collect

    (averaged,) = collect.join_parts([tmp_path / "o1"], tmp_path / "collected")
    assert averaged.name == "50_iwslt-averaged.pt"
    steps = [int(p.stem.split("_")[1]) for p in step_checkpoints(tmp_path / "runs" / "iwslt")]
    assert steps and [a["step"] for a in load_checkpoint(averaged)["averaged_from"]] == steps[-5:]
    load_run(averaged)
    # ... which finish_on_cpu.sh scores at the recipe's decoding and penalties and predicts with
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", averaged, finish, env["GPU_DATA"])
    scored = {f.parent.name: json.loads(f.read_text()) for f in finish.glob("*/metrics.validation.json")}
    assert set(scored) == {"averaged", "averaged-lp1.3", "averaged-lp1.6"}
    assert {m["decoding"] for m in scored.values()} == {"beam4"}
    assert [json.loads(line)["id"] for line in open(finish / "test_predictions.jsonl")] == ids
    assert "test predictions from averaged.pt" in done.stdout
    (tmp_path / "runs" / "iwslt" / "step_0000099.pt.tmp").write_bytes(b"a save killed midway")
    second = _dry_run("50_train.sh", str(tmp_path / "o2"), **env)
    assert second.returncode == 0, second.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o2"), "50_train.sh")
    assert "resumed from" in log and "iwslt: finished" in log, log[-3000:]
    assert {"run/metrics.final.json", "run/test_predictions.jsonl", "run/log.txt"} <= set(files)
    # no checkpoint in the archive (nor a killed save's temporary); the model that wrote the predictions
    # comes back beside it, weights only
    assert not [n for n in files if re.search(r"\.pt(\.tmp)?$", n)], files
    assert not list((tmp_path / "o2").glob("*averaged.pt.part*"))
    assert list((tmp_path / "o2").glob("50_iwslt-picked.pt.part*"))
    preds = [json.loads(line) for line in open(tmp_path / "runs" / "iwslt" / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids
    # the predictions come from best.pt or the average of the last step checkpoints, each scored on
    # validation at the decoding's length penalty and at the recipe's others (the rehearsal: one), and
    # are decoded at the picked score's penalty
    assert {f"run/{name}/metrics.validation.json" for name in ("best", "averaged", "best-lp1.3", "averaged-lp1.3")
            } <= set(files)
    picked = re.search(r"(averaged|best)\.pt: validation bleu \(beam4\): best [\d.]+, averaged [\d.]+, "
                       r"best-lp1\.3 [\d.]+, averaged-lp1\.3 [\d.]+; length penalty ([\d.]+)", log)
    assert picked, log
    generate = rf"generate .*--checkpoint \S*/{picked[1]}\.pt .*--length-penalty {re.escape(picked[2])} "
    assert re.search(generate, log), log
    with tarfile.open(tmp_path / "o2" / "50_train.tar.gz") as tar:
        assert tar.extractfile("./picked.txt").read().decode().split() == [
            f"{picked[1]}.pt", "--beam-size", "4", "--length-penalty", picked[2]]
    grid = _dry_run("50_train.sh", str(tmp_path / "o3"), **{**env, "RECIPE": "multi30k-eager"})
    assert grid.returncode == 0, grid.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o3"), "50_train.sh")
    assert {"run/ablation.json", "run/eager/metrics.final.json", "run/triton/metrics.final.json"} <= set(files)
    assert "multi30k-eager: finished" in log
    grid_runs = tmp_path / "runs" / "multi30k-eager"
    kernels = {r["name"]: json.load(open(grid_runs / r["name"] / "config.json"))["kernel"]
               for r in json.load(open(grid_runs / "ablation.json"))["runs"]}
    assert kernels == {"triton": "eager", "eager": "eager"}  # the CPU rehearsal runs both on eager


def test_search_recipe_predicts_with_its_best_variant_or_their_ensemble(tmp_path):
    """A search (a grid with DECODE; iwslt-ensemble: seeds) trains its variants at once (JOBS), then
    finishes its best by METRIC on validation as a single run: scored, the test predictions written,
    its model brought back; the archive holds the whole grid (ablation.json, every variant's folder and
    log). With ENSEMBLE=1 every variant's average, as one model, is scored beside the best variant's
    checkpoints; when it scores highest it writes the predictions (its members stay on the machine)."""
    ids = _translation_data(tmp_path / "data")
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt-ensemble")
    call = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    grid = tmp_path / "runs" / "iwslt-ensemble"
    summary = json.load(open(grid / "ablation.json"))
    names = [r["folder"] for r in summary["runs"]]
    assert names == ["seed-0", "seed-1"] and summary["metric"] == "bleu"  # the rehearsal: the first two
    assert "--jobs 2" not in log and "--jobs 4" in log  # the recipe's JOBS, two variants to run
    best = max(summary["runs"], key=lambda r: r["final"]["bleu"])["folder"]
    assert summary["best"] == best and f"the best variant by bleu on validation: {best}" in log, log[-3000:]
    assert {"run/ablation.json", *(f"run/logs/{n}.txt" for n in names), *(f"run/{n}/metrics.final.json" for n in names),
            f"run/{best}/test_predictions.jsonl", f"run/{best}/best/metrics.validation.json",
            f"run/{best}/ensemble/metrics.validation.json", f"run/{best}/ensemble-lp1.6/metrics.validation.json"
            } <= set(files)
    ensemble = json.load(open(grid / best / "ensemble" / "metrics.validation.json"))
    assert [m["path"] for m in ensemble["checkpoint"]] == [str(grid / n / "averaged.pt") for n in names]
    assert not [n for n in files if n.endswith(".pt")] and "iwslt-ensemble: finished" in log
    assert [json.loads(line)["id"] for line in open(grid / best / "test_predictions.jsonl")] == ids
    assert list((tmp_path / "o1").glob("50_iwslt-ensemble-picked.pt.part*"))  # a tie of untrained models: best.pt
    # had the ensemble scored highest, it would have written them
    ensemble["bleu"] = 100.0
    (grid / best / "ensemble" / "metrics.validation.json").write_text(json.dumps(ensemble))
    (grid / best / "test_predictions.jsonl").unlink()
    call = _dry_run("50_train.sh", str(tmp_path / "o2"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o2"), "50_train.sh")
    members = " ".join(str(grid / n / "averaged.pt") for n in names)
    assert re.search(rf"generate .*--checkpoint {re.escape(members)} --input", log), log[-3000:]
    assert "the test predictions' model is an ensemble of 2: its members stay on the machine" in log
    assert not list((tmp_path / "o2").glob("*.pt.part*"))
    with tarfile.open(tmp_path / "o2" / "50_train.tar.gz") as tar:
        assert tar.extractfile("./picked.txt").read().decode().split()[:3] == [
            "ensemble", *(f"{n}/averaged.pt" for n in names)]
    assert [json.loads(line)["id"] for line in open(grid / best / "test_predictions.jsonl")] == ids


def test_summarizer_checks_its_encoder_after_its_test_predictions(tmp_path):
    """A summarization recipe's encoder check (scripts/source_use.py, a diagnostic) runs once the test
    predictions are written, never before them: in the eleventh window it ran first, on one CPU
    thread, timed out in both calls and left CNN/DM's base model no time for its predictions."""
    data = tmp_path / "data" / "samsum"
    data.mkdir(parents=True)
    rows = [{"id": str(i), "document": f"Ann: I bring {i} apples\nBob: ok", "summary": f"Ann brings {i} apples."}
            for i in range(40)]
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    with gzip.open(data / "test_inputs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"id": f"t{i}", "document": f"Eve: {i} pears?"}) + "\n" for i in range(3))
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="samsum")
    call = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert {"run/test_predictions.jsonl", "run/source_use.txt"} <= set(files) and "samsum: finished" in log, log[-3000:]
    assert log.index(" generate (limit") < log.index(" source_use (limit"), log[-3000:]
    assert "NLL/token: own source" in open(tmp_path / "runs" / "samsum" / "source_use.txt").read()


def test_extractive_recipe_runs_to_its_test_predictions(tmp_path):
    """cnndm-ext (issue 18's CNN/DM target, an encoder that picks sentences) through the same call:
    trained with validation under the recipe's rule (at most 4 sentences, until 60 words), best.pt
    and the average scored by it, the better one picks every test input's summary from its sentences by that
    rule, and no encoder check (a summarizer's decoder diagnostic) runs."""
    data = tmp_path / "data" / "cnn_dailymail"
    data.mkdir(parents=True)
    words = "the a man dog city rain police report said on".split()

    def doc(i):
        return " ".join(f"{words[(i + j) % 10]} {words[(i * j) % 10]} number {j} ." for j in range(5))

    rows = [{"id": str(i), "document": doc(i), "summary": doc(i).split(" . ")[0] + " ."} for i in range(40)]
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    tests = [{"id": f"t{i}", "document": doc(i + 50)} for i in range(3)]
    with gzip.open(data / "test_inputs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(t) + "\n" for t in tests)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="cnndm-ext")
    call = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    assert call.returncode == 0, call.stdout[-3000:]
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert "cnndm-ext: finished" in log and " source_use (limit" not in log, log[-3000:]
    assert re.search(r"(best|averaged)\.pt: validation rougeLsum \(top4-60w\): best [\d.]+, averaged [\d.]+", log), log
    final = json.loads((tmp_path / "runs" / "cnndm-ext" / "metrics.final.json").read_text())
    assert "top4-60w" in final and "top3" not in final, final
    assert {"run/test_predictions.jsonl", "run/best/metrics.validation.json", "run/averaged/metrics.validation.json"
            } <= set(files)
    preds = [json.loads(line) for line in open(tmp_path / "runs" / "cnndm-ext" / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == [t["id"] for t in tests]
    for p, t in zip(preds, tests, strict=True):  # whole sentences of its own document, at most 4
        picked = p["prediction"].split("\n")
        assert 1 <= len(picked) <= 4 and all(s in t["document"] for s in picked), (p, t)


def test_train_step_killed_outright_still_brings_back_its_archive(tmp_path, scoring_cut):
    """The device kills a call past its timeout_s with SIGKILL: no exit trap runs, so the step's one
    archive, written by that trap, was never made and the call brought back nothing, not even its
    log. Step 50 now packs an interim archive after training (and after the predictions): killed
    while scoring, the call still brings back its log and the run folder, and no half-written archive."""
    _translation_data(tmp_path / "data")
    _finished_run(scoring_cut, tmp_path / "runs")
    fake = tmp_path / "python"  # kills the step's whole session at its first evaluate, as the device would
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.evaluate ]; then\n'
                    '  pkill -KILL -s "$(ps -o sid= -p $$ | tr -d " ")"; sleep 30; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = _step_env(OUT=str(tmp_path / "o1"), GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"),
                    RECIPE="iwslt", PY=str(fake))
    call = subprocess.run(["bash", os.path.join(GPU, "50_train.sh")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, start_new_session=True)  # its own session: pytest's is spared
    assert call.returncode == -signal.SIGKILL, call.stdout[-3000:]
    assert os.listdir(tmp_path / "o1") == ["50_train.tar.gz"]
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert {"run/metrics.final.json", "run/log.txt", "env.txt"} <= set(files), sorted(files)
    assert not any(name.endswith(".pt") for name in files) and "== 50_train: exit" not in log, log[-2000:]


def test_train_step_brings_back_the_model_of_unfinished_predictions(tmp_path, monkeypatch, predictions_cut):
    """A call whose run finished training but not its test predictions (the seventh window's SAMSum
    run: the call's deadline cut `generate`; here a test input it cannot read) brings back the
    checkpoint that writes them, weights only, in pieces, and names it and its decoding in
    picked.txt; finish_on_cpu.sh finishes the predictions with it from the GPU's snapshot. (The run
    finished training in `scoring_cut`, on the same training and validation data; the call of
    `predictions_cut` scores it.)"""
    folder, call = predictions_cut
    files, log = _archive(str(folder / "o1"), "50_train.sh")
    assert "run/metrics.final.json" in files and "run/test_predictions.jsonl" not in files, call.stdout[-3000:]
    assert "iwslt: not finished, call again" in log
    assert not list((folder / "o1").glob("*averaged.pt.part*"))
    with tarfile.open(folder / "o1" / "50_train.tar.gz") as tar:
        picked = tar.extractfile("./picked.txt").read().decode().split()
    assert picked[0] in ("best.pt", "averaged.pt") and picked[1:3] == ["--beam-size", "4"], picked
    monkeypatch.syspath_prepend(GPU)
    import collect
    import torch

    from scratchformer.checkpoint import load_checkpoint
    from scratchformer.evaluation.evaluate import load_run

    collected = tmp_path / "collected"
    collect.unpack([folder / "o1"], collected)
    (weights,) = collect.join_parts([folder / "o1"], collected)
    assert weights.name == "50_iwslt-picked.pt"
    ckpt = load_checkpoint(weights)
    source = load_checkpoint(folder / "runs" / "iwslt" / picked[0])
    steps = [a["step"] for a in source["averaged_from"]] if picked[0] == "averaged.pt" else [source["progress"]["step"]]
    assert "optimizer" not in ckpt and [a["step"] for a in ckpt["averaged_from"]] == steps
    for name, tensor in source["model"].items():
        assert torch.equal(ckpt["model"][name].float(), tensor.float()), name
    load_run(weights)
    assert call.returncode != 0 and "bad JSON" in call.stdout  # generate's failure is the step's, said
    # finish_on_cpu.sh goes on from the GPU's snapshot (here one prediction) with the GPU's decoding
    # flags, and scores nothing again
    ids = _translation_data(tmp_path / "data")
    # a second call's archive (collect.py: 50_train.2) names the model and holds the snapshot that count:
    # the first call's picked.txt (here another decoding) and its missing snapshot are passed over
    shutil.copytree(collected / "50_train", collected / "50_train.2")
    (collected / "50_train" / "picked.txt").write_text(f"{picked[0]} --beam-size 2\n")
    (collected / "50_train" / "run" / "test_predictions.jsonl.partial").unlink(missing_ok=True)
    snapshot = collected / "50_train.2" / "run" / "test_predictions.jsonl.partial"
    snapshot.write_text(json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", weights, finish, str(tmp_path / "data"))
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and preds[2]["prediction"] == "vom GPU"
    assert f"test predictions from {picked[0]} (picked.pt), 1 of them decoded on the GPU" in done.stdout
    assert not list(finish.glob("*/metrics.validation.json"))


def test_a_model_over_the_fp32_limit_comes_back_in_bf16_and_is_predicted_anew(tmp_path, monkeypatch, predictions_cut):
    """cnndm-ext's base encoder is 103 MiB in fp32, over the 45 MiB a call brings back: it stayed on the
    machine, so a cut call left the CPU nothing to finish with. Over that limit (here set to 0 MiB)
    the weights come back in bf16, the mean rounded once (`average --dtype bf16`); not the GPU's
    weights, so finish_on_cpu.sh decodes every test input itself, none from the GPU's snapshot. (The
    run: `predictions_cut`'s, scored, its predictions cut; this call picks and ships its model.)"""
    _translation_data(tmp_path / "data", broken_test_input=True)
    _finished_run(predictions_cut, tmp_path / "runs", scored=True)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt")
    _dry_run("50_train.sh", str(tmp_path / "o1"), SHIP_FP32_MIB="0", **env)
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert "picked_bf16" in log or "picked.txt" in files, log[-3000:]
    monkeypatch.syspath_prepend(GPU)
    import collect
    import torch

    from scratchformer.checkpoint import load_checkpoint

    collected = tmp_path / "collected"
    collect.unpack([tmp_path / "o1"], collected)
    (weights,) = collect.join_parts([tmp_path / "o1"], collected)
    floating = [v for v in load_checkpoint(weights)["model"].values() if v.is_floating_point()]
    assert floating and all(v.dtype == torch.bfloat16 for v in floating)
    shutil.rmtree(tmp_path / "data")
    ids = _translation_data(tmp_path / "data")
    snapshot = collected / "50_train" / "run" / "test_predictions.jsonl.partial"
    snapshot.write_text(json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt", weights, finish, str(tmp_path / "data"))
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and "vom GPU" not in [p["prediction"] for p in preds]
    assert "picked.pt came back in bf16: the test inputs are all decoded here" in done.stdout


def test_a_follow_up_call_on_a_fresh_machine_trains_nothing(tmp_path):
    """RESUME_ONLY=1 (a second call of a window): the machine was given back between the calls, so
    the run is gone; the call used to start a new run and burn the window's rest on it. It stops at
    once, saying so, and fails."""
    _translation_data(tmp_path / "data")
    call = _dry_run("50_train.sh", str(tmp_path / "o1"), GPU_DATA=str(tmp_path / "data"),
                    GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", RESUME_ONLY="1")
    _, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert call.returncode != 0 and "RESUME_ONLY=1: no run in" in log
    assert not (tmp_path / "runs" / "iwslt").exists() or not list((tmp_path / "runs" / "iwslt").glob("*.pt"))


def test_train_step_leaves_the_scores_to_the_next_call_at_its_deadline(tmp_path, scoring_cut):
    """A finished run's scoring cut by the call's deadline leaves the other evaluations to the next
    call: each one started after it got the prelude's last 10 s (and timeout's 20 s grace), all
    but certain to be cut too, and so pushed the step past its deadline toward the device's own
    kill, which loses the step's archive (best and averaged at 1.0 and three penalties: 5 more)."""
    folder, first = scoring_cut  # evaluate is cut at once (the first call: timeout's 124), or hangs (the second)
    _, log = _archive(str(folder / "o1"), "50_train.sh")
    assert os.path.exists(folder / "runs" / "iwslt" / "metrics.final.json"), first.stdout[-3000:]
    assert "iwslt: not finished" in log and first.returncode != 0
    assert re.findall(r"== (eval_\S+): TIMED OUT", log) == ["eval_best"], log[-3000:]  # the first cut: no other tried
    _finished_run(scoring_cut, tmp_path / "runs")
    env = dict(GPU_DATA=str(folder / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt",
               PY=str(_cut_python(tmp_path)))
    # the second call starts past its deadline: every command gets the prelude's 10 s
    second = _dry_run("50_train.sh", str(tmp_path / "o2"), EVAL_SLEEP="100",
                      GPU_DEADLINE=str(int(__import__("time").time()) - 100), **env)
    _, log = _archive(str(tmp_path / "o2"), "50_train.sh")
    assert re.findall(r"== (eval_\S+): TIMED OUT", log) == ["eval_best"], log[-3000:]
    assert "iwslt: not finished, call again" in log and second.returncode == 124


def test_train_step_leaves_out_a_candidate_whose_scoring_fails(tmp_path, scoring_cut):
    """A candidate whose evaluation fails other than by the deadline (out of memory, say) is left out,
    and the run writes its test predictions with the others' pick: it set the call's scoring
    unfinished, so each call tried it again, failed again, and the predictions never came. (The run
    finished training in `scoring_cut`; this call scores it.)"""
    ids = _translation_data(tmp_path / "data")
    _finished_run(scoring_cut, tmp_path / "runs")
    fake = tmp_path / "python"  # the averaged checkpoint's evaluations fail at once; the rest run
    fake.write_text('#!/bin/bash\ncase "$*" in *scratchformer.evaluate*averaged.pt*) exit 1;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", PY=str(fake))
    p = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    _, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    run = tmp_path / "runs" / "iwslt"
    assert "== eval_averaged failed: not a candidate" in log, log[-3000:]
    assert (run / "averaged.failed").exists() and (run / "best" / "metrics.validation.json").exists()
    preds = [json.loads(line) for line in open(run / "test_predictions.jsonl")]
    assert [r["id"] for r in preds] == ids, p.stdout[-2000:]


def test_finish_on_cpu_goes_on_from_a_searchs_snapshot(tmp_path, scoring_cut):
    """finish_on_cpu.sh on a search recipe's picked model goes on from the GPU's predictions snapshot,
    which the archive holds in the grid's best variant's folder (run/<best>/), not in run/ (it
    looked there only, and decoded every test input again on the CPU). The model: `scoring_cut`'s
    tiny iwslt run's best.pt (any model of the dataset will do)."""
    ids = _translation_data(tmp_path / "data")
    collected = tmp_path / "collected"
    (collected / "50_train" / "run" / "seed-1").mkdir(parents=True)
    weights = collected / "50_iwslt-ensemble-picked.pt"
    shutil.copy(scoring_cut[0] / "runs" / "iwslt" / "best.pt", weights)
    (collected / "50_train" / "picked.txt").write_text("best.pt --beam-size 1\n")
    (collected / "50_train" / "run" / "ablation.json").write_text(json.dumps({"best": "seed-1", "runs": []}))
    (collected / "50_train" / "run" / "seed-1" / "test_predictions.jsonl.partial").write_text(
        json.dumps({"id": ids[2], "prediction": "vom GPU"}) + "\n")
    finish = tmp_path / "finish"
    done = _finish_on_cpu("iwslt-ensemble", weights, finish, tmp_path / "data")
    preds = [json.loads(line) for line in open(finish / "test_predictions.jsonl")]
    assert [p["id"] for p in preds] == ids and preds[2]["prediction"] == "vom GPU", preds
    assert "1 of them decoded on the GPU" in done.stdout


def test_prelude_replaces_an_extension_built_from_other_sources(tmp_path):
    """An extension the prelude put in scratchformer/ (an earlier call on a warm machine), stamped
    with other sources' hash (csrc/ fixed since), is neither reused nor sent back by step 00 under
    the new hash: the one carried in .gpu_build/, built from these sources, takes its place. One
    without a stamp (a developer's build) is used as it is, and one stamped with these sources is kept; one
    carried in .gpu_build/ from other sources is not used. A build that failed on these sources is not
    tried again by the call's later steps, unless it was cut by its time limit."""
    import importlib.machinery

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(clone)], check=True)
    shutil.copytree(GPU, clone / "scripts" / "gpu", dirs_exist_ok=True)  # this checkout's scripts
    name = "_C" + importlib.machinery.EXTENSION_SUFFIXES[0]
    real = (Path(REPO) / "scratchformer" / name).read_bytes()
    current = subprocess.run(["bash", str(clone / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True,
                             text=True, check=True).stdout.strip()
    (clone / ".gpu_build").mkdir()
    (clone / ".gpu_build" / name).write_bytes(real)
    (clone / ".gpu_build" / "sources.sha256").write_text(current + "\n")
    in_place, stamp = clone / "scratchformer" / name, clone / "scratchformer" / ".ext_sources.sha256"
    step = tmp_path / "99_ext.sh"
    step.write_text(f'PACK_EXT=1\nsource "{clone}/scripts/gpu/prelude.sh"\n')

    def call(out):
        p = subprocess.run(["bash", str(step)], cwd=clone, env=_step_env(OUT=str(tmp_path / out)), capture_output=True,
                           text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        with tarfile.open(tmp_path / out / "99_ext.tar.gz") as tar:
            sent = tar.extractfile(f"./build/{name}").read(), tar.extractfile("./build/sources.sha256").read()
        return p.stdout, sent

    in_place.write_bytes(real + b"built from other sources")  # loads as well: an ELF's trailing bytes are unread
    stamp.write_text("0" * 64 + "\n")
    log, sent = call("o1")
    assert "built from other sources" in log and "reusing the extension carried in .gpu_build/" in log, log[-2000:]
    assert in_place.read_bytes() == real and sent == (real, current.encode() + b"\n")
    assert stamp.read_text().strip() == current
    log, sent = call("o1b")  # the next call on the warm machine: stamped with these sources, kept as it is
    assert "built from other sources" not in log and "reusing" not in log and "building" not in log, log[-2000:]
    assert in_place.read_bytes() == real and sent == (real, current.encode() + b"\n")
    stamp.unlink()
    in_place.write_bytes(real + b"a developer's build")
    log, sent = call("o2")
    assert in_place.read_bytes() == sent[0] == real + b"a developer's build", log[-2000:]
    # a build that fails (here a python on which the extension never loads and setup.py fails) is not
    # tried again by a later step of the call (run.sh's GPU_DEADLINE, the same): its sources are
    # remembered; the next call (another deadline, on the machine still warm) tries again: it may
    # bring a fix outside those sources (the prelude's own environment)
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$1" in -) exit 1;; setup.py) echo "error: no compiler"; exit ${SETUP_EXIT:-1};;'
                    f' esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    (clone / ".gpu_build" / "sources.sha256").write_text("0" * 64 + "\n")  # carried, but of other sources: not used
    deadline = int(__import__("time").time()) + 3600
    logs = [subprocess.run(["bash", str(step)], cwd=clone, capture_output=True, text=True, timeout=300,
                           env={**_step_env(OUT=str(tmp_path / out)), "PY": str(fake), "GPU_DEADLINE": str(d),
                                "SETUP_EXIT": str(code)})
            for out, d, code in (("o3", deadline, 1), ("o4", deadline, 1), ("o5", deadline + 1, 1),
                                 ("o6", deadline + 2, 124), ("o7", deadline + 2, 1))]
    assert all(p.returncode != 0 for p in logs)
    assert "error: no compiler" in logs[0].stdout
    assert ".gpu_build/ holds an extension built from other sources (sources.sha256): building" in logs[0].stdout
    # a build cut by its time limit (timeout's 124) says nothing of the sources: the next step tries again
    assert "error: no compiler" in logs[4].stdout and "in an earlier step" not in logs[4].stdout, logs[4].stdout[-2000:]
    assert "failed to build from these sources in an earlier step" in logs[1].stdout, logs[1].stdout[-2000:]
    assert "building the extension" in logs[1].stdout and "no compiler" not in logs[1].stdout
    assert "error: no compiler" in logs[2].stdout and "in an earlier step" not in logs[2].stdout, logs[2].stdout[-2000:]


def test_train_step_falls_back_to_launched_steps(tmp_path):
    """CUDA_GRAPHS=1 and a run whose --cuda-graphs fails (here: refused, as the CPU has no GPU;
    on a GPU: a capture CUDA refused) goes on launched in the same call, and its checkpoints say
    so (a later call's resume stays launched)."""
    from scratchformer.checkpoint import load_checkpoint

    data = tmp_path / "data" / "multi30k"
    data.mkdir(parents=True)
    pairs = [{"src": f"a man number {i} rides a bike", "tgt": f"ein mann nummer {i} faehrt rad"} for i in range(40)]
    for split, rows in (("train", pairs[:32]), ("validation", pairs[32:])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="multi30k-tiny",
               CUDA_GRAPHS="1", TRAIN_SECONDS="0.001")
    res = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    files, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    assert "--cuda-graphs records CUDA graphs: it needs a GPU" in log and "--cuda-graphs failed (exit 2)" in log, log
    run = tmp_path / "runs" / "multi30k-tiny"
    args = json.load(open(run / "args.json"))
    assert args["cuda_graphs"] is False and args["eval_every"] == 3  # the rehearsal's flags, launched
    assert load_checkpoint(run / "last.pt")["args"]["cuda_graphs"] is False
    assert "multi30k-tiny: not finished, call again" in log and res.returncode != 0  # the failure is reported


def test_every_recipe_parses():
    """Each recipe of 50_train.sh (and each ablation variant) is a valid train command line, and its
    decoding (DECODE, RUNTIME, each of LENGTH_PENALTIES) valid flags of both evaluate and generate that
    fit the run's longest output (SCORE: of evaluate), so a typo costs no GPU call. A recipe ends in
    its window: its runs' time budgets together (JOBS of a grid's at once) leave its first call (the
    README's window table) three minutes for the start and the final reports; a grid that predicts (a
    search: DECODE set) names the METRIC that picks its best variant."""
    from scratchformer import evaluate, generate
    from scratchformer.data import resolve_source
    from scratchformer.training.config import parse_args

    names = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; echo $RECIPES'], capture_output=True,
                           text=True, check=True).stdout.split()
    assert {"multi30k", "multi30k-eager", "iwslt", "samsum", "cnndm", "ablate-multi30k"} <= set(names)
    first_call = _windows(open(os.path.join(GPU, "README.md")).read())["4 and on"][0][0]
    for name in names:
        show = (f'source "{GPU}/recipes.sh"; recipe {name} && printf "%s\\n" "${{FLAGS[@]}}" -- "${{VARIANTS[@]}}" '
                f'-- "${{DECODE[@]}}" "${{RUNTIME[@]}}" -- "${{SCORE[@]}}" -- "${{LENGTH_PENALTIES[@]}}"')
        lines = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.splitlines()
        cut = [i for i, line in enumerate(lines) if line == "--"]
        assert len(cut) == 4, (name, lines)
        flags, variants = lines[:cut[0]], [v for v in lines[cut[0] + 1:cut[1]] if v]
        decode, score = lines[cut[1] + 1:cut[2]], lines[cut[2] + 1:cut[3]]
        penalties = [["--length-penalty", lp] for lp in lines[cut[3] + 1:] if lp]
        assert "--kernel" in flags and flags[flags.index("--precision") + 1] == "bf16", name
        jobs, metric, decodes = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; recipe {name}; echo '
                                                '"$JOBS ${METRIC:--} ${#DECODE[@]}"'], capture_output=True,
                                               text=True).stdout.split()
        assert not (variants and decodes != "0") or metric != "-", name  # a search picks its best by METRIC
        budgets = []
        for variant in variants or ["="]:
            extra = variant.split("=", 1)[1].split()
            config, _ = parse_args([*flags, *extra, "--out", "runs/x"])
            assert config.kernel == ("eager" if "eager" in extra else "triton"), (name, variant)
            budgets.append(config.time_budget or 0.0)
        budget = sum(max(budgets[i:i + int(jobs)]) for i in range(0, len(budgets), int(jobs)))  # waves of JOBS
        assert budget <= first_call - 180, (name, budget, first_call)
        batch = ["--checkpoint", "x.pt", "--input", "in.jsonl", "--output", "p.jsonl"]  # as 50_train.sh predicts
        for (command, inputs), penalty in itertools.product(((evaluate, ["--checkpoint", "x.pt", *score]),
                                                             (generate, batch)), [[], *penalties]):
            args = command.build_parser().parse_args([*inputs, *decode, *penalty])
            command.check_args(args)
            assert not penalty or args.length_penalty == float(penalty[1]), (name, penalty)
            longest = config.resolved(resolve_source(config.dataset, None, None).task, synthetic=False).max_tgt_len
            assert args.min_len < longest, (name, decode)


def test_recipes_with_cuda_graphs():
    """CUDA_GRAPHS=1 (the default): every recipe (and variant) trains with --cuda-graphs, its validations and
    checkpoints GRAPH_SPACING times further apart in steps, and a run sized in time has its step
    cap raised as much; a fixed-step grid keeps its steps."""
    from scratchformer.training.config import parse_args

    names = subprocess.run(["bash", "-c", f'source "{GPU}/recipes.sh"; echo $RECIPES'], capture_output=True,
                           text=True, check=True).stdout.split()
    for name in names:
        configs = {}
        for graphs in ("0", "1"):
            show = f'source "{GPU}/recipes.sh"; CUDA_GRAPHS={graphs} recipe {name} && printf "%s\\n" "${{FLAGS[@]}}"'
            flags = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()
            configs[graphs], _ = parse_args([*flags, "--out", "runs/x"])
        plain, graphed = configs["0"], configs["1"]
        assert not plain.cuda_graphs and graphed.cuda_graphs, name
        default = f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe {name} && printf "%s\\n" "${{FLAGS[@]}}"'
        flags = subprocess.run(["bash", "-c", default], capture_output=True, text=True, check=True).stdout.split()
        assert "--cuda-graphs" in flags, f"{name}: the recipes replay CUDA graphs unless CUDA_GRAPHS=0"
        assert graphed.eval_every == 4 * plain.eval_every and graphed.save_every == 4 * plain.save_every, name
        assert graphed.max_steps == plain.max_steps * (4 if plain.time_budget else 1), name


def test_train_extra_with_compile_drops_the_recipes_cuda_graphs():
    """TRAIN_EXTRA="--compile --compile-mode reduce-overhead" (step 50's extra flags, as the README
    suggests) on a recipe with --cuda-graphs (the default), which train refuses beside --compile: the
    recipe's --cuda-graphs goes and train takes the flags; other extra flags leave it."""
    from scratchformer.training.config import parse_args

    def flags(extra):
        show = (f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe iwslt && train_extra "{extra}" >/dev/null '
                '&& printf "%s\\n" "${FLAGS[@]}"')
        return subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()

    compiled = flags("--compile --compile-mode reduce-overhead")
    assert "--cuda-graphs" not in compiled and compiled[-3:] == ["--compile", "--compile-mode", "reduce-overhead"]
    config, _ = parse_args([*compiled, "--out", "runs/x"])
    assert config.compile == "inductor" and config.compile_mode == "reduce-overhead" and not config.cuda_graphs
    assert "--cuda-graphs" in flags("--label-smoothing 0.2")


def _archive_of(folder, step, files):
    """A step's archive as the device sends it back: `<step>.tar.gz` holding `files` (name -> text)."""
    src = folder / f"src-{step}"
    src.mkdir(parents=True)
    for name, text in files.items():
        (src / name).write_text(text)
    with tarfile.open(folder / f"{step}.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=".")
    shutil.rmtree(src)


def _bench_json(cases, **extra):
    """A pytest-benchmark file: cases (node id, kernel, median) of one H100 run on 2026-12-01."""
    return json.dumps({"machine_info": {"node": "gpu"}, "benchmarks": [
        {"group": "attention", "name": name, "fullname": f"bench/bench_attention.py::{name}",
         "params": {"L": 4096, "H": 16, "D": 64, "causal": False, "kernel": kernel, "mode": "fwd"},
         "stats": {"median": median}, "extra_info": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01",
                                                      "tflops": 1.0 / median, **extra}}
        for name, kernel, median in cases]})


def test_collect_joins_pieces_in_order(tmp_path, capsys, monkeypatch):
    """collect.join_parts: split's pieces (part0 .. part2 here, as `split -d` names them) joined in
    their numeric order give the file back byte for byte; a folder without pieces adds nothing; pieces
    with one missing between them are not joined, and the missing one is named."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    data = os.urandom(3000)
    calls = tmp_path / "call"
    calls.mkdir()
    for i in (2, 0, 1):
        (calls / f"50_x-averaged.pt.part{i}").write_bytes(data[i * 1024:(i + 1) * 1024])
    (joined,) = collect.join_parts([calls, tmp_path], tmp_path / "work")
    assert joined == tmp_path / "work" / "50_x-averaged.pt" and joined.read_bytes() == data
    # a piece the device left out (files_left_out): the others are not joined into a corrupt checkpoint
    (calls / "50_x-averaged.pt.part1").unlink()
    (calls / "50_x-picked.pt.part0").write_bytes(b"whole")
    assert collect.join_parts([calls], tmp_path / "work2") == [tmp_path / "work2" / "50_x-picked.pt"]
    assert "50_x-averaged.pt: piece 1 missing" in capsys.readouterr().out


def test_collect_files_a_windows_archives(tmp_path, capsys, monkeypatch):
    """scripts/gpu/collect.py: the kernel benchmarks of a window's archives in one
    <date>-<gpu>.json, the end-to-end ones in <date>-<gpu>-e2e.json, profiles beside them, the
    targets table written from both; a later window's archive of the same day adds its cases and
    replaces a case measured again; every step's exit line and pytest summary is reported."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    window1, window2, bench = tmp_path / "w1", tmp_path / "w2", tmp_path / "bench"
    window1.mkdir()
    window2.mkdir()
    dense = [(f"test_dense[4096-h16d64-full-{k}-fwd]", k, m) for k, m in (("triton", 2e-3), ("sdpa_flash", 3e-3))]
    _archive_of(window1, "20_bench_attention", {
        "bench_attention.json": _bench_json(dense), "log.txt": "== 20_bench_attention: exit 0 after 171 s\n",
        "bench_attention.txt": "...\n64 passed in 120.5s\n"})
    _archive_of(window1, "30_bench_train_step", {
        "bench_train_step.json": _bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)]),
        "log.txt": "== 30_bench_train_step: exit 124 after 380 s\n"})
    _archive_of(window1, "31_bench_generate_profile", {  # pytest-benchmark's empty file, a profile cut short
        "bench_generate.json": "", "profile-base-cnndm.txt": "training step profile: shape base-cnndm\ntop kernels\n",
        "profile-small-multi30k.txt": "Traceback (most recent call last):\nKeyboardInterrupt\n",
        "host_overhead.txt": "host time per call, NVIDIA H100\n| triton | 1.0 |\n"})
    bench.mkdir()
    good = "training step profile: shape small-multi30k, an earlier window's\n"
    (bench / "2026-12-01-h100-profile-small-multi30k.txt").write_text(good)
    written = collect.main([str(window1), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    stem = bench / "2026-12-01-h100"
    assert {p.name for p in written} == {"2026-12-01-h100.json", "2026-12-01-h100-e2e.json",
                                         "2026-12-01-h100-profile-base-cnndm.txt", "2026-12-01-h100-host-overhead.txt",
                                         "2026-12-01-h100-targets.md"}
    assert (bench / "2026-12-01-h100-profile-small-multi30k.txt").read_text() == good  # not filed over
    kernels = json.loads(stem.with_suffix(".json").read_text())["benchmarks"]
    assert [b["params"]["kernel"] for b in kernels] == ["triton", "sdpa_flash"]
    assert len(json.loads((bench / "2026-12-01-h100-e2e.json").read_text())["benchmarks"]) == 1
    assert "dense L=4096 D=64 fwd" in (bench / "2026-12-01-h100-targets.md").read_text()  # triton vs flash: 1.5x
    out = capsys.readouterr().out
    assert "20_bench_attention: == 20_bench_attention: exit 0 after 171 s" in out and "64 passed in 120.5s" in out
    assert "exit 124 after 380 s" in out
    assert re.search(r"bench_generate\.json: empty, skipped", out), out
    assert re.search(r"profile-small-multi30k\.txt: not a finished report \(its first line: 'Traceback", out), out

    again = [(dense[0][0], "triton", 1e-3), ("test_dense[2048-h16d64-full-triton-fwd]", "triton", 5e-4)]
    _archive_of(window2, "20_bench_attention", {"bench_attention.json": _bench_json(again)})
    collect.main([str(window2), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    kernels = json.loads(stem.with_suffix(".json").read_text())["benchmarks"]
    medians = [(b["name"], b["stats"]["median"]) for b in kernels]
    assert sorted(medians) == sorted([(dense[1][0], 3e-3), (dense[0][0], 1e-3), (again[1][0], 5e-4)])  # kept,
    # replaced (once), added
    window3 = tmp_path / "w3"  # a finished profile whose generation saved no JSON: said, not dropped silently
    window3.mkdir()
    _archive_of(window3, "31_bench_generate_profile", {"profile-base-cnndm.txt": "training step profile: x\n"})
    capsys.readouterr()
    collect.main([str(window3), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    assert re.search(r"profile-base-cnndm\.txt: finished, but no benchmark JSON .* not filed", capsys.readouterr().out)


def _run_json(commit, when, cases):
    """A pytest-benchmark file of one run: its commit and time at the top, as pytest-benchmark writes
    them, and cases {node id: what its extra_info holds beside the date}."""
    return json.dumps({"commit_info": {"id": commit, "dirty": False, "branch": "main"}, "datetime": when,
                       "machine_info": {"node": commit}, "benchmarks": [
                           {"group": "add_layer_norm", "name": name, "fullname": f"bench/b.py::{name}", "params": {},
                            "stats": {"median": 1e-3}, "extra_info": {"date": when[:10], **extra}}
                           for name, extra in cases.items()]})


def test_collect_names_each_cases_run_and_every_run_merged(tmp_path, monkeypatch):
    """collect.merge, as the 2026-11-27 file was filed: the eighth window's run (commit aaa at 01:21)
    measured cases a and b; the ninth's (bbb at 15:21) measured b and c, b saying its commit and time
    itself (run_bench's), c not (a case saved before run_bench did). Each case names its own run (a the
    eighth's; b and c the ninth's, b's own record kept), the file's top the newest run (bbb at 15:21, its
    machine) and `runs` both, oldest first. Filed in the other order the top is the same, and b is the
    eighth's (the later filing replaces a case). The top once named the first run filed alone: aaa at
    01:21, two of the three cases bbb's."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    a = {"commit": "aaa", "dirty": False, "datetime": "2026-11-27T01:21:26+00:00"}
    b = {"commit": "bbb", "dirty": True, "datetime": "2026-11-27T15:20:01+00:00"}
    c = {"commit": "bbb", "dirty": False, "datetime": "2026-11-27T15:21:00+00:00"}
    eighth, ninth = tmp_path / "eighth.json", tmp_path / "ninth.json"
    eighth.write_text(_run_json("aaa", a["datetime"], {"a": {}, "b": {}}))
    ninth.write_text(_run_json("bbb", c["datetime"], {"b": b, "c": {}}))
    for first, second, b_filed in ((eighth, ninth, b), (ninth, eighth, a)):
        out = tmp_path / f"{first.stem}-first.json"
        for run in (first, second):  # one collect a window, as the windows were filed
            collect.merge([run], out)
        filed = json.loads(out.read_text())
        assert {x["name"]: {k: x["extra_info"].get(k) for k in a} for x in filed["benchmarks"]} == {
            "a": a, "b": b_filed, "c": c}
        assert (filed["commit_info"]["id"], filed["datetime"], filed["machine_info"]) == ("bbb", c["datetime"],
                                                                                          {"node": "bbb"})
        assert filed["runs"] == [a, c]


def test_collect_files_two_calls_of_one_step(tmp_path, capsys, monkeypatch):
    """collect.py given two calls that ran the same step (the tenth window's step 21, once for
    add+LayerNorm, once for the FFN): each archive gets its own folder (<step>, <step>.2) and both
    calls' cases are filed, a case measured in both taking the later call's time; both exit lines
    are reported."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call1, call2, bench, work = tmp_path / "call1", tmp_path / "call2", tmp_path / "bench", tmp_path / "work"
    for folder, cases, seconds in ((call1, [("test_dense[1024-h16d64-full-triton-fwd]", 2e-4),
                                            ("test_dense[4096-h16d64-full-triton-fwd]", 3e-3)], 79),
                                   (call2, [("test_dense[4096-h16d64-full-triton-fwd]", 2e-3)], 131)):
        folder.mkdir()
        _archive_of(folder, "21_bench_norm_ffn_embed", {
            "bench_attention.json": _bench_json([(name, "triton", median) for name, median in cases]),
            "log.txt": f"== 21_bench_norm_ffn_embed: exit 0 after {seconds} s\n"})
    collect.main([str(call1), str(call2), "--bench-dir", str(bench), "--work", str(work)])
    assert sorted(p.name for p in work.iterdir()) == ["21_bench_norm_ffn_embed", "21_bench_norm_ffn_embed.2"]
    filed = json.loads((bench / "2026-12-01-h100.json").read_text())["benchmarks"]
    assert sorted((b["name"], b["stats"]["median"]) for b in filed) == [
        ("test_dense[1024-h16d64-full-triton-fwd]", 2e-4), ("test_dense[4096-h16d64-full-triton-fwd]", 2e-3)]
    out = capsys.readouterr().out
    assert "exit 0 after 79 s" in out and "exit 0 after 131 s" in out, out


def test_collect_files_a_report_under_its_own_steps_date(tmp_path, monkeypatch):
    """A window past midnight (step 30 on one date, step 31 on the next): step 31's profile goes under
    the date its own step's JSON names, not under every date of the call (it overwrote the earlier
    date's profile, filed from another window, with a measurement of the next day)."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call, bench = tmp_path / "call", tmp_path / "bench"
    call.mkdir()
    _archive_of(call, "30_bench_train_step", {
        "bench_train_step.json": _bench_json([("test_train_step[triton-base-cnndm]", "triton", 0.1)])})
    late = _bench_json([("test_generate[triton-greedy]", "triton", 0.2)]).replace("2026-12-01", "2026-12-02")
    _archive_of(call, "31_bench_generate_profile", {
        "bench_generate.json": late, "profile-base-cnndm.txt": "training step profile: shape base-cnndm\n"})
    bench.mkdir()
    earlier = "training step profile: shape base-cnndm, another window's of 2026-12-01\n"
    (bench / "2026-12-01-h100-profile-base-cnndm.txt").write_text(earlier)
    written = collect.main([str(call), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    assert bench / "2026-12-02-h100-profile-base-cnndm.txt" in written
    assert (bench / "2026-12-01-h100-profile-base-cnndm.txt").read_text() == earlier


def test_collect_replaces_an_earlier_collects_numbered_folders(tmp_path, monkeypatch):
    """A window's one call of step 50 collected after an earlier window's two: WORK/50_train.2/ of the
    earlier collect goes too. Left there, finish_on_cpu.sh (which takes the last numbered 50_train
    folder's picked.txt and predictions snapshot) finished this window's run with the other one's
    model choice, decoding flags and predictions."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    work = tmp_path / "work"
    for window, calls in (("w1", ("samsum-1", "samsum-2")), ("w2", ("cnndm-1",))):
        folders = []
        for call in calls:
            folder = tmp_path / window / call
            folder.mkdir(parents=True)
            _archive_of(folder, "50_train", {"picked.txt": f"{call} best.pt --beam-size 4\n",
                                             "log.txt": "== 50_train: exit 0 after 9 s\n"})
            folders.append(folder)
        collect.unpack(folders, work)
    assert sorted(p.name for p in work.iterdir()) == ["50_train"]
    assert (work / "50_train" / "picked.txt").read_text().startswith("cnndm-1 ")


def test_collect_keeps_what_an_archive_cut_short_holds(tmp_path, capsys, monkeypatch):
    """A step archive cut short (the call killed while the step packed it) gives the files before
    the cut, the one it cut removed, and says so; the call's other archives are filed as ever (it
    raised EOFError, and nothing of the window was filed)."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    call, bench, work = tmp_path / "call", tmp_path / "bench", tmp_path / "work"
    call.mkdir()
    dense = [("test_dense[4096-h16d64-full-triton-fwd]", "triton", 2e-3)]
    _archive_of(call, "20_bench_attention", {"bench_attention.json": _bench_json(dense),
                                             "log.txt": "== 20_bench_attention: exit 0 after 99 s\n"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "log.txt").write_text("== 21_bench_norm_ffn_embed: exit 0 after 88 s\n")
    (src / "zz.bin").write_bytes(os.urandom(200_000))  # after log.txt in the archive (tarfile adds in name order)
    with tarfile.open(call / "21_bench_norm_ffn_embed.tar.gz", "w:gz") as tar:
        tar.add(src, arcname=".")
    os.truncate(call / "21_bench_norm_ffn_embed.tar.gz", 100_000)
    collect.main([str(call), "--bench-dir", str(bench), "--work", str(work)])
    out = capsys.readouterr().out
    assert "21_bench_norm_ffn_embed.tar.gz: cut short or unreadable" in out and "1 files unpacked" in out, out
    assert sorted(p.name for p in (work / "21_bench_norm_ffn_embed").iterdir()) == ["log.txt"]
    assert "exit 0 after 88 s" in out and "exit 0 after 99 s" in out
    assert len(json.loads((bench / "2026-12-01-h100.json").read_text())["benchmarks"]) == 1


def _cache_entry(monkeypatch, cache_dir, key, cubin_bytes=b"\x7fELF cubin"):
    """One compiled kernel as Triton's own FileCacheManager writes it: metadata, binary, IR files,
    the group file naming them (absolute paths), and an autotuner timings file."""
    from triton.runtime.cache import FileCacheManager

    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    m = FileCacheManager(key)
    group = {name: m.put(data, name) for name, data in (("k.json", '{"name": "k"}'), ("k.cubin", cubin_bytes),
                                                          ("k.ptx", "// ptx"), ("k.llir", "; llir"))}
    m.put_group("k.json", group)
    m.put('{"configs_timings": []}', "k.autotune.json")


def test_triton_cache_travels_to_another_machine(tmp_path, monkeypatch):
    """scripts/gpu/triton_cache.py: packed on one machine, restored at another path on the next,
    Triton's own cache manager finds each kernel's metadata and binary there (a cache hit: no
    compile) and its autotuner's timings; the IR files stay behind."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache
    from triton.runtime.cache import FileCacheManager

    first, second, archive = tmp_path / "first" / "cache", tmp_path / "second" / "cache", tmp_path / "c.tar.gz"
    for key in ("a" * 32, "b" * 32):
        _cache_entry(monkeypatch, first, key)
    assert triton_cache.main(["pack", str(first), str(archive)]) == 0
    names = sorted(tarfile.open(archive).getnames())
    assert not any(n.endswith((".ptx", ".llir")) for n in names) and len(names) == 8, names
    assert triton_cache.main(["restore", str(archive), str(second)]) == 0
    monkeypatch.setenv("TRITON_CACHE_DIR", str(second))
    for key in ("a" * 32, "b" * 32):
        m = FileCacheManager(key)
        group = m.get_group("k.json")
        assert set(group) == {"k.json", "k.cubin"} and all(p.startswith(str(second)) for p in group.values())
        assert open(group["k.cubin"], "rb").read() == b"\x7fELF cubin"
        assert m.get_file("k.autotune.json")


def test_triton_cache_pack_keeps_to_its_size_and_refuses_odd_archives(tmp_path, monkeypatch):
    """Newest entries first while the archive stays under --max-mb (the device returns files of up
    to 16 MiB); an archive whose members are not ENTRY/FILE is refused, not unpacked; a pack that
    fails leaves the archive it was replacing as it was."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    cache = tmp_path / "cache"
    for i, key in enumerate(("old" + "0" * 29, "new" + "0" * 29)):
        _cache_entry(monkeypatch, cache, key, cubin_bytes=os.urandom(40_000))
        for f in (cache / key).iterdir():
            os.utime(f, (1000.0 + i, 1000.0 + i))
    packed, skipped = triton_cache.pack(cache, tmp_path / "c.tar.gz", max_mb=60_000 / 2**20)
    assert (packed, skipped) == (1, 1)
    # xz, cut by a first try's ratio: random binaries do not compress, so again one of the two
    assert triton_cache.pack(cache, tmp_path / "c.tar.xz", max_mb=60_000 / 2**20) == (1, 1)
    assert (tmp_path / "c.tar.xz").stat().st_size <= 60_000
    assert triton_cache.pack(cache, tmp_path / "all.tar.xz", max_mb=1) == (2, 0)
    assert {n.split("/")[0] for n in tarfile.open(tmp_path / "c.tar.gz").getnames()} == {"new" + "0" * 29}
    assert (tmp_path / "c.tar.gz").stat().st_size <= 60_000
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "c.tar.gz", arcname="../escape")
    assert triton_cache.main(["restore", str(bad), str(tmp_path / "out")]) == 1
    assert not (tmp_path / "escape").exists()
    # an archive appears under its name only whole: a pack that fails midway leaves the last one
    before = (tmp_path / "all.tar.xz").read_bytes()
    monkeypatch.setattr(tarfile.TarFile, "add", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        triton_cache.pack(cache, tmp_path / "all.tar.xz", max_mb=1)
    assert (tmp_path / "all.tar.xz").read_bytes() == before and not list(tmp_path.glob(".*.partial"))


def test_triton_cache_check_finds_a_prewarm_of_other_kernel_sources(tmp_path, monkeypatch, capsys):
    """A prewarm archive is stamped with the hash of the kernel sources it was compiled from; `check`
    says current while they are unchanged, and stale (exit 1) once a kernel file changes, even by a
    line added above a kernel (Triton's key holds each kernel's first line: the 2026-11-28 prewarm
    missed so), or the prewarm's workloads do; an archive without a stamp (a call's own cache) is
    named, not refused."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo, carried = tmp_path / "repo", tmp_path / "carried"
    (repo / "kernels").mkdir(parents=True)
    carried.mkdir()
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")
    for name in ("prewarm.tar.xz", "triton-cache.tar.gz"):
        (carried / name).write_bytes(b"")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert triton_cache.main(["check", str(carried), "--repo", str(repo)]) == 0
    assert dict(triton_cache.check(carried, repo)) == {carried / "prewarm.tar.xz": "current",
                                                      carried / "triton-cache.tar.gz": "unstamped"}
    (repo / "kernels" / "op.py").write_text("TABLE = {}\n@triton.jit\ndef k(x):\n    pass\n")
    assert triton_cache.main(["check", str(carried), "--repo", str(repo)]) == 1
    assert "prewarm.tar.xz: stale" in capsys.readouterr().out
    # a model added to the prewarm's workloads (a recipe's new norm or width) is not in the archive
    (repo / "tools").mkdir()
    (repo / "tools" / "prewarm.py").write_text("MODELS = []\n")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "current"
    (repo / "tools" / "prewarm.py").write_text("MODELS = [('base pre-LN', {})]\n")
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "stale"


def test_run_sh_restores_the_carried_cache_and_sends_it_back(tmp_path):
    """run.sh restores the carried archives (prewarm's .tar.xz, a call's .tar.gz) into
    TRITON_CACHE_DIR once per machine, and packs that folder into $OUT/triton-cache.tar.gz at the
    end of the call, whatever its steps did."""
    src = tmp_path / "src"
    (src / "e").mkdir(parents=True)
    (src / "e" / "k.json").write_text("{}")
    (src / "f").mkdir()
    (src / "f" / "k.cubin").write_bytes(b"\x7fELF")
    carried = tmp_path / "carried"
    carried.mkdir()
    with tarfile.open(carried / "triton-cache.tar.gz", "w:gz") as tar:
        tar.add(src / "e" / "k.json", arcname="e/k.json")
    with tarfile.open(carried / "prewarm.tar.xz", "w:xz") as tar:
        tar.add(src / "f" / "k.cubin", arcname="f/k.cubin")
    out, cache = tmp_path / "out", tmp_path / "cache"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache), "TRITON_CACHE_CARRIED": str(carried)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "no step 99" in res.stdout, res.stdout + res.stderr
    assert (cache / "e" / "k.json").exists() and (cache / "f" / "k.cubin").exists() and (cache / ".restored").exists()
    assert sorted(tarfile.open(out / "triton-cache.tar.gz").getnames()) == ["e/k.json", "f/k.cubin"]


def test_run_sh_sends_back_the_cache_in_what_the_steps_leave_of_64_mib(tmp_path):
    """The device brings back 64 MiB in all: run.sh packs the Triton cache into what the steps' files
    leave (step 50's weights may take 45 MiB), not a fixed 15 MiB beside them, which could take a
    call past 64 and lose a file there (a weights piece: collect.py then joined the others)."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    for i, name in enumerate(("a" * 32, "b" * 32)):
        (cache / name).mkdir(parents=True)
        (cache / name / "k.cubin").write_bytes(os.urandom(6 << 20))  # random: gzip keeps 6 MiB each
        os.utime(cache / name / "k.cubin", (1000.0 + i, 1000.0 + i))
    (cache / ".restored").touch()
    out.mkdir()
    with open(out / "50_x-averaged.pt.part0", "wb") as f:  # what the steps wrote: 53 MiB
        f.truncate(53 << 20)
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    total = sum(f.stat().st_size for f in out.iterdir())
    assert total <= 64 << 20 and [n.split("/")[0] for n in tarfile.open(out / "triton-cache.tar.gz").getnames()] == [
        "b" * 32], (total, res.stdout)


def _ready_repo(tmp_path: Path) -> Path:
    """A checkout holding what scripts/gpu/ready.sh reads: its scripts, setup.py, csrc/ and an empty kernels/."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "gpu").mkdir(parents=True)
    for name in ("ready.sh", "ext_sources.sh", "triton_cache.py"):
        shutil.copy(os.path.join(GPU, name), repo / "scripts" / "gpu")
    shutil.copy(os.path.join(REPO, "setup.py"), repo)
    shutil.copytree(os.path.join(REPO, "csrc"), repo / "csrc")
    (repo / "kernels").mkdir()
    return repo


def _ready(repo: Path) -> subprocess.CompletedProcess:
    """scripts/gpu/ready.sh run in `repo`: its exit status and the parts it names."""
    return subprocess.run(["bash", str(repo / "scripts" / "gpu" / "ready.sh")], capture_output=True, text=True,
                          timeout=60)


def test_ready_names_what_a_call_would_carry_stale_or_missing(tmp_path, monkeypatch):
    """scripts/gpu/ready.sh (make gpu-check), run before a window's first device call: exit 0 only
    when the extension in .gpu_build/ and each carried Triton archive were made from the checkout's
    sources and the wheels and data are there; otherwise exit 1, naming each part. A csrc/ edit
    makes the extension stale, a kernels/ edit the prewarm (a session once found it so by hand)."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo = _ready_repo(tmp_path)
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")

    def ready():
        p = _ready(repo)
        return p.returncode, p.stdout

    rc, out = ready()
    assert rc == 1 and "missing: .gpu_build" in out and "missing: .whl" in out and "missing: .gpu_data" in out, out
    assert "missing: .gpu_cache and .gpu_cache-pinned" in out and "== not ready" in out, out

    def build_ext():  # what make gpu-ext stamps
        (repo / ".gpu_build").mkdir(exist_ok=True)
        (repo / ".gpu_build" / "sources.sha256").write_text(subprocess.run(
            ["bash", str(repo / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True, text=True,
            check=True).stdout)

    build_ext()
    (repo / ".whl").mkdir()
    (repo / ".whl" / "rouge_score-0.1.2-py3-none-any.whl").write_bytes(b"")
    (repo / ".gpu_cache-pinned").mkdir()
    (repo / ".gpu_cache-pinned" / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(repo / ".gpu_cache-pinned" / "prewarm.tar.xz", repo)
    (repo / ".gpu_data" / "multi30k").mkdir(parents=True)
    rc, out = ready()
    assert rc == 0 and "current: .gpu_build" in out and "prewarm.tar.xz: current" in out, out
    assert "packed: .gpu_data/ multi30k" in out and "== ready" in out, out
    cu = next((repo / "csrc" / "cuda").glob("*.cu"))
    cu.write_text(cu.read_text() + "// fixed since\n")
    rc, out = ready()
    assert rc == 1 and "stale: .gpu_build" in out and "prewarm.tar.xz: current" in out, out
    build_ext()
    (repo / "kernels" / "op.py").write_text("TABLE = {}\n@triton.jit\ndef k(x):\n    pass\n")
    rc, out = ready()
    assert rc == 1 and "current: .gpu_build" in out and "prewarm.tar.xz: stale" in out, out


def test_collect_keeps_the_newest_calls_triton_cache_and_unpacks_it_as_no_step(tmp_path, monkeypatch):
    """run.sh's triton-cache.tar.gz lies beside a call's step archives but is no step: it goes whole
    into --cache-dir (what the next call carries), never unpacked into WORK as one; of several
    calls' caches, the newest by its time (here the first folder named) is the one kept."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    calls = []
    for name, mtime in (("call1", 2000.0), ("call2", 1000.0)):  # call1's cache written last
        folder = tmp_path / name
        folder.mkdir()
        _archive_of(folder, "10_tests", {"log.txt": "== 10_tests: exit 0 after 5 s\n"})
        (folder / "triton-cache.tar.gz").write_bytes(f"the Triton cache of {name}".encode())
        os.utime(folder / "triton-cache.tar.gz", (mtime, mtime))
        calls.append(folder)
    work, cache = tmp_path / "work", tmp_path / "gpu_cache"
    collect.main([*map(str, calls), "--bench-dir", str(tmp_path / "bench"), "--work", str(work),
                  "--cache-dir", str(cache)])
    assert sorted(p.name for p in work.iterdir()) == ["10_tests", "10_tests.2"]
    assert (cache / "triton-cache.tar.gz").read_bytes() == b"the Triton cache of call1"


def test_collect_files_both_end_to_end_benchmarks_apart_from_the_kernels(tmp_path, monkeypatch):
    """The end-to-end benchmarks, the training step's (steps 30 and 32) and generation's (step 31),
    go into <date>-<gpu>-e2e.json, and the kernels' (steps 20, 21) into <date>-<gpu>.json: targets.py
    reads issue 17's ratios from the first file and issue 16's from the second."""
    monkeypatch.syspath_prepend(GPU)
    import collect

    monkeypatch.setattr(collect.subprocess, "run", lambda *a, **k: None)  # targets.py and the plots: not here
    call, bench = tmp_path / "call", tmp_path / "bench"
    call.mkdir()
    bench.mkdir()
    for step, json_name, case in (("20_bench_attention", "bench_attention", "test_dense[4096]"),
                                  ("30_bench_train_step", "bench_train_step", "test_train_step[triton-base-cnndm]"),
                                  ("31_bench_generate_profile", "bench_generate", "test_generate[triton-greedy]")):
        _archive_of(call, step, {f"{json_name}.json": _bench_json([(case, "triton", 0.1)])})
    collect.main([str(call), "--bench-dir", str(bench), "--work", str(tmp_path / "work")])
    filed = {p.name: sorted(b["name"] for b in json.loads(p.read_text())["benchmarks"]) for p in bench.glob("*.json")}
    assert filed == {"2026-12-01-h100.json": ["test_dense[4096]"],
                     "2026-12-01-h100-e2e.json": ["test_generate[triton-greedy]", "test_train_step[triton-base-cnndm]"]}


def test_triton_cache_pack_passes_over_an_entry_too_large_for_the_archive(tmp_path, monkeypatch):
    """A call's gzip archive (run.sh) takes each entry that still fits, newest first: an entry too
    large for --max-mb (the newest here, 200 kB against a 100 kB cap) is left out and the older,
    smaller ones after it still go in, rather than the archive ending at the first that does not fit.
    (The prewarm's xz archive keeps the longest prefix that fits: its order is the order of need.)"""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    cache = tmp_path / "cache"
    for i, (key, size) in enumerate((("old1" + "0" * 28, 10_000), ("old2" + "0" * 28, 10_000),
                                     ("big" + "0" * 29, 200_000))):
        _cache_entry(monkeypatch, cache, key, cubin_bytes=os.urandom(size))
        for f in (cache / key).iterdir():
            os.utime(f, (1000.0 + i, 1000.0 + i))
    assert triton_cache.pack(cache, tmp_path / "c.tar.gz", max_mb=100_000 / 2**20) == (2, 1)
    assert {n.split("/")[0] for n in tarfile.open(tmp_path / "c.tar.gz").getnames()} == {
        "old1" + "0" * 28, "old2" + "0" * 28}


def test_triton_cache_restore_refuses_a_member_outside_an_entry_folder(tmp_path, monkeypatch):
    """Triton's cache holds files only inside entry folders (ENTRY/FILE): an archive with a file at
    its top level or one folder deeper is refused, and nothing of it is unpacked."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    payload = tmp_path / "k.cubin"
    payload.write_bytes(b"\x7fELF")
    for i, name in enumerate(("k.cubin", "entry/sub/k.cubin")):
        archive, cache = tmp_path / f"odd{i}.tar.gz", tmp_path / f"cache{i}"
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(payload, arcname="good/k.cubin")
            tar.add(payload, arcname=name)
        assert triton_cache.main(["restore", str(archive), str(cache)]) == 1, name
        assert not list(cache.rglob("*.cubin")), name


def test_triton_cache_check_finds_a_kernel_file_renamed(tmp_path, monkeypatch):
    """A kernel module renamed (kernels/op.py -> kernels/ops.py, its text the same) moves its kernels
    to another module, which Triton's cache key names (JITFunction's `module.qualname`): a prewarm
    stamped before then holds entries that miss, so `check` says stale."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo, carried = tmp_path / "repo", tmp_path / "carried"
    (repo / "kernels").mkdir(parents=True)
    carried.mkdir()
    (repo / "kernels" / "op.py").write_text("@triton.jit\ndef k(x):\n    pass\n")
    (carried / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(carried / "prewarm.tar.xz", repo)
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "current"
    (repo / "kernels" / "op.py").rename(repo / "kernels" / "ops.py")
    assert dict(triton_cache.check(carried, repo))[carried / "prewarm.tar.xz"] == "stale"


def test_run_sh_gives_each_step_the_calls_deadline_and_reports_a_failed_or_skipped_step(tmp_path):
    """run.sh exports the call's deadline (now + CALL_SECONDS) to its steps, whose limits it caps;
    a step that fails makes the call fail; a step that would start with under a minute left is
    skipped, named, and fails the call too (its archive will be missing). By default the call's
    deadline is 570 s away: the device allows a command 600, and run.sh packs the cache after the steps."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    shutil.copy(os.path.join(GPU, "run.sh"), gpu)
    (gpu / "10_a.sh").write_text('echo "deadline ${GPU_DEADLINE:-unset}"; exit 3\n')
    (gpu / "20_b.sh").write_text('echo "b ran"\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / ".restored").touch()  # restored already: nothing carried to restore
    env = {k: v for k, v in os.environ.items() if k != "OUT"}

    def call(seconds):
        env.update(TRITON_CACHE_DIR=str(cache), CALL_SECONDS=str(seconds))
        if seconds is None:
            del env["CALL_SECONDS"]
        start = int(__import__("time").time())
        p = subprocess.run(["bash", str(gpu / "run.sh"), "10", "20"], env=env, capture_output=True, text=True,
                           timeout=60)
        return start, p

    start, p = call(300)
    deadline = int(re.search(r"deadline (\d+)", p.stdout)[1])
    assert p.returncode == 3 and "b ran" in p.stdout and start + 300 <= deadline <= start + 302, p.stdout
    start, p = call(None)  # the default: 570 of the 600 s the device allows a command, 30 for the cache's packing
    deadline = int(re.search(r"deadline (\d+)", p.stdout)[1])
    assert start + 570 <= deadline <= start + 572, p.stdout
    _, p = call(59)
    assert p.returncode == 1 and "deadline" not in p.stdout and "b ran" not in p.stdout, p.stdout
    assert "SKIPPED 10_a.sh" in p.stdout and "SKIPPED 20_b.sh" in p.stdout, p.stdout


def test_run_sh_sends_back_no_cache_archive_over_15_mib(tmp_path, monkeypatch):
    """A file comes back from the device only under 16 MiB: with nothing else in $OUT, run.sh still
    packs the Triton cache into at most 15 MiB (the newest entries), not all 63 the call leaves."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    for i, name in enumerate(("a" * 32, "b" * 32, "c" * 32)):
        (cache / name).mkdir(parents=True)
        (cache / name / "k.cubin").write_bytes(os.urandom(6 << 20))  # random: gzip keeps 6 MiB each
        os.utime(cache / name / "k.cubin", (1000.0 + i, 1000.0 + i))
    (cache / ".restored").touch()
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    archive = out / "triton-cache.tar.gz"
    assert archive.stat().st_size <= 15 << 20, res.stdout
    assert sorted(n.split("/")[0] for n in tarfile.open(archive).getnames()) == ["b" * 32, "c" * 32], res.stdout
    # triton_cache.py's own default, packing by hand without --max-mb: the same 15 MiB
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    assert triton_cache.main(["pack", str(cache), str(tmp_path / "by_hand.tar.gz")]) == 0
    assert (tmp_path / "by_hand.tar.gz").stat().st_size <= 15 << 20


def test_prelude_caps_each_commands_limit_by_the_dry_run_and_the_calls_deadline(tmp_path):
    """`limit SECONDS` (every run_pytest and run_cmd): SECONDS, at most 240 in a dry run, and never
    past the call's deadline less 25 s for packing, nor under 10 s: hand-worked for a deadline 100 s
    away (75) and one 20 s away (-5: 10)."""
    body = ('echo "dry $(limit 300) $(limit 30) gpu $(DRY=0 limit 300)"\n'
            'echo "near $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 100 )) limit 300)"\n'
            'echo "past $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 20 )) limit 300)"\n'
            'echo "far $(DRY=0 GPU_DEADLINE=$(( $(date +%s) + 1000 )) limit 300)"\n')
    p = _prelude_step(tmp_path / "96_limit.sh", body, tmp_path / "out")
    assert p.returncode == 0, p.stdout[-3000:]
    assert "dry 240 30 gpu 300" in p.stdout, p.stdout[-2000:]
    assert int(re.search(r"near (\d+)", p.stdout)[1]) in (74, 75), p.stdout[-2000:]
    assert "past 10" in p.stdout and "far 300" in p.stdout, p.stdout[-2000:]


def test_train_extra_with_compile_in_one_word_drops_the_recipes_cuda_graphs():
    """TRAIN_EXTRA="--compile=inductor" (the flag and its backend in one word, as argparse takes it) is
    --compile too: the recipe's --cuda-graphs, which train refuses beside it, goes."""
    from scratchformer.training.config import parse_args

    show = (f'source "{GPU}/recipes.sh"; unset CUDA_GRAPHS; recipe iwslt && train_extra "--compile=inductor" '
            '>/dev/null && printf "%s\\n" "${FLAGS[@]}"')
    flags = subprocess.run(["bash", "-c", show], capture_output=True, text=True, check=True).stdout.split()
    assert "--cuda-graphs" not in flags and flags[-1] == "--compile=inductor", flags
    config, _ = parse_args([*flags, "--out", "runs/x"])
    assert config.compile == "inductor" and not config.cuda_graphs


def test_run_sh_restores_the_carried_cache_once_per_machine(tmp_path):
    """A warm machine's second call finds TRITON_CACHE_DIR/.restored and restores nothing again: the
    carried (older) archive must not overwrite what the first call compiled or tuned since."""
    carried, cache = tmp_path / "carried", tmp_path / "cache"
    carried.mkdir()
    (cache / "e").mkdir(parents=True)
    (cache / "e" / "k.autotune.json").write_text('{"tuned": "on this machine, after the restore"}')
    (cache / ".restored").touch()
    src = tmp_path / "k.autotune.json"
    src.write_text('{"tuned": "carried"}')
    with tarfile.open(carried / "triton-cache.tar.gz", "w:gz") as tar:
        tar.add(src, arcname="e/k.autotune.json")
    env = {**{k: v for k, v in os.environ.items() if k != "OUT"}, "TRITON_CACHE_DIR": str(cache),
           "TRITON_CACHE_CARRIED": str(carried)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "restored" not in res.stdout, res.stdout + res.stderr
    assert (cache / "e" / "k.autotune.json").read_text() == '{"tuned": "on this machine, after the restore"}'


def _recording_python(folder, train_exit):
    """A python whose `scratchformer.train` is recorded in FOLDER/train.calls and exits `train_exit`
    at once (the rest runs): step 50's decisions around its training, without training."""
    fake = folder / "python"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do if [ "$a" = scratchformer.train ]; then\n'
                    f'  echo "$*" >> "{folder}/train.calls"; exit {train_exit}; fi; done\n'
                    f'exec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    return fake


def test_train_step_stops_at_its_deadline_without_retrying_launched_or_starting_late(tmp_path):
    """A --cuda-graphs run that ends in the call's SIGINT (exit 130: the deadline, not a capture CUDA
    refused) is not trained again launched in the same call (it would start past the deadline); and a
    call with under 30 s of training left (a deadline 110 s away: the prelude's 25 s and the dry run's
    60 s leave 25, less what the prelude took) starts no training at all, and says to call again."""
    (tmp_path / "data" / "iwslt2017_en_de").mkdir(parents=True)
    env = dict(GPU_DATA=str(tmp_path / "data"), GPU_RUNS=str(tmp_path / "runs"), RECIPE="iwslt", CUDA_GRAPHS="1",
               PY=str(_recording_python(tmp_path, 130)))
    p = _dry_run("50_train.sh", str(tmp_path / "o1"), **env)
    _, log = _archive(str(tmp_path / "o1"), "50_train.sh")
    calls = (tmp_path / "train.calls").read_text().splitlines()
    assert len(calls) == 1 and "--cuda-graphs" in calls[0] and "training on launched steps" not in log, log[-3000:]
    assert p.returncode == 130 and "iwslt: not finished, call again" in log, log[-3000:]
    (tmp_path / "train.calls").unlink()
    deadline = str(int(__import__("time").time()) + 110)
    p = _dry_run("50_train.sh", str(tmp_path / "o2"), GPU_DEADLINE=deadline, **env)
    _, log = _archive(str(tmp_path / "o2"), "50_train.sh")
    left = re.search(r"too little time left to train \((-?\d+)s\): call again", log)
    assert left and 0 < int(left[1]) < 30, log[-3000:]
    assert not (tmp_path / "train.calls").exists() and p.returncode == 0, log[-3000:]


def test_run_sh_sends_back_no_cache_archive_where_the_steps_leave_no_room(tmp_path):
    """Steps that leave under 1 MiB of the 64 the device returns (step 50's weights, say): no
    triton-cache.tar.gz at all, said so. Not an empty one, which collect.py would keep in .gpu_cache
    over the last good one, and the next call would carry nothing."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / ("a" * 32)).mkdir(parents=True)
    (cache / ("a" * 32) / "k.cubin").write_bytes(b"\x7fELF")
    (cache / ".restored").touch()
    out.mkdir()
    with open(out / "50_x-averaged.pt.part0", "wb") as f:  # what the steps wrote: 62.5 MiB, counted as 63
        f.truncate((125 << 20) // 2)
    env = {**os.environ, "OUT": str(out), "TRITON_CACHE_DIR": str(cache)}
    res = subprocess.run(["bash", os.path.join(GPU, "run.sh"), "99"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["50_x-averaged.pt.part0"], res.stdout
    assert "Triton cache not sent back: the steps' files take 63 MiB" in res.stdout, res.stdout


def test_ready_wants_the_rouge_score_wheel_not_any_wheel(tmp_path, monkeypatch):
    """.whl holding other wheels but not rouge-score's (the one the ROUGE tests and the summarization
    scores import on the GPU machine, which has no network) is missing it: not ready, named."""
    monkeypatch.syspath_prepend(GPU)
    import triton_cache

    repo = _ready_repo(tmp_path)
    (repo / ".gpu_build").mkdir()
    (repo / ".gpu_build" / "sources.sha256").write_text(subprocess.run(
        ["bash", str(repo / "scripts" / "gpu" / "ext_sources.sh")], capture_output=True, text=True, check=True).stdout)
    (repo / ".gpu_cache").mkdir()
    (repo / ".gpu_cache" / "prewarm.tar.xz").write_bytes(b"")
    triton_cache.stamp(repo / ".gpu_cache" / "prewarm.tar.xz", repo)
    (repo / ".gpu_data" / "multi30k").mkdir(parents=True)
    (repo / ".whl").mkdir()
    (repo / ".whl" / "nltk-3.9.1-py3-none-any.whl").write_bytes(b"")
    p = _ready(repo)
    assert p.returncode == 1 and "missing: .whl/rouge_score-*.whl" in p.stdout and "== not ready" in p.stdout, p.stdout
    (repo / ".whl" / "rouge_score-0.1.2-py3-none-any.whl").write_bytes(b"")
    p = _ready(repo)
    assert p.returncode == 0 and "current: .whl" in p.stdout, p.stdout


def test_a_step_exits_with_its_first_failing_commands_status_not_its_last(tmp_path):
    """A step's exit status is that of its first command that failed (run_pytest's or run_cmd's),
    whatever runs after it: pytest's 5 (nothing collected) before a command's 3, the 3 before a
    pytest's 5, and either before a last command that succeeds (a step then ending 0 would hide it)."""
    body = ('run_pytest 60 1 empty tests/test_metrics.py -k no_test_has_this_name\n'
            'run_cmd 30 three sh -c "exit 3"\n'
            'echo "first pytest: $STATUS"; STATUS=0\n'
            'run_cmd 30 three sh -c "exit 3"\n'
            'run_pytest 60 1 empty tests/test_metrics.py -k no_test_has_this_name\n'
            'echo "first a command: $STATUS"\n'
            'run_cmd 30 fine true\n')
    p = _prelude_step(tmp_path / "95_status.sh", body, tmp_path / "out")
    assert "first pytest: 5" in p.stdout and "first a command: 3" in p.stdout, p.stdout[-3000:]
    assert p.returncode == 3 and "== 95_status: exit 3 after" in p.stdout, p.stdout[-3000:]
