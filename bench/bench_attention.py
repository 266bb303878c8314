"""Attention: our Triton flash attention vs PyTorch SDPA vs the eager reference (GPU only).

    pytest bench/bench_attention.py --benchmark-only [--benchmark-json bench/results/<name>.json]

Kernels (all through `scratchformer.ops.select(kernel, "cuda").attention` unless said otherwise):
- triton:    ours (kernels/attention.py), lengths as key_lengths, on the path the model takes
             (`SCRATCHFORMER_ATTENTION_TMA`'s default, `auto`: the blocks streamed through tensor
             descriptors at head dim 128 on Hopper and later; `extra_info["tma"]` says whether they
             were; until 2026-12-07 this case pinned the pointer kernels, so its head dim 128 rows judged
             a path the model does not run there);
- triton-ptr: ours on the pointer kernels, raced where `triton` takes the TMA path: L 4k, dense
             (not causal) and padded (before 2026-12-07, `triton-tma` raced the TMA path the other way);
- sdpa_flash, sdpa_cudnn, sdpa_efficient: F.scaled_dot_product_attention held to one backend by
             name (torch.nn.attention.sdpa_kernel), dense batches only (is_causal for causal); a
             backend that cannot take the case (torch's "No available kernel") is skipped with its
             reason, any other error (out of memory, ...) fails the case;
- sdpa:      ops' torch backend: F.scaled_dot_product_attention, dense (flash) where it can be,
             a boolean mask built per call for padding / Lq != Lk causal (what our `torch`
             backend pays);
- sdpa_mask: F.scaled_dot_product_attention with a prebuilt boolean mask even where dense would
             do (what a mask-based model pays: the padded batch's peer);
- eager:     the reference (materialises B·H·L² fp32 scores; skipped where it would not fit).
Shapes (issue 16): 16k tokens a batch, L from 512 to 8k, head dim 64 (16 heads) and 128 (8 heads),
full and causal; a padded batch with key lengths uniform in [L/2, L].
Inputs are bf16 views of a fused QKV projection (B, L, 3, H, D), the layout the model passes.
extra_info: TFLOP/s from 4·B·H·Lq·Lk·D (halved when causal, x3.5 for fwd+bwd; for padded batches
the useful work 4·H·D·L·Σ len_b), and the peak memory of one call (torch.cuda.max_memory_allocated).
"""

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import peak_memory, requires_cuda, run_bench

from scratchformer import ops
from scratchformer.reference import attention_mask

pytestmark = [pytest.mark.benchmark(group="attention"), requires_cuda]

DTYPE = torch.bfloat16
TOKENS = 16 * 1024  # B·L fixed for the dense sweep
SDPA_BACKENDS = {  # bench kernel name -> torch.nn.attention.SDPBackend member
    "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
}
KERNELS = ["triton", *SDPA_BACKENDS, "sdpa", "sdpa_mask", "eager"]
# What torch raises when the backend it is held to cannot take the inputs (its reasons go to warnings):
# "No available kernel. Aborting execution." on CUDA (sdp_utils.cpp), "No viable backend for
# scaled_dot_product_attention was found." on the CPU. A RuntimeError like any other, OutOfMemoryError too.
UNAVAILABLE = re.compile(r"No available kernel|No viable backend for scaled_dot_product_attention")
TMA_LENGTHS = [4096]  # where triton-ptr is raced (each case autotunes anew)
MODES = ["fwd", "fwd+bwd"]
LENGTHS = [512, 1024, 2048, 4096, 8192]
HEADS = pytest.mark.parametrize("H, D", [(16, 64), (8, 128)], ids=["h16d64", "h8d128"])


def _qkv(B, L, H, D):
    """q, k, v: (B, H, L, D) views of one (B, L, 3, H, D) tensor, no copies, each a leaf that
    wants a gradient. Leaves, not views of a leaf: autograd runs a node's backward on the stream
    its forward ran on, so the views' backward nodes, made on the default stream outside the CUDA
    graph, would make the captured backward join that stream, which a capture cannot hold (the
    likely cause of the 2026-11-26 H100 run's failed captures of every fwd+bwd case; the model's
    own captured steps, whose views are made inside, and the FFN's, on leaves, captured)."""
    x = torch.randn(B, L, 3, H, D, device="cuda", dtype=DTYPE)
    return [x[:, :, i].transpose(1, 2).requires_grad_() for i in range(3)]


def _eager_fits(B, H, Lq, Lk, mode):
    """The eager path keeps a few fp32 (B, H, Lq, Lk) tensors (scores, exp, probabilities and,
    for backward, their gradients): skip it past a third of the device memory."""
    copies = 4 if mode == "fwd" else 8
    return copies * B * H * Lq * Lk * 4 < torch.cuda.get_device_properties(0).total_memory / 3


@pytest.fixture
def pointer_kernels(request, monkeypatch) -> None:
    """triton-ptr pins the pointer kernels (SCRATCHFORMER_ATTENTION_TMA off) for its case: raced at
    TMA_LENGTHS, not causal, where triton's own path is the TMA one (elsewhere the two are one)."""
    from scratchformer.kernels import attention as A  # after requires_cuda: GPU only

    if request.getfixturevalue("kernel") != "triton-ptr":
        return
    if request.getfixturevalue("L") not in TMA_LENGTHS or "causal" in request.fixturenames and \
            request.getfixturevalue("causal"):
        pytest.skip(f"triton-ptr is raced at L in {TMA_LENGTHS}, not causal (each case autotunes anew)")
    D, hopper = request.getfixturevalue("D"), torch.cuda.get_device_capability()[0] >= 9
    if not (hopper and (A.TMA is True or A.TMA is None and D >= A.TMA_MIN_HEAD_DIM)):
        pytest.skip("triton takes the pointer kernels here already")
    monkeypatch.setattr(A, "TMA", False)


