"""Ahead-of-time compile check of every Triton kernel in `kernels/` for real NVIDIA GPUs.

CI has no GPU and runs the kernels only in Triton's interpreter, which never lowers a kernel: it
misses tl.dot shape/dtype constraints, layout and encoding failures, constexpr typing problems and
autotune configs that need more shared memory than the chip has. This module compiles the kernels
with Triton's own compiler and its bundled ptxas for sm_90 (H100) and sm_80 (A100), no GPU needed:

    python -m tools.compile_check [op ...] [--targets sm90,sm80] [--jobs 2] [--quick]     (from the repo root)

ops: attention, add_layer_norm, matmul, ffn, cross_entropy (default: all). Exit status 0 when everything
compiled and fits; 1 otherwise. TRITON_INTERPRET must not be "1" when the kernels are imported
(`triton.jit` reads it at decoration time); this module drops it from the environment before it
imports them, so it must run in a fresh process (tests/test_triton_compile.py starts one per op).

How the kernels are called is not guessed from argument names: each op's launchers (the functions
the model calls: attention_fwd, matmul, add_layer_norm_bwd, ...) are run on small CPU tensors of
each dtype with `JITFunction.run` / `Autotuner.run` patched to record the launch instead of
running it (and `check_device` stubbed so CPU tensors pass). The recorded arguments then go
through Triton's own binder and `_pack_args`, exactly as `JITFunction.run` does on a GPU, which
gives the signature (pointer element types such as *bf16 / *fp32 / *i32 / *i8 from the real
tensors, i32/i64 from the real ints, fp32 for floats), the constexprs (the launcher's flags, the
autotune config, `triton.heuristics` values) and the specialisation attributes (16-byte
divisibility of pointers and ints, stride == 1 as a constant), so what is compiled is what a GPU
run would compile for those shapes. Dims that are multiples of 16 give the fast, aligned path
(vectorised and pipelined loads: the most shared memory); ragged shapes give the generic one.

What runs, per op (see SCENARIOS): each kernel x each dtype it supports (bf16, fp16, fp32) x its
main constexpr flag combinations (all epilogue/mask flags on; all off; a few in between), on
representative shapes, then:

1. autotune configs: the kernel's GPU config list after its `keep` predicate (and any
   `prune_configs_by`), via `Autotuner.prune_configs` on the recorded launch; it must not be
   empty, also for the shapes the benchmarks (bench/) use;
2. shared-memory sweep: EVERY kept config of every "sweep" launch is taken through Triton's
   front end and TTGIR pipeline up to its shared-memory allocation pass (the number that ends up
   in `CompiledKernel.metadata.shared`, cross-checked below), fast (~0.3 s), for each target, and
   must fit the target's opt-in per-block limit (H100 232448 B, A100 166912 B);
3. full compile through ptxas for each target of the chosen configs of each launch: the config
   with the most shared memory (from the sweep: the one most likely to overflow) and/or the
   smallest tile. Printed per variant: kernel, target, dtype, flags, config, shared memory
   (metadata.shared), registers and spills (stack bytes, from the cubin via the bundled cuobjdump), time.

Every module-level kernel (a @triton.jit function named *_kernel, or an autotuned one) of the
checked op files must be launched by some scenario, so a new kernel without one fails the check.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported

import argparse  # noqa: E402
import concurrent.futures as cf  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner, Heuristics  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

PKG = "scratchformer.kernels"  # the package whose kernels are checked (this tool lives outside it)

# Per-block shared memory a kernel may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin).
TARGETS = {
    "sm90": (GPUTarget("cuda", 90, 32), 232448, "H100"),
    "sm80": (GPUTarget("cuda", 80, 32), 166912, "A100"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("attention", "add_layer_norm", "matmul", "ffn", "cross_entropy")
# Which op modules hold the kernels an op's scenarios launch (for the coverage check).
KERNEL_MODULES = {"attention": ["attention"], "add_layer_norm": ["add_layer_norm", "partial_sums"],
                  "matmul": ["matmul"], "ffn": [], "cross_entropy": ["cross_entropy"]}


# ---------------------------------------------------------------------------------------------
# capturing launches
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Launch:
    op: str
    scenario: str  # what the scenario calls it, e.g. "bf16 all-flags D128"
    dtype: str
    full: tuple  # which configs to compile fully: "max_shared", "smallest", "all"
    sweep: bool  # shared-memory estimate of every kept config
    kernel: JITFunction  # the innermost @triton.jit function
    tuner: Autotuner | None
    args: tuple
    kwargs: dict  # as the launcher passed them (flags, and num_warps etc. when not autotuned)
    only: tuple | None = None  # the targets it is compiled for (None: all), e.g. TMA's ("sm90",)


_CAPTURE: dict[str, Any] = {"launches": None, "ctx": None}


def _inner_jit(fn) -> JITFunction:
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _record(obj, args, kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    ctx = _CAPTURE["ctx"]
    tuner = obj if isinstance(obj, Autotuner) else None
    _CAPTURE["launches"].append(
        Launch(kernel=_inner_jit(obj), tuner=tuner, args=args, kwargs=kwargs, **ctx)
    )


@contextlib.contextmanager
def capture(modules):
    """Record kernel launches instead of running them; CPU tensors pass check_device."""
    saved_jit, saved_tuner = JITFunction.run, Autotuner.run

    def jit_run(self, *args, grid, warmup, **kwargs):
        _record(self, args, kwargs)

    def tuner_run(self, *args, **kwargs):
        _record(self, args, kwargs)

    saved_checks = {m: m.check_device for m in modules if hasattr(m, "check_device")}
    JITFunction.run, Autotuner.run = jit_run, tuner_run
    for m in saved_checks:
        m.check_device = lambda *a, **k: None
    try:
        yield
    finally:
        JITFunction.run, Autotuner.run = saved_jit, saved_tuner
        for m, f in saved_checks.items():
            m.check_device = f


@contextlib.contextmanager
def scenario(name, dtype, full=("max_shared",), sweep=True, only=None):
    _CAPTURE["ctx"] = dict(op=_CAPTURE["op"], scenario=name, dtype=dtype, full=tuple(full), sweep=sweep, only=only)
    try:
        yield
    finally:
        _CAPTURE["ctx"] = None


def _e(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def _rng(seed=1234):
    """The dropout (seed, offset) as the ops pass it to the kernels: a (2,) int64 tensor."""
    return torch.tensor([seed, 0], dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# scenarios: how each op's launchers are called (shapes as the model and bench/ use them)
# ---------------------------------------------------------------------------------------------


def _attention(mods, dtypes):
    A = mods["attention"]

    def qkv(B, L, H, D, dt):  # views of a fused (B, L, 3, H, D) projection, as the model passes
        x = _e(B, L, 3, H, D, dtype=dt)
        return [x[:, :, i].transpose(1, 2) for i in range(3)]

    def fwd_bwd(q, k, v, klen=None, qlen=None, causal=False, p=0.0):
        rng = _rng() if p > 0.0 else None
        out, lse = A.attention_fwd(q, k, v, klen, qlen, causal, p, None, rng)
        A.attention_bwd(torch.empty_like(out), q, k, v, out, lse, klen, qlen, causal, p, None, rng)

    # Budget (2 CI cores): bf16 gets every variant; fp16 (same element width as bf16, so the same
    # shared memory) its largest and smallest configs; fp32 (IEEE dots: 20-190 s per compile at
    # HEAD_DIM 128) the sweep at D128 and full compiles at D32.
    for name in dtypes:
        dt = DTYPES[name]
        B, L = 2, 1024
        lens = torch.full((B,), L, dtype=torch.int64)  # as the model passes them (the kernels read int64 too)
        big = name != "fp32"
        with scenario(f"{name} causal+klen+qlen+dropout D128", name, full=("max_shared", "smallest") if big else (),
                      sweep=name != "fp16"):
            q, k, v = qkv(B, L, 8, 128, dt)
            fwd_bwd(q, k, v, lens, lens, causal=True, p=0.1)
        if not big:
            with scenario(f"{name} causal+klen+qlen+dropout D32", name, full=("max_shared", "smallest"), sweep=False):
                fwd_bwd(*qkv(B, L, 8, 32, dt), lens, lens, causal=True, p=0.1)
        if name == "bf16":
            with scenario(f"{name} plain D64", name, full=("max_shared",), sweep=False):
                fwd_bwd(*qkv(B, L, 16, 64, dt))
            with scenario(f"{name} cross-attn causal+dropout D16 ragged Lq=77 Lk=100", name, full=("smallest",),
                          sweep=False):
                # contiguous (B, H, L, D) tensors with ragged lengths: no 16-divisibility on Lq, Lk
                q, k, v = _e(B, 2, 77, 16, dtype=dt), _e(B, 2, 100, 16, dtype=dt), _e(B, 2, 100, 16, dtype=dt)
                fwd_bwd(q, k, v, causal=True, p=0.1)
    with scenario("dropout mask (int8 out)", "int8", full=("all",)):
        A.dropout_mask(2, 4, 1000, 1000, 0.1, _rng(), "cpu")
    # The TMA path (SCRATCHFORMER_ATTENTION_TMA=1; tensor descriptors: sm_90 only), bf16: every
    # config's shared memory at D128 with every mask and dropout, the largest compiled
    tma, A.TMA = A.TMA, True
    try:
        if "bf16" in dtypes:
            lens = torch.full((2,), 1024, dtype=torch.int64)
            with scenario("bf16 TMA causal+klen+qlen+dropout D128", "bf16", full=("max_shared",), only=("sm90",)):
                fwd_bwd(*qkv(2, 1024, 8, 128, torch.bfloat16), lens, lens, causal=True, p=0.1)
    finally:
        A.TMA = tma
    # The benchmarks' shapes (bench/bench_attention.py): bf16, (H, D) in (16, 64), (8, 128),
    # L 128..16384, causal or key padding: configs must survive keep() for all of them.
    for L in (128, 512, 1024, 2048, 4096, 8192, 16384):
        for H, D in ((16, 64), (8, 128)):
            for causal, padded in ((False, False), (True, False), (False, True)):
                if padded and L > 1024:
                    continue
                B = 16 if padded else max(1, 16384 // L)
                with scenario(f"bench B{B} L{L} H{H} D{D}", "bf16", full=(), sweep=False):
                    lens = torch.full((B,), L // 2, dtype=torch.int64) if padded else None
                    fwd_bwd(*qkv(B, L, H, D, torch.bfloat16), lens, causal=causal)


def _add_layer_norm(mods, dtypes):
    LN, PS = mods["add_layer_norm"], mods["partial_sums"]

    def fwd_bwd(M, N, dt, wdt, residual, bias, p, store_mask=False, ds=False, dres=False, rdt=None, ydt=None,
                cdt=None):
        x = _e(M, N, dtype=dt)
        r = _e(M, N, dtype=rdt or dt) if residual else None
        w = _e(N, dtype=wdt)
        b = _e(N, dtype=wdt) if bias else None
        rng = _rng() if p > 0.0 else None
        y, s, mean, rstd, _, copy = LN.add_layer_norm_fwd(x, r, w, b, 1e-5, p, rng, store_s=True, store_mask=store_mask,
                                                          y_dtype=ydt, copy_dtype=cdt)
        LN.add_layer_norm_bwd(torch.empty_like(y), torch.empty_like(s) if ds else None, s, w, mean, rstd,
                              has_bias=bias, dropout_p=p, rng=rng, store_dres=dres, dx_dtype=dt,
                              dy_copy=torch.empty_like(copy) if copy is not None else None)

    for name in dtypes:
        dt = DTYPES[name]
        if name != "fp16":  # fp16 compiles like bf16; MAX_N costs 4-6 s per compile
            with scenario(f"{name} all-flags N=16384 (MAX_N)", name, full=("all",)):
                fwd_bwd(64, 16384, dt, dt, residual=True, bias=True, p=0.1, store_mask=True, ds=True, dres=True)
        with scenario(f"{name} all-flags N=4096", name, full=("all",)):
            fwd_bwd(64, 4096, dt, dt, residual=True, bias=True, p=0.1, store_mask=True, ds=True, dres=True)
        with scenario(f"{name} plain N=1000 (ragged)", name, full=("all",)):
            fwd_bwd(64, 1000, dt, dt, residual=False, bias=False, p=0.0)
        with scenario(f"{name} all-flags N=48 (several rows per tile)", name, full=("all",)):
            fwd_bwd(64, 48, dt, dt, residual=True, bias=True, p=0.1, store_mask=True, ds=True, dres=True)
        if dt != torch.float32:
            with scenario(f"{name} residual+bias, fp32 weight/bias N=512", name, full=("all",)):
                fwd_bwd(64, 512, dt, torch.float32, residual=True, bias=True, p=0.0, ds=True)
            with scenario(f"{name} x on an fp32 residual stream (the autocast model's), N=512", name, full=("all",)):
                fwd_bwd(64, 512, dt, torch.float32, residual=True, bias=True, p=0.1, ds=True, dres=True,
                        rdt=torch.float32)
            with scenario(f"{name} Pre-LN under autocast: fp32 stream, y in {name}, N=512", name, full=("all",)):
                fwd_bwd(64, 512, dt, torch.float32, residual=True, bias=True, p=0.1, ds=True, dres=True,
                        rdt=torch.float32, ydt=dt)
            with scenario(f"{name} Post-LN under autocast: fp32 y and its {name} copy, N=512", name, full=("all",)):
                fwd_bwd(64, 512, dt, torch.float32, residual=True, bias=True, p=0.1, dres=True, rdt=torch.float32,
                        cdt=dt)
        with scenario(f"{name} dw/db second stage, an H100's 528 partial rows", name):  # the GPU's tallest tile
            PS.sum_partials(_e(528, 512, dtype=torch.float32), _e(528, 512, dtype=torch.float32), dt)


def _matmul(mods, dtypes):
    MM = mods["matmul"]
    for name in dtypes:
        dt = DTYPES[name]
        M, K, N = 4096, 512, 2048
        sweep = name != "fp16"  # fp16 has bf16's element width: the same shared memory
        with scenario(f"{name} bias+gelu+dropout+store_pre+store_mask, B^T", name, full=("max_shared", "smallest"),
                      sweep=sweep):
            w1 = _e(N, K, dtype=dt)  # nn.Linear layout: the GEMM reads w1.t()
            MM.matmul(_e(M, K, dtype=dt), w1.t(), bias=_e(N, dtype=dt), activation="gelu", dropout_p=0.1,
                      seed=1234, store_pre=True, store_mask=True)
        with scenario(f"{name} gelu+dropout+bias_grad", name, full=("max_shared", "smallest"), sweep=sweep):
            MM.matmul_dact(_e(M, K, dtype=dt), _e(K, N, dtype=dt), _e(M, N, dtype=dt), activation="gelu",
                           dropout_p=0.1, seed=1234, bias_grad=True)
        if name == "fp16":
            continue
        what = f"{name} plain (no bias, no act), ragged M=1000 K=200 N=300"
        with scenario(what, name, full=("smallest",), sweep=False):
            MM.matmul(_e(1000, 200, dtype=dt), _e(200, 300, dtype=dt))
        with scenario(f"{name} relu (dact), ragged", name, full=("smallest",), sweep=False):
            MM.matmul_dact(_e(1000, 200, dtype=dt), _e(200, 300, dtype=dt), _e(1000, 300, dtype=dt),
                           activation="relu", dropout_p=0.1)
    # The TMA kernels (SCRATCHFORMER_TMA=1; Hopper and later: sm_90 only), both layouts of B: the
    # shared-memory sweep over every config, the largest and smallest compiled (8-25 s each)
    tma, MM.TMA = MM.TMA, True
    try:
        for name in dtypes:
            dt = DTYPES[name]
            M, K, N = 4096, 512, 2048
            full = ("max_shared", "smallest")
            with scenario(f"{name} TMA bias+gelu+dropout+store_pre+store_mask, B^T", name, full=full, only=("sm90",)):
                MM.matmul(_e(M, K, dtype=dt), _e(N, K, dtype=dt).t(), bias=_e(N, dtype=dt), activation="gelu",
                          dropout_p=0.1, seed=1234, store_pre=True, store_mask=True)
            with scenario(f"{name} TMA gelu+dropout+bias_grad", name, full=full, only=("sm90",)):
                MM.matmul_dact(_e(M, K, dtype=dt), _e(K, N, dtype=dt), _e(M, N, dtype=dt), activation="gelu",
                               dropout_p=0.1, seed=1234, bias_grad=True)
    finally:
        MM.TMA = tma


def _ffn(mods, dtypes):
    """The launches the fused FFN makes (kernels/ffn.py on matmul.py), at the benchmarks' shapes
    (bench/bench_ffn.py: bf16, tokens 4k..64k, d512/ff2048 and d1024/ff4096)."""
    F = mods["ffn"]
    F._wgrad = lambda a, b: torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)  # cuBLAS: not ours
    for tokens in (4096, 16384, 65536):
        for d, ff in ((512, 2048), (1024, 4096)):
            for act in ("relu", "gelu"):
                # the FFN's own layouts (w.t() operands) at one shape; big tiles are compiled by "matmul"
                full = ("smallest",) if (tokens, d, act) == (4096, 512, "gelu") else ()
                with scenario(f"bf16 ffn {act} tokens={tokens} d{d} ff{ff}", "bf16", full=full, sweep=False):
                    x = _e(tokens, d)
                    w1, b1, w2, b2 = _e(ff, d), _e(ff), _e(d, ff), _e(d)
                    y, a, pre, _ = F.ffn_fwd(x, w1, b1, w2, b2, activation=act, dropout_p=0.1, rng=_rng(1),
                                             store_pre=act == "gelu")
                    F.ffn_bwd(torch.empty_like(y), x, w1, w2, a, pre, activation=act, has_b1=True, has_b2=False,
                              dropout_p=0.1, rng=_rng(1))


def _cross_entropy(mods, dtypes):
    """The row pass of the fused output projection + loss (kernels/cross_entropy.py) at the model's
    shapes: Multi30k's small model (d 256, V 8,000, no output bias) and CNN/DailyMail's base one (d
    512, V 30,522: ragged, with a bias), each with the gradient written (training) and one without
    (the eval path); a tiny vocabulary (one small BLOCK_V tile, 4 warps). The launcher's GEMMs (cuBLAS
    on a GPU) run here on CPU tensors of 64 rows: a chunk's row count is only the grid (and its first row an
    unspecialised argument), so the kernels compiled are the ones the full batches (4,096 / 2,048
    rows, two / four chunks) launch, at a fraction of the CPU time."""
    CE = mods["cross_entropy"]
    N = 64  # rows: the grid, not a kernel argument

    def call(d, V, dt, bias, eps, needs_grad):
        target = torch.zeros(N, dtype=torch.int64)  # values are never read here
        CE.linear_cross_entropy_fwd(_e(N, d, dtype=dt), _e(V, d, dtype=dt), _e(V, dtype=dt) if bias else None,
                                    target, eps, 0, needs_grad)

    for name in dtypes:
        dt = DTYPES[name]
        with scenario(f"{name} grad d256 V=8000 no bias eps=0.1 (small/Multi30k)", name):
            call(256, 8000, dt, bias=False, eps=0.1, needs_grad=True)
        with scenario(f"{name} grad d512 V=30522 bias eps=0.1 (base/CNN-DM, ragged V)", name):
            call(512, 30522, dt, bias=True, eps=0.1, needs_grad=True)
        with scenario(f"{name} no grad (eval) d256 V=8000", name):
            call(256, 8000, dt, bias=False, eps=0.1, needs_grad=False)
        with scenario(f"{name} grad tiny V=50 (BLOCK_V=64)", name):
            call(16, 50, dt, bias=True, eps=0.1, needs_grad=True)


SCENARIOS: dict[str, Callable] = {
    "attention": _attention, "add_layer_norm": _add_layer_norm, "matmul": _matmul, "ffn": _ffn,
    "cross_entropy": _cross_entropy,
}


# ---------------------------------------------------------------------------------------------
# binding a launch to (signature, constexprs, attrs, options) for a target, as JITFunction.run
# ---------------------------------------------------------------------------------------------


def _config_kwargs(launch: Launch, config) -> dict:
    """The kwargs JITFunction.run would see: launcher kwargs + config + heuristics values."""
    kw = dict(launch.kwargs)
    if config is not None:
        kw.update(config.all_kwargs())
    fn = launch.tuner.fn if launch.tuner is not None else None
    while isinstance(fn, Heuristics):  # Autotuner -> Heuristics -> JITFunction
        for name, heur in fn.values.items():
            kw[name] = heur({**dict(zip(fn.arg_names, launch.args)), **kw})
        fn = fn.fn
    return kw


def _bind(kernel: JITFunction, args, kw, target):
    backend = make_backend(target)
    kw = dict(kw)
    kw.setdefault("debug", kernel.debug or triton.knobs.runtime.debug)
    # Compilation knobs JITFunction.run passes to the binder; the set differs across Triton
    # versions (3.6 has no fpsan_homomorphic_casts), so pass the ones this Triton has.
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(triton.knobs.compilation, knob):
            kw.setdefault(knob, getattr(triton.knobs.compilation, knob))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, specialization, options)
    return backend, options, signature, constexprs, attrs


def _config_str(kw) -> str:
    blocks = " ".join(f"{k}={v}" for k, v in kw.items() if k.startswith(("BLOCK", "GROUP", "LOOP")))
    return f"{blocks} w{kw.get('num_warps', 4)} s{kw.get('num_stages', 3)}"


def _flags_str(launch: Launch) -> str:
    out = []
    for k, v in launch.kwargs.items():
        if k.startswith(("BLOCK", "GROUP", "LOOP", "num_")):
            continue
        out.append(f"{k}={int(v) if isinstance(v, bool) else v}")
    return " ".join(out)


# ---------------------------------------------------------------------------------------------
# compiling
# ---------------------------------------------------------------------------------------------


def shared_estimate(kernel, signature, constexprs, attrs, options, target, backend) -> int:
    """Shared memory of a kernel without the LLVM/PTX/ptxas stages: the front end, the TTGIR
    pipeline (pipelining, layouts) and the NVIDIA allocate-shared-memory pass (where the number
    in metadata.shared comes from), a few tenths of a second instead of seconds."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    src = ASTSource(kernel, signature, constexprs, attrs)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    metadata = {"hash": "shared-estimate", "target": target, **options.__dict__}
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    stages = {}
    backend.add_stages(stages, options, src.language)
    mod = stages["ttir"](mod, metadata)
    mod = stages["ttgir"](mod, metadata)
    pm = ir.pass_manager(mod.context)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    try:  # Triton >= 3.7 takes a "consan" flag (off, as in a normal compile); 3.6 does not
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
    except TypeError:
        passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    ptx_version = get_ptx_version_from_options(options, target.arch)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, target.arch, ptx_version)
    pm.run(mod, "shared_estimate")
    return int(mod.get_int_attr("ttg.shared") or 0)


