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
one config per launch, its smallest tile, and sweeps no shared memory (`tools/compile_check.py --quick`).

The compiled code is read too where a kernel's form is meant to save work: the attention forward's
unmasked loop is checked for one multiply per score, and the dK/dV loop's for none of the per-row
work the preprocessing pass does once (`tools/sass_loops.py`).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from scratchformer.kernels import attention as A

ROOT = Path(__file__).resolve().parent.parent  # the repo root: `tools` is importable from there

OPS = ["attention", "add_layer_norm", "matmul", "ffn", "cross_entropy"]


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


FMA_CASES = [(True, 128, (128, 64, 8, 3)), (False, 64, (128, 64, 4, 3))]  # tma, head_dim, config
LSE_CASES = [(True, 128, (64, 64, 4, 2)), (False, 64, (32, 64, 4, 2))]
REGISTER_CASES = [("attention_fwd", (128, 128, 8, 2)), ("attention_fwd", (128, 128, 4, 2)),
                  ("attention_dkdv", (64, 128, 8, 2)), ("attention_dkdv", (32, 128, 4, 2))]  # kernel, config


def _sass_key(item):
    """The (kernel, tma, head_dim, config) a collected test of the three below reads, else None."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if item.originalname == "test_attention_forward_scales_each_score_in_one_fma":
        return "attention_fwd", params["tma"], params["head_dim"], params["config"]
    if item.originalname == "test_attention_dkdv_loop_reads_lse_in_log2_units":
        return "attention_dkdv", params["tma"], params["head_dim"], params["config"]
    if item.originalname == "test_attention_register_model_matches_ptxas":
        return params["kernel"], True, 128, params["config"]
    return None


@pytest.fixture(scope="module")
def sass_reports(request, triton_cache):
    """`tools/sass_loops.py --json` of every (kernel, tma, head_dim, config) the selected tests below
    read, two processes at a time, when the first of them asks (each process is mostly its start-up
    and one compile: one at a time, a core idled for half of it) -> {key: the finished process}."""
    keys = list(dict.fromkeys(k for item in request.session.items if item.module is request.module
                              and (k := _sass_key(item)) is not None))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = triton_cache

    def run(key):
        kernel, tma, head_dim, config = key
        cmd = [sys.executable, "-m", "tools.sass_loops", kernel, "--head-dim", str(head_dim),
               "--config", ",".join(map(str, config)), "--json", *(["--tma"] if tma else [])]
        return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(keys, pool.map(run, keys), strict=True))


def _compiled(kernel, tma, head_dim, config, sass_reports):
    """`tools/sass_loops.py`'s report of an attention kernel compiled for sm_90 (no lengths, not
    causal): {"resources": registers and spills a thread, "loops": each loop's instructions}."""
    proc = sass_reports[kernel, tma, head_dim, config]
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("tma, head_dim, config", FMA_CASES)
def test_attention_forward_scales_each_score_in_one_fma(tma, head_dim, config, sass_reports):
    """The forward's unmasked loop multiplies each score once, inside the FMA that subtracts the
    row maximum: its FMULs are the accumulator's rescale (BLOCK_M x D over the threads) and a few
    per row, not one more per score. The form before (scale, then max, then subtract) kept a
    separate multiply per score: 96 FMULs, not 66, at head dim 128 with the TMA path, 128 x 64
    tiles and 8 warps; 128, not 68, at head dim 64 by pointers."""
    unmasked = _compiled("attention_fwd", tma, head_dim, config, sass_reports)["loops"][0]["ops"]  # the first
    bm, bn, warps, _ = config
    threads = 32 * warps
    acc, scores = bm * head_dim // threads, bm * bn // threads  # per thread
    assert unmasked["MUFU"] >= scores and unmasked["FFMA"] >= scores, unmasked
    assert acc <= unmasked["FMUL"] < acc + scores, unmasked


@pytest.mark.parametrize("tma, head_dim, config", LSE_CASES)
def test_attention_dkdv_loop_reads_lse_in_log2_units(tma, head_dim, config, sass_reports):
    """The dK/dV loop reads each query block's lse as the preprocessing pass left it (log2 units,
    +inf for -inf), so its unmasked loop multiplies each score once (dS = P (dP - δ)) and compares
    nothing; converting lse there, once a query block and key block, cost 16 FMULs, 16 FSETPs
    and 16 FSELs an iteration at both configs (411 -> 364 instructions at head dim 128)."""
    loops = _compiled("attention_dkdv", tma, head_dim, config, sass_reports)["loops"]
    assert len(loops) == 3, loops  # the causal diagonal / a partial key block, the unmasked middle, the tail
    unmasked = loops[1]["ops"]
    bm, bn, warps, _ = config
    scores = bm * bn // (32 * warps)  # per thread
    assert unmasked["MUFU"] >= scores and unmasked["FMUL"] <= scores, unmasked
    assert "FSETP" not in unmasked, unmasked


@pytest.mark.parametrize("kernel, config", REGISTER_CASES)
def test_attention_register_model_matches_ptxas(kernel, config, sass_reports):
    """The tuner's register model (`kernels/attention.py` LIVE_VALUES, MAX_LIVE_VALUES) against
    ptxas at head dim 128 with the TMA path: a config over the bound (256, 320 live values a
    thread) spills hundreds of bytes, one at it (192) little or nothing, so the configs the tuner
    is no longer offered are ones that spill most (Triton 3.9: 648 and 800 bytes against 0 and 72;
    3.6: 376-1,264 for every config pruned at head dims 64 and 128, at most 168 for those kept)."""
    bm, bn, warps, _ = config
    over = A.LIVE_VALUES[kernel.removeprefix("attention_")](bm, bn, 128) / (32 * warps) > A.MAX_LIVE_VALUES
    resources = _compiled(kernel, True, 128, config, sass_reports)["resources"]
    assert (resources["stack"] >= 256) == over, resources
