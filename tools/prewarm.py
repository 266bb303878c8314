"""Triton's cache filled on the CPU machine with the kernels a GPU window compiles first, so the
window's first minutes load them instead (scripts/gpu/triton_cache.py carries the archive).

    make gpu-prewarm        (= .venv-gpu/bin/python -m tools.prewarm [--workloads model bench]
                            [--tiles pinned tuned] [--no-tests] [--jobs N] [--max-mb 16]
                            [--out .gpu_cache/prewarm.tar.xz], from the repo root)

What a GPU step spends first is compiling: every autotune config of every kernel specialisation
its shapes reach, 1-3 s of CPU each (step 30's compile pass: 111-131 s per triton case on an
H100's 16 cores). Triton's cache is content-addressed (scripts/gpu/triton_cache.py), so the
same compile done here is the same cache entry there, provided it is the same Triton build (its
key hashes libtriton.so, which differs per Python version: run this in the GPU machines' stack,
`.venv-gpu`, Python 3.12 and Triton 3.6, `make gpu-prewarm`), the same kernel sources, the same
target (sm_90) and the same cache-invalidating TRITON_* variables (none here, none there).

How: the kernels are imported without the interpreter, Triton's active driver is a stand-in that
reports an sm_90 device, and `JITFunction.run` always takes its `warmup=True` path: Triton's own
binder, specialisation (16-byte divisibility from the real CPU tensors' pointers and ints),
options, cache key and compile, then no launch. An autotuned kernel compiles every config its
Autotuner keeps for that launch (`Autotuner.warmup`). What runs through them is the workload:
- model: a bf16 training step (forward to the model's own loss, as training computes it, so the
  fused generator + loss kernels/cross_entropy.py too; backward) and the decoding that follows it
  (encoder, decoder steps over static caches, as on a GPU) of the issue-18 recipes' models and the
  benchmarks' presets: small (Post-LN, ReLU; Multi30k, IWSLT with 3 layers, SAMSum with --copy),
  the multi30k-tiny recipe's d_model 128,
  base (CNN/DM abstractive, and Pre-LN for the extractive recipe), and Pre-LN and GELU variants;
- bench: the kernel benchmarks' own calls where they differ from the model's (attention at head
  dim 128, causal and padded; the FFN with GELU);
each with the pinned tiles (SCRATCHFORMER_AUTOTUNE=0: the tests, smoke runs and recipes) and the
tuned lists (the benchmarks), a process each (the lists are fixed at import); then the kernel
tests themselves, pinned, with asserts off (`python -O -m pytest --assert=plain -p tools.prewarm`,
as tests/compile_recorder.py counts them). Packed in that order into an xz archive of --max-mb.
The outputs are garbage (no kernel runs): only shapes, dtypes, strides and flags matter, and
those are what the model code produces. On the GPU the carried entries are cache hits exactly
when all of the above match; a miss costs nothing but the compile it would have done anyway.
"""

from __future__ import annotations

import os

# before any kernel module is imported; "0", not unset, so that the tests' conftest (the plugin's
# run) does not turn the interpreter on
os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGET = GPUTarget("cuda", 90, 32)  # what an H100's (and H200's) driver reports
H100_SMS = 132  # streaming multiprocessors of an H100 SXM (and an H200)


