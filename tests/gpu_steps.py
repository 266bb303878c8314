"""Running the GPU plan's steps (scripts/gpu/) on the CPU, for test_gpu_plan.py, test_gpu_train_step.py
and test_gpu_collect.py: a step's environment as on the GPU machine, a dry run, a step of the prelude
written on the spot, the archive a step leaves, and a pytest-benchmark file."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(REPO, "scripts", "gpu")
STEPS = sorted(f for f in os.listdir(GPU) if re.fullmatch(r"\d\d_\w+\.sh", f))


def step_env(**extra):
    """The environment of a step run as on the GPU machine, from a shell: without this suite's
    settings (the interpreter, pinned tiles, paths) nor pytest's own (an xdist worker's
    PYTEST_XDIST_WORKER makes the steps' pytest-benchmark runs refuse --benchmark-only). The recipes
    launch their steps here (CUDA_GRAPHS=0: a CPU captures no CUDA graph) unless a test says otherwise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    for key in ("TRITON_INTERPRET", "SCRATCHFORMER_AUTOTUNE", "PYTHONPATH"):
        env.pop(key, None)
    return {**env, "GPU_DRY_RUN": "1", "PY": sys.executable, "CUDA_GRAPHS": "0", **extra}


def dry_run(step, out, **extra):
    env = step_env(OUT=out, **extra)
    return subprocess.run(["bash", os.path.join(GPU, step)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def prelude_step(step: Path, body: str, out: Path) -> subprocess.CompletedProcess:
    """`step`, a step script of the prelude and `body`, written and run as a step (`step_env`, OUT=out)."""
    step.write_text(f'source "{GPU}/prelude.sh"\n{body}')
    return subprocess.run(["bash", str(step)], cwd=REPO, env=step_env(OUT=str(out)), capture_output=True,
                          text=True, timeout=300)


def step_archive(out, step):
    with tarfile.open(os.path.join(out, step.replace(".sh", ".tar.gz"))) as tar:
        return {os.path.normpath(m.name): m for m in tar.getmembers()}, tar.extractfile("./log.txt").read().decode()


def bench_json(cases, **extra):
    """A pytest-benchmark file: cases (node id, kernel, median) of one H100 run on 2026-12-01."""
    return json.dumps({"machine_info": {"node": "gpu"}, "benchmarks": [
        {"group": "attention", "name": name, "fullname": f"bench/bench_attention.py::{name}",
         "params": {"L": 4096, "H": 16, "D": 64, "causal": False, "kernel": kernel, "mode": "fwd"},
         "stats": {"median": median}, "extra_info": {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-01",
                                                      "tflops": 1.0 / median, **extra}}
        for name, kernel, median in cases]})