def _cuobjdump():
    from triton.backends.nvidia.compiler import get_ptxas

    path = os.path.join(os.path.dirname(get_ptxas(80).path), "cuobjdump")
    return path if os.path.exists(path) else None


def _resources(cubin: bytes) -> dict:
    """Registers, stack and local bytes per thread from the cubin, via the bundled cuobjdump. Registers
    spilled by ptxas live on the stack (STACK; LOCAL stays 0 for them): a Triton kernel has no other
    use for it, so stack bytes are its spills."""
    tool = _cuobjdump()
    if tool is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+).*?LOCAL:(\d+)", out)
    return {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(3))} if m else {}


@dataclasses.dataclass
class Job:
    kind: str  # "full" or "sweep"
    launch_id: int
    target: str
    kw: dict  # final kwargs (flags + config + heuristics)
    why: str  # "max_shared", "smallest", "all", "launch" (no autotune), "sweep"


_STATE: dict[str, Any] = {}  # launches + jobs, inherited by forked workers


def run_job(i: int) -> dict:
    job: Job = _STATE["jobs"][i]
    launch: Launch = _STATE["launches"][job.launch_id]
    target, limit, _ = TARGETS[job.target]
    t0 = time.time()
    res = {"i": i, "ok": True}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            backend, options, sig, consts, attrs = _bind(launch.kernel, launch.args, job.kw, target)
            if job.kind == "sweep":
                res["shared"] = shared_estimate(launch.kernel, sig, consts, attrs, options, target, backend)
            else:
                src = ASTSource(launch.kernel, sig, consts, attrs)
                k = triton.compile(src, target=target, options=options.__dict__)
                res["shared"] = int(k.metadata.shared)
                res.update(_resources(k.asm["cubin"]))
        res["signature"] = " ".join(f"{n}:{t}" for n, t in sig.items() if t != "constexpr")
    except Exception as e:  # noqa: BLE001 - reported, then the check fails
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"[:4000]
        res["trace"] = traceback.format_exc()[-6000:]
    res["time"] = time.time() - t0
    return res