class StandInDriver:
    """Triton's active driver for compiling without a GPU: device 0, stream 0, an sm_90 target;
    anything else it is asked for means a launch got past `compile_only`."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return TARGET

    def __getattr__(self, name):
        raise RuntimeError(f"prewarm's stand-in driver has no {name!r}: something tried to run a kernel")


@contextlib.contextmanager
def compile_only(modules):
    """Every launch compiles (every kept config of an autotuned one) and runs nothing; counts them."""
    from triton.runtime import driver

    counts = {"launches": 0}
    saved_jit, saved_tuner = JITFunction.run, Autotuner.run
    real = driver._active  # None on a machine without a GPU: no driver to restore

    def jit_run(self, *args, grid, warmup, **kwargs):
        counts["launches"] += 1
        return saved_jit(self, *args, grid=grid, warmup=True, **kwargs)

    def tuner_run(self, *args, **kwargs):
        kwargs.pop("warmup", None)
        return self.warmup(*args, **kwargs)

    saved_checks = {m: m.check_device for m in modules if hasattr(m, "check_device")}
    # The GEMM's TMA kernels run by default on the H100 (SCRATCHFORMER_TMA=auto), one persistent
    # program per SM (a constexpr of the kernel, so of its cache key): take them here too, at its count
    saved_tma = {m: (m.TMA, m._programs) for m in modules if hasattr(m, "_programs")}
    driver.set_active(StandInDriver())
    JITFunction.run, Autotuner.run = jit_run, tuner_run
    for m in saved_checks:
        m.check_device = lambda *a, **k: None
    for m, (setting, _) in saved_tma.items():
        m.TMA = True if setting is None else setting
        m._programs = lambda device: H100_SMS
    try:
        yield counts
    finally:
        JITFunction.run, Autotuner.run = saved_jit, saved_tuner
        driver._active = real
        for m, f in saved_checks.items():
            m.check_device = f
        for m, (setting, programs) in saved_tma.items():
            m.TMA, m._programs = setting, programs


def _triton_model(cfg_kw: dict):
    """A Transformer on the CPU running the triton backend's ops (no interpreter)."""
    from scratchformer import ops
    from scratchformer.model import Transformer, get_config

    cfg = get_config(cfg_kw.pop("preset"), kernel="eager", **cfg_kw)
    model = Transformer(cfg)
    bundle = ops._triton_ops()
    for m in model.modules():
        if "ops" in vars(m):
            m.ops = bundle
    return model


# (name, model config, batch rows, source length, target length): the recipes' models and the
# benchmarks' presets. A kernel's specialisation follows its dims and strides modulo 16, which the
# model's widths fix (the batch's lengths and row counts are not specialised on), its dtypes and flags
MODELS = [
    ("small post-LN relu (Multi30k, SAMSum --copy)", dict(preset="small", src_vocab_size=8000, copy=True), 64, 48, 48),
    ("small 3 layers, d_ff 512, 4 heads (IWSLT)", dict(preset="small", src_vocab_size=8000, n_encoder_layers=3,
                                                        n_decoder_layers=3, d_ff=512, n_heads=4), 64, 64, 64),
    ("d_model 128, 4 heads, d_ff 256 (multi30k-tiny)", dict(preset="small", src_vocab_size=8000, d_model=128,
                                                            n_heads=4, d_ff=256), 64, 48, 48),
    ("base (CNN/DM --copy, bench base)", dict(preset="base", src_vocab_size=16000, copy=True), 4, 512, 128),
    ("base pre-LN (CNN/DM extractive)", dict(preset="base", src_vocab_size=16000, norm="pre", final_norm=True),
     4, 512, 32),
    ("small pre-LN (ablation)", dict(preset="small", src_vocab_size=8000, norm="pre", final_norm=True), 32, 32, 32),
    ("small gelu", dict(preset="small", src_vocab_size=8000, activation="gelu"), 32, 32, 32),
]


