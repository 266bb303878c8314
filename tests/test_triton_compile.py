"""Every Triton kernel of ours compiles for real NVIDIA GPUs (sm_90 H100, sm_80 A100), no GPU needed.

The rest of the suite runs the kernels in Triton's interpreter, which never lowers them, so it
cannot see tl.dot shape/dtype constraints, layout failures, constexpr typing problems or autotune
configs that overflow shared memory. `tools/compile_check.py` compiles them ahead of
time with Triton's compiler and bundled ptxas (see its docstring for what it compiles). It runs in
a subprocess per op: conftest sets TRITON_INTERPRET=1 at import and `triton.jit` reads it when a
kernel is defined, so the kernels must be imported in a fresh process without it.

By default it compiles for sm_90 in bf16, the dtype the model trains in: about 2 minutes on 2
cores. SCRATCHFORMER_COMPILE_CHECK=full (or `make compile-check`) adds sm_80 and fp16/fp32: about
12 minutes on 2 cores, which is why it is not the default. SCRATCHFORMER_COMPILE_CHECK=quick
(`make test`'s run with the CPU machines' Triton, when the GPU machines' Triton checks the default
after it: `make test-triton-min`) compiles every kernel and flag combination through ptxas with
one config per launch, its largest tile, and sweeps no shared memory (`tools/compile_check.py --quick`).

The compiled code is read too where a kernel's form is meant to save work: the attention forward's
unmasked loop is checked for one multiply per score (`tools/sass_loops.py`).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repo root: `tools` is importable from there

OPS = ["attention", "add_layer_norm", "matmul", "ffn"]


def _bundled_ptxas():
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    bin_dir = os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin")
    tools = [os.path.join(bin_dir, t) for t in ("ptxas", "ptxas-blackwell")]  # sm_80 and sm_90 use these
    return tools if all(os.access(t, os.X_OK) for t in tools) else None


pytestmark = pytest.mark.skipif(
    _bundled_ptxas() is None, reason="Triton's bundled ptxas is missing (triton/backends/nvidia/bin)"
)


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory):
    """One Triton cache for the per-op runs (ffn's GEMMs reuse matmul's), fresh per session unless
    TRITON_CACHE_DIR is set (then warm reruns are fast)."""
    return os.environ.get("TRITON_CACHE_DIR") or str(tmp_path_factory.mktemp("triton_cache"))


@pytest.mark.parametrize("op", OPS)
def test_kernels_compile_for_sm90_sm80(op, triton_cache):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = triton_cache
    mode = os.environ.get("SCRATCHFORMER_COMPILE_CHECK", "")
    if mode not in ("", "full", "quick"):
        pytest.fail(f"SCRATCHFORMER_COMPILE_CHECK={mode!r}: expected full, quick or unset")
    flags = ["--targets", "sm90,sm80"] if mode == "full" else ["--targets", "sm90", "--dtypes", "bf16"]
    flags += ["--quick"] if mode == "quick" else []
    cmd = [sys.executable, "-m", "tools.compile_check", op, *flags]
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    print(proc.stderr[-20000:], file=sys.stderr)
    print(f"{op}: compile check took {time.time() - t0:.1f}s")
    assert proc.returncode == 0, f"{op}: Triton AOT compile check failed (exit {proc.returncode}):\n" + "\n".join(
        proc.stdout.splitlines()[-40:]
    )


@pytest.mark.parametrize("tma, head_dim, config", [(True, 128, (128, 64, 8, 3)), (False, 64, (128, 64, 4, 3))])
def test_attention_forward_scales_each_score_in_one_fma(tma, head_dim, config, triton_cache):
    """The forward's unmasked loop, compiled for sm_90 (`tools/sass_loops.py`), multiplies each score
    once, inside the FMA that subtracts the row maximum: its FMULs are the accumulator's rescale
    (BLOCK_M x D over the threads) and a few per row, not one more per score. The form before
    (scale, then max, then subtract) kept a separate multiply per score: 96 FMULs, not 66, at head
    dim 128 with the TMA path, 128 x 64 tiles and 8 warps; 128, not 68, at head dim 64 by pointers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = triton_cache
    cmd = [sys.executable, "-m", "tools.sass_loops", "attention_fwd", "--head-dim", str(head_dim),
           "--config", ",".join(map(str, config)), "--json", *(["--tma"] if tma else [])]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    unmasked = json.loads(proc.stdout)[0]["ops"]  # no lengths, not causal: the first loop is the unmasked one
    bm, bn, warps, _ = config
    threads = 32 * warps
    acc, scores = bm * head_dim // threads, bm * bn // threads  # per thread
    assert unmasked["MUFU"] >= scores and unmasked["FFMA"] >= scores, unmasked
    assert acc <= unmasked["FMUL"] < acc + scores, unmasked