def _took_tma(kernel, q, k, v) -> bool:
    """Whether the case's kernels stream their blocks through tensor descriptors (`extra_info["tma"]`)."""
    from scratchformer.kernels import attention as A

    return kernel in ("triton", "triton-ptr") and A._tma(q, k, v)


def _attention_fn(kernel, q, k, v, *, key_lengths=None, causal=False):
    """fn() -> out for one kernel; mask building for sdpa_mask happens here, outside the timing."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    if kernel in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        assert key_lengths is None, "the named SDPA backends run dense batches only"
        backend = getattr(SDPBackend, SDPA_BACKENDS[kernel])

        def one_backend():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return one_backend
    if kernel == "sdpa_mask":
        mask = attention_mask(B, Lq, Lk, key_lengths=key_lengths, causal=causal, device=q.device)
        if mask is None:
            mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=q.device)
        empty = ~mask.any(dim=-1, keepdim=True)
        mask = mask | empty  # rows with no key attend to everything, then are zeroed (as ops does)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).masked_fill(empty, 0.0)
    attention = ops.select({"sdpa": "torch", "triton-ptr": "triton"}.get(kernel, kernel), q.device).attention
    return lambda: attention(q, k, v, key_lengths=key_lengths, causal=causal)


def _timed(mode, fn, q, k, v):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn()
        return run
    g = torch.randn_like(q)

    def run():
        torch.autograd.grad(fn(), (q, k, v), g)
    return run


def _bench(benchmark, kernel, mode, q, k, v, flops, *, key_lengths=None, causal=False, **info):
    run = _timed(mode, _attention_fn(kernel, q, k, v, key_lengths=key_lengths, causal=causal), q, k, v)
    try:
        run()  # compile / autotune before measuring memory
    except RuntimeError as err:  # a named SDPA backend that does not take this case is no peer here
        if kernel not in SDPA_BACKENDS or not UNAVAILABLE.search(str(err)):
            raise  # skipped, a backend that failed (out of memory, ...) would leave a slower one the fastest
        pytest.skip(f"{kernel}: {str(err).splitlines()[0]}")
    peak = peak_memory(run)
    B, H, Lq, D = q.shape
    run_bench(
        benchmark, run, flops=flops * (3.5 if mode == "fwd+bwd" else 1.0),
        kernel=kernel, mode=mode, dtype=DTYPE, B=B, H=H, Lq=Lq, Lk=k.shape[2], D=D, causal=causal,
        peak_memory_bytes=peak, **info,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel", ["triton", "triton-ptr", *KERNELS[1:]])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@HEADS
@pytest.mark.parametrize("L", LENGTHS)
def test_dense(benchmark, pointer_kernels, L, H, D, causal, kernel, mode):
    B = TOKENS // L
    if kernel == "eager" and not _eager_fits(B, H, L, L, mode):
        pytest.skip(f"eager materialises {B}x{H}x{L}x{L} fp32 scores: does not fit")
    q, k, v = _qkv(B, L, H, D)
    flops = 4 * B * H * L * L * D * (0.5 if causal else 1.0)
    _bench(benchmark, kernel, mode, q, k, v, flops, causal=causal, tokens=B * L, tma=_took_tma(kernel, q, k, v))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kernel", ["triton", "triton-ptr", "sdpa", "sdpa_mask", "eager"])
@HEADS
@pytest.mark.parametrize("L", LENGTHS)
def test_padded(benchmark, pointer_kernels, L, H, D, kernel, mode):
    """A padded batch of 16k slots: key lengths uniform in [L/2, L], key padding only (encoder
    self-attention). TFLOP/s counts the useful work only."""
    B = TOKENS // L
    if kernel == "eager" and not _eager_fits(B, H, L, L, mode):
        pytest.skip(f"eager materialises {B}x{H}x{L}x{L} fp32 scores: does not fit")
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=gen).cuda()
    q, k, v = _qkv(B, L, H, D)
    flops = 4 * H * D * L * int(lengths.sum())  # useful work: every query row vs its valid keys
    _bench(benchmark, kernel, mode, q, k, v, flops, key_lengths=lengths, fill=float(lengths.float().mean() / L),
           tma=_took_tma(kernel, q, k, v))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("L", [1024, 2048, 4096, 8192, 16384])
def test_memory_fwd_bwd(benchmark, L, kernel):
    """Peak memory of fwd+bwd vs L at B=1, H=16, D=64, causal (extra_info peak_memory_bytes):
    linear in L for triton and SDPA (flash / memory-efficient; sdpa_mask adds its L² bool mask),
    quadratic for eager."""
    B, H, D = 1, 16, 64
    if kernel == "eager" and not _eager_fits(B, H, L, L, "fwd+bwd"):
        pytest.skip(f"eager materialises {B}x{H}x{L}x{L} fp32 scores: does not fit")
    q, k, v = _qkv(B, L, H, D)
    flops = 4 * B * H * L * L * D * 0.5
    _bench(benchmark, kernel, "fwd+bwd", q, k, v, flops, causal=True)