def _run_all(indices, jobs_n, on_result):
    """Run jobs in forked workers (a compiler abort kills only its worker); if a worker dies, the
    unfinished jobs are re-run one per fresh process so the crash is pinned on one job."""
    ctx = multiprocessing.get_context("fork")
    pending = list(indices)
    if not pending:
        return
    with cf.ProcessPoolExecutor(max_workers=jobs_n, mp_context=ctx) as ex:
        futures = {ex.submit(run_job, i): i for i in pending}
        done_ids = set()
        try:
            for fut in cf.as_completed(futures):
                res = fut.result()
                done_ids.add(res["i"])
                on_result(res)
        except cf.process.BrokenProcessPool:
            pass
    for i in [i for i in pending if i not in done_ids]:
        with cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
            try:
                res = ex.submit(run_job, i).result()
            except cf.process.BrokenProcessPool:
                res = {"i": i, "ok": False, "time": 0.0,
                       "error": "the compiler process died (an LLVM/MLIR abort: see the stderr above)"}
        on_result(res)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def _quick(full: tuple) -> tuple:
    """--quick (no shared-memory sweep either): a scenario's full compiles cut to one config per
    launch, its smallest tile where it asked for several or all, its own single pick otherwise.
    Every kernel and flag combination still goes through ptxas: a check that a Triton version
    lowers our kernels, not of every config's fit (the default's sweep and largest tiles). The
    smallest tile lowers the same code; the largest ones spill (255 registers) and took ptxas
    40 s each for matmul's TMA kernels (its check: 64 s with the largest, 20 s with the smallest; cold
    cache, 2 cores)."""
    return ("smallest",) if len(full) > 1 or "all" in full else full


