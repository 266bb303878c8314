"""bench/conftest.py's run_bench, on the one benchmark that runs on a CPU (the embedding op): what
a saved case records (issue 16 asks for the device, dtype, shapes, torch and Triton versions and
the command in every case), and the compile pass of scripts/gpu/ (--benchmark-disable: the case
warms up, then is skipped, and nothing is timed)."""

import json
import os
import subprocess
import sys

import torch
import triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = "bench/bench_embed.py::test_embed[fwd-N4096-d256-float32-eager]"


def _bench(tmp_path, *flags):
    """CASE under pytest-benchmark with `flags` -> (the saved cases, or None without a file; stdout)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not as an xdist worker
    out = tmp_path / "run.json"
    p = subprocess.run([sys.executable, "-m", "pytest", CASE, "-p", "no:cacheprovider", "-q", "-rs",
                        f"--benchmark-json={out}", *flags], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return (json.loads(out.read_text())["benchmarks"] if out.exists() else None), p.stdout


def test_a_saved_case_names_what_it_ran_on(tmp_path):
    (case,), _ = _bench(tmp_path, "--benchmark-only")
    info = case["extra_info"]
    assert info["device"] and info["torch"] == torch.__version__ and info["triton"] == triton.__version__
    assert info["dtype"] == "torch.float32" and (info["tokens"], info["d_model"]) == (4096, 256)
    assert "bench_embed.py" in info["command"] and info["autotune"] is True and info["gbps"] > 0
    assert case["stats"]["rounds"] == 10


def test_a_compile_pass_times_nothing(tmp_path):
    cases, out = _bench(tmp_path, "--benchmark-disable")
    assert not cases and "1 skipped" in out and "compiled and tuned, nothing timed" in out