def model_workload(dropout: float = 0.1) -> None:
    from scratchformer.model import BOS_ID

    for name, kw, B, Ls, Lt in MODELS:
        t0 = time.time()
        V = kw["src_vocab_size"]
        src, tgt = torch.randint(4, V, (B, Ls)), torch.randint(4, V, (B, Lt))
        tgt_out = tgt.roll(-1, 1)  # the next tokens: only its shape and dtype reach a kernel
        sl = torch.full((B,), Ls)
        sl[1:] = torch.randint(Ls // 2, Ls + 1, (B - 1,))
        tl = torch.full((B,), Lt)
        # a step with the recipes' dropout (--dropout alone: attention's and the FFN's are the presets' 0, their
        # backward kernels without a dropout mask: not prewarmed, the recipes compiled five inside their budget),
        # and one with every dropout on (iwslt-search's variant, the benchmarks)
        for inner in (0.0, dropout):
            model = _triton_model(dict(kw, dropout=dropout, attn_dropout=inner, ffn_dropout=inner))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model.train()
                # the model's own loss, as training computes it (optim.batch_loss): the generator and the
                # label-smoothed loss in one op (kernels/cross_entropy.py; the copy models' loss is eager)
                loss, _ = model(src, sl, tgt, tl, target=tgt_out, label_smoothing=0.1)
            loss.backward()
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(src, sl, tgt, tl, target=tgt_out)  # validation loss: no dropout, no gradient written
            for beams in (1, 4):  # greedy, and beam search's B * 4 rows over the B sources' caches
                state = model.init_state(model.encode(src, sl), sl, Lt, static=True, src=src, beams=beams)
                last = torch.full((B * beams, 1), BOS_ID)
                for _ in range(2):
                    model.decode_step(last, state)
        print(f"  model {name}: {time.time() - t0:.0f} s", flush=True)


def bench_workload() -> None:
    from scratchformer.kernels import attention, ffn

    t0 = time.time()
    for D, causal, padded in ((128, False, False), (128, True, False), (64, True, False), (128, False, True)):
        q, k, v = (torch.randn(2, 16, 256, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        lengths = torch.tensor([256, 200]) if padded else None
        out = attention.attention(q, k, v, key_lengths=lengths, query_lengths=lengths, causal=causal)
        out.sum().backward()
    for act in ("gelu", "relu"):
        x = torch.randn(256, 1024, dtype=torch.bfloat16, requires_grad=True)
        w1, w2 = torch.randn(4096, 1024, dtype=torch.bfloat16), torch.randn(1024, 4096, dtype=torch.bfloat16)
        b1, b2 = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(1024, dtype=torch.bfloat16)
        for t in (w1, w2, b1, b2):
            t.requires_grad_(True)
        ffn.ffn(x, w1, b1, w2, b2, activation=act).sum().backward()
    print(f"  bench kernels: {time.time() - t0:.0f} s", flush=True)


def norm_workload() -> None:
    """One add+LayerNorm forward and backward: the tests' check of the mechanism (seconds)."""
    from scratchformer.kernels import add_layer_norm

    x = torch.randn(64, 256, dtype=torch.bfloat16, requires_grad=True)
    w, b = torch.ones(256, requires_grad=True), torch.zeros(256, requires_grad=True)
    add_layer_norm.add_layer_norm(x, None, w, b).sum().backward()


WORKLOADS = {"model": model_workload, "bench": bench_workload, "norm": norm_workload}


def compile_pass(workloads: list[str], cache: Path, jobs: int) -> None:
    """One process's compiles (the kernels' config lists are fixed at import, by the environment's
    SCRATCHFORMER_AUTOTUNE)."""
    from triton.runtime._async_compile import AsyncCompileMode

    from scratchformer.kernels import _common, add_layer_norm, attention, cross_entropy, ffn, matmul

    t0 = time.time()
    # compiles in `jobs` threads (MLIR's passes and ptxas run outside the GIL), each through the
    # same compile() and cache as a synchronous one; all are finished when the block exits
    with (compile_only([_common, attention, add_layer_norm, cross_entropy, ffn, matmul]) as counts,
          cf.ThreadPoolExecutor(jobs) as pool, AsyncCompileMode(pool)):
        torch.manual_seed(0)
        for name in workloads:
            WORKLOADS[name]()
    entries = sum(1 for d in cache.iterdir() if d.is_dir())
    print(f"== SCRATCHFORMER_AUTOTUNE={os.environ.get('SCRATCHFORMER_AUTOTUNE')}: {counts['launches']} launches, "
          f"{entries} cache entries so far, {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# the kernel tests' launches (the GPU plan's step 10 runs them with pinned tiles): a pytest plugin,
# `-p tools.prewarm`, in a run with asserts off (-O) as tests/compile_recorder.py's count is made
# ---------------------------------------------------------------------------------------------

SUITE = ["tests/test_attention.py", "tests/test_attention_tma.py", "tests/test_add_layer_norm.py", "tests/test_ffn.py",
         "tests/test_cross_entropy.py", "tests/test_model_triton.py"]
_SESSION = contextlib.ExitStack()


def pytest_configure(config):
    from triton.runtime._async_compile import AsyncCompileMode

    from scratchformer import ops
    from scratchformer.kernels import _common, add_layer_norm, attention, cross_entropy, ffn, matmul

    ops._prepare_triton = lambda device: None  # the triton backend on the CPU without the interpreter
    torch.testing.assert_close = lambda *args, **kwargs: None  # outputs are never computed
    _SESSION.enter_context(compile_only([_common, attention, add_layer_norm, cross_entropy, ffn, matmul]))
    pool = _SESSION.enter_context(cf.ThreadPoolExecutor(int(os.environ.get("PREWARM_JOBS", "1"))))
    _SESSION.enter_context(AsyncCompileMode(pool))


def pytest_sessionfinish(session, exitstatus):
    _SESSION.close()  # the outstanding compiles finish


def tests_pass(cache: Path, jobs: int) -> None:
    """The kernel test suite, compile-only, with pinned tiles (its failures are the garbage
    outputs': only the launches count)."""
    t0 = time.time()
    env = {**os.environ, "TRITON_INTERPRET": "0", "SCRATCHFORMER_AUTOTUNE": "0", "PYTHONPATH": str(REPO),
           "TRITON_CACHE_DIR": str(cache), "PREWARM_JOBS": str(jobs)}
    cmd = [sys.executable, "-O", "-m", "pytest", "--assert=plain", "-p", "tools.prewarm", "-p", "no:cacheprovider",
           "-q", "-o", "addopts=", *SUITE]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    summary = res.stdout.strip().splitlines()[-1:] or res.stderr.strip().splitlines()[-1:]
    entries = sum(1 for d in cache.iterdir() if d.is_dir())
    print(f"== the kernel tests, pinned: {entries} cache entries so far, {time.time() - t0:.0f} s "
          f"(pytest: {summary[0] if summary else 'no output'})", flush=True)


# the tile lists, in the order they are compiled and packed: pinned (one config per kernel: the
# tests, the smoke runs and the issue-18 recipes) before tuned (every config: the benchmarks)
TILES = {"pinned": "0", "tuned": "1"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=["model", "bench"], choices=list(WORKLOADS))
    p.add_argument("--tiles", nargs="+", default=list(TILES), choices=list(TILES))
    p.add_argument("--cache-dir", type=Path, help="compile into this Triton cache (default: a fresh temporary one)")
    p.add_argument("--out", type=Path, default=REPO / ".gpu_cache" / "prewarm.tar.xz")
    p.add_argument("--max-mb", type=float, default=16.0, help="the archive's size cap: it travels in `carry`, whose "
                   "64 MiB it shares with the checkout (21 MB), the wheels, the extension, the data (7 MB) and a "
                   "call's cache archive (15 MiB)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiles at a time")
    p.add_argument("--no-tests", dest="tests", action="store_false", help="leave out the kernel tests' launches")
    p.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)  # a child: compile, no pack
    args = p.parse_args(argv)
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="triton-prewarm-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    if args.one_pass:
        compile_pass(args.workloads, cache, args.jobs)
        return 0
    from triton.runtime.cache import triton_key

    sys.path.insert(0, str(REPO / "scripts" / "gpu"))
    import triton_cache

    # the kernel sources the passes compile, before they start: kernels/ changed during the prewarm
    # (an hour, beside other work) leaves the archive stale, not stamped with the sources at its end
    sources = triton_cache.sources_hash(REPO)
    # scripts/gpu/prelude.sh prints the GPU machine's: where the two differ, nothing carried can hit
    print(f"== Triton {triton.__version__} build key {hashlib.sha256(triton_key().encode()).hexdigest()[:16]}")
    if sys.version_info[:2] != (3, 12) or not triton.__version__.startswith("3.6"):
        print(f"note: the GPU machines run Python 3.12 and Triton 3.6; this is Python "
              f"{sys.version_info.major}.{sys.version_info.minor} and Triton {triton.__version__}: its entries "
              "will not be theirs (Triton's key hashes its own build)", file=sys.stderr)
    for tiles in args.tiles:
        env = {**os.environ, "SCRATCHFORMER_AUTOTUNE": TILES[tiles], "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, "-m", "tools.prewarm", "--one-pass", "--workloads", *args.workloads,
               "--cache-dir", str(cache), "--jobs", str(args.jobs)]
        if subprocess.run(cmd, cwd=REPO, env=env).returncode != 0:
            print(f"== prewarm: the {tiles} pass failed", file=sys.stderr)
            return 1
    if args.tests:
        tests_pass(cache, args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # oldest first, as compiled: the models' pinned tiles (the recipes), their tuned ones (the
    # benchmarks, compiled serially on the GPU), then the tests' (which 14 processes compile there)
    packed, skipped = triton_cache.pack(cache, args.out, args.max_mb, newest_first=False)
    triton_cache.stamp(args.out, REPO, sources)  # those compiled: `triton_cache.py check` finds a stale archive
    if triton_cache.sources_hash(REPO) != sources:
        print("== kernels/ changed while compiling: the archive is stale for the checkout now (make gpu-prewarm "
              "again)", file=sys.stderr)
    print(f"== {packed} entries packed into {args.out} ({args.out.stat().st_size / 2**20:.1f} MiB)"
          f"{f', {skipped} left out (size)' if skipped else ''}")
    if args.cache_dir is None:  # the temporary cache (with its IR files: hundreds of MB) goes
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