def _tile_size(config) -> tuple:
    kw = config.kwargs
    prod = 1
    for k, v in kw.items():
        if k.startswith("BLOCK") and isinstance(v, int):
            prod *= v
    return (prod, config.num_stages, config.num_warps)


def _kernels_of(mod) -> set[str]:
    names = set()
    for obj in vars(mod).values():
        if isinstance(obj, (Autotuner, Heuristics)):
            names.add(_inner_jit(obj).__name__)
        elif isinstance(obj, JITFunction) and obj.__name__.endswith("_kernel"):
            names.add(obj.__name__)
    return names


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ops", nargs="*", default=list(OPS), help=f"ops to check (default: all of {', '.join(OPS)})")
    p.add_argument("--targets", default="sm90,sm80", help="comma list of " + ", ".join(TARGETS))
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="parallel compiler processes")
    p.add_argument("--full-all", action="store_true", help="compile every kept config fully (slow)")
    p.add_argument("--no-sweep", action="store_true", help="skip the shared-memory sweep of all kept configs")
    p.add_argument("--no-full", action="store_true", help="only the shared-memory sweep (no ptxas)")
    p.add_argument("--quick", action="store_true",
                   help="one full compile per launch (its smallest tile), no shared-memory sweep")
    p.add_argument("--list", action="store_true", help="list the variants, compile nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="print signatures")
    a = p.parse_args(argv)
    ops = [o for o in a.ops]
    bad = [o for o in ops if o not in OPS]
    targets = a.targets.split(",")
    dtypes = a.dtypes.split(",")
    if bad or any(t not in TARGETS for t in targets) or any(d not in DTYPES for d in dtypes):
        p.error(f"unknown op/target/dtype in {ops} {targets} {dtypes}")
    loaded = [m for m in sys.modules if m.startswith(PKG + ".") and m != __name__]
    if any(getattr(sys.modules[m], "INTERPRET", False) for m in loaded):
        print("error: the kernels were imported with TRITON_INTERPRET=1; run this in a fresh process", file=sys.stderr)
        return 1

    t_start = time.time()
    errors: list[str] = []
    launches: list[Launch] = []
    for op in ops:
        mod_names = sorted(set(KERNEL_MODULES[op]) | {op})
        mods = {n: importlib.import_module(f"{PKG}.{n}") for n in mod_names}
        all_mods = [importlib.import_module(f"{PKG}.{n}")
                    for n in ("attention", "add_layer_norm", "matmul", "ffn", "cross_entropy")]
        _CAPTURE.update(launches=[], op=op)
        with capture(all_mods):
            SCENARIOS[op](mods, dtypes)
        got = _CAPTURE["launches"]
        launched = {ln.kernel.__name__ for ln in got}
        for n in KERNEL_MODULES[op]:
            for missing in sorted(_kernels_of(mods[n]) - launched):
                errors.append(f"{op}: kernel {n}.{missing} is launched by no scenario of the compile check")
        launches.extend(got)
    print(f"captured {len(launches)} launches from {', '.join(ops)} in {time.time() - t_start:.1f}s", flush=True)

    # Autotune config lists after keep() / prune_configs, per launch (benchmark shapes included).
    kept_of: dict[int, list] = {}
    for i, ln in enumerate(launches):
        if ln.tuner is None:
            continue
        ln.tuner.nargs = dict(zip(ln.tuner.arg_names, ln.args))
        kept = list(ln.tuner.prune_configs(dict(ln.kwargs)))
        ln.tuner.nargs = None
        kept_of[i] = kept
        if not kept:
            errors.append(f"{ln.op}: {ln.kernel.__name__} [{ln.scenario}]: no autotune config survives keep()")
    summary: dict[str, set] = {}
    for i, kept in kept_of.items():
        summary.setdefault(launches[i].kernel.__name__, set()).add(len(kept))
    for name, counts in sorted(summary.items()):
        kept = "/".join(map(str, sorted(counts)))
        print(f"  autotune {name}: {kept} configs kept after keep() for every captured shape")

    # Jobs, deduplicated on what would actually be compiled.
    jobs: list[Job] = []
    seen: dict[tuple, int] = {}

    def add(kind, li, tname, kw, why):
        ln = launches[li]
        _, options, sig, consts, attrs = _bind(ln.kernel, ln.args, kw, TARGETS[tname][0])
        key = (kind, ln.kernel.__name__, tname, tuple(sig.items()), repr(sorted(consts.items())),
               repr(sorted(attrs.items())), repr(options))
        if key in seen:
            return seen[key]
        jobs.append(Job(kind, li, tname, kw, why))
        seen[key] = len(jobs) - 1
        return seen[key]

    full_plan: list[tuple] = []  # (launch, target, selector, config or None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for li, ln in enumerate(launches):
            for tname in targets:
                if ln.only is not None and tname not in ln.only:
                    continue
                if ln.tuner is None:
                    if ln.full and not a.no_full:
                        add("full", li, tname, _config_kwargs(ln, None), "launch")
                    continue
                kept = kept_of[li]
                if ln.sweep and not (a.no_sweep or a.quick):
                    for c in kept:
                        add("sweep", li, tname, _config_kwargs(ln, c), "sweep")
                sel = () if a.no_full else ("all",) if a.full_all else _quick(ln.full) if a.quick else ln.full
                for s in sel:
                    full_plan.append((li, tname, s))
    n_sweep = sum(j.kind == "sweep" for j in jobs)
    print(f"shared-memory sweep: {n_sweep} (launch, config, target) variants", flush=True)

    results: dict[int, dict] = {}
    _STATE.update(launches=launches, jobs=jobs)

    def line(job: Job, res: dict) -> str:
        ln = launches[job.launch_id]
        limit = TARGETS[job.target][1]
        sh = res.get("shared")
        status = "OK" if res["ok"] else "FAIL"
        if res["ok"] and sh is not None and sh > limit:
            status = "OVER-SHARED"
        regs = f" regs={res['regs']}" if "regs" in res else ""
        spill = f" spill={res.get('stack', 0) + res['local']}B" if res.get("stack") or res.get("local") else ""
        txt = (f"[{job.target}] {ln.kernel.__name__} {ln.dtype} [{ln.scenario}] {_flags_str(ln)} | "
               f"{_config_str(job.kw)} ({job.why}) | shared={sh}/{limit}{regs}{spill} | {res['time']:.1f}s {status}")
        if a.verbose and "signature" in res:
            txt += f"\n    signature: {res['signature']}"
        return txt

    def on_result(res):
        results[res["i"]] = res
        job = jobs[res["i"]]
        if job.kind == "full" or not res["ok"] or res.get("shared", 0) > TARGETS[job.target][1] or a.verbose:
            print(line(job, res), flush=True)
        if not res["ok"]:
            print("    " + res["error"].replace("\n", "\n    "), flush=True)

    if a.list:
        for job in jobs:
            print(f"{job.kind}: {launches[job.launch_id].kernel.__name__} {job.target} {_config_str(job.kw)} "
                  f"[{launches[job.launch_id].scenario}]")
        print(f"+ full compiles of {len(full_plan)} (launch, target, selector) picks")
        return 0

    t_sweep = time.time()
    _run_all([i for i, j in enumerate(jobs) if j.kind == "sweep"], a.jobs, on_result)
    t_sweep = time.time() - t_sweep
    if n_sweep:
        print(f"sweep done in {t_sweep:.1f}s", flush=True)

    # Full compiles: pick configs now that the sweep knows each one's shared memory.
    def sweep_shared(li, tname, c):
        ln = launches[li]
        kw = _config_kwargs(ln, c)
        _, options, sig, consts, attrs = _bind(ln.kernel, ln.args, kw, TARGETS[tname][0])
        key = ("sweep", ln.kernel.__name__, tname, tuple(sig.items()), repr(sorted(consts.items())),
               repr(sorted(attrs.items())), repr(options))
        r = results.get(seen.get(key, -1))
        return r["shared"] if r and r["ok"] else None

    n_before = len(jobs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for li, tname, s in full_plan:
            ln = launches[li]
            kept = kept_of[li]
            if not kept:
                continue
            if s == "all":
                picks = kept
            elif s == "smallest":
                picks = [min(kept, key=_tile_size)]
            else:  # max_shared: the sweep's biggest, else the biggest tile
                shared = [sweep_shared(li, tname, c) for c in kept]
                if all(x is not None for x in shared):
                    picks = [kept[max(range(len(kept)), key=lambda j: (shared[j], _tile_size(kept[j])))]]
                else:
                    picks = [max(kept, key=_tile_size)]
            for c in picks:
                add("full", li, tname, _config_kwargs(ln, c), s)
    full_ids = [i for i, j in enumerate(jobs) if j.kind == "full"]
    print(f"full compiles (through ptxas): {len(full_ids)} variants", flush=True)
    t_full = time.time()
    _run_all([i for i in full_ids if i not in results], a.jobs, on_result)
    t_full = time.time() - t_full
    del n_before

    # Cross-check the sweep's estimate against metadata.shared where both exist.
    mismatches = 0
    for i in full_ids:
        job, res = jobs[i], results[i]
        if not res["ok"]:
            continue
        ln = launches[job.launch_id]
        est_key = ("sweep",) + next((k[1:] for k, v in seen.items() if v == i), ())
        est = results.get(seen.get(est_key, -1))
        if est and est["ok"] and est["shared"] != res["shared"]:
            mismatches += 1
            print(f"  note: shared estimate {est['shared']} != compiled {res['shared']} for "
                  f"{ln.kernel.__name__} {job.target} {_config_str(job.kw)}")

    # Verdict.
    n_fail = n_over = 0
    biggest: dict[tuple, tuple] = {}
    for i, res in results.items():
        job = jobs[i]
        ln = launches[job.launch_id]
        limit = TARGETS[job.target][1]
        if not res["ok"]:
            n_fail += 1
            errors.append(f"{ln.op}: {job.kind} compile failed: " + line(job, res).split(" | ")[0] + " "
                          + _config_str(job.kw) + ": " + res["error"].splitlines()[0][:300])
            continue
        sh = res["shared"]
        if sh > limit:
            n_over += 1
            errors.append(f"{ln.op}: shared memory {sh} B > {TARGETS[job.target][2]} limit {limit} B: "
                          f"{ln.kernel.__name__} {ln.dtype} [{ln.scenario}] {_config_str(job.kw)} ({job.target})")
        k = (ln.kernel.__name__, job.target, ln.dtype)
        if k not in biggest or sh > biggest[k][0]:
            biggest[k] = (sh, _config_str(job.kw))
    print("\nlargest shared memory per kernel / target / dtype (over all kept configs checked):")
    for (name, tname, dt), (sh, cfg) in sorted(biggest.items()):
        print(f"  {name:36s} {tname} {dt:5s} {sh:7d} B of {TARGETS[tname][1]} ({cfg})")
    n_full_ok = sum(1 for i in full_ids if results[i]["ok"])
    print(f"\n{n_full_ok}/{len(full_ids)} full compiles ok ({t_full:.1f}s), {n_sweep} sweep variants "
          f"({t_sweep:.1f}s), {n_fail} failed, {n_over} over the shared-memory limit"
          f"{f', {mismatches} estimate mismatches' if mismatches else ''}; total {time.time() - t_start:.1f}s")
    if errors:
        print("\nFAILED:")
        for e in errors:
            print("  " + e)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
