"""Embedding * scale + sinusoidal positions: our op vs eager PyTorch vs torch.compile of eager.

    pytest bench/bench_embed.py --benchmark-only [--benchmark-json bench/results/embed_<dev>.json]

Kernels:
- ``ours``:    scratchformer::embed_sinusoidal (csrc/), PE computed on the fly.
- ``eager``:   F.embedding(tokens, weight) * scale + table[pos_offset : pos_offset + L], the
               table precomputed once (what PyTorch users write).
- ``compile``: torch.compile of the same eager function.

GB/s = bytes that must move / median time. Forward: tokens read (N * index bytes) + output
written (N * d) + each distinct row of the weight read once (U * d, U the distinct ids among
the N = B * L tokens: `unique_ids` in extra_info); the eager path also reads its PE table, which
is not counted (its cost, not the job's). A row that later tokens repeat need not come from memory
again: at 262k tokens of a 32k vocabulary each row serves 8 tokens, from the L2 (a 32 MB table at
d 512 in bf16). Until 2026-12-01 a row was counted per token (N * d): torch.compile's forward at
262k x 512 then ran at 3,500 "GB/s" against a measured copy bandwidth of 2,989, and ours at 0.94
of it where the bytes that must move made 0.53. fwd+bwd adds the gradient read (N * d), the
tokens read again and grad_weight written (V * d). extra_info also records the device's copy
bandwidth (bench/conftest.py), the roof for these numbers.

Grid (issue 16): on GPU N in {16k, 64k, 256k} x d_model in {512, 1024} x {bf16, fp32}, forward,
plus fwd+bwd in bf16 at d_model 512 and 1024; on CPU a few modest shapes (fp32, forward) so the run takes a couple of
minutes, most of it torch.compile.
"""

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, copy_bandwidth_gbps, run_bench

from scratchformer.reference import sinusoidal_positions

_ext = pytest.importorskip("scratchformer._ext")

pytestmark = [
    pytest.mark.benchmark(group="embed"),
    pytest.mark.skipif(not _ext.available(), reason="scratchformer._C is not built"),
]

DEVICE = "cuda" if HAS_CUDA else "cpu"
VOCAB = 32_000
SEQ_LEN = 512  # tokens are (N / SEQ_LEN, SEQ_LEN)
KERNELS = ["ours", "eager", "compile"]
_roof_gbps = functools.lru_cache(maxsize=None)(copy_bandwidth_gbps)  # GPU copy GB/s, NaN on CPU

if HAS_CUDA:
    CASES = [
        (n, d, dtype, "fwd")
        for dtype in (torch.bfloat16, torch.float32)
        for n in (16_384, 65_536, 262_144)
        for d in (512, 1024)
    ] + [(n, d, torch.bfloat16, "fwd+bwd") for n in (16_384, 65_536, 262_144) for d in (512, 1024)]
else:
    CASES = [(4096, 256, torch.float32, "fwd"), (16_384, 512, torch.float32, "fwd")]


def _eager(tokens, weight, table, scale):
    L = tokens.shape[1]
    return F.embedding(tokens, weight) * scale + table[:L]


def _case_id(case):
    n, d, dtype, mode = case
    return f"{mode}-N{n}-d{d}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_embed(benchmark, case, kernel):
    n, d, dtype, mode = case
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (n // SEQ_LEN, SEQ_LEN), device=DEVICE)
    weight = (torch.randn(VOCAB, d, device=DEVICE) / math.sqrt(d)).to(dtype)
    weight.requires_grad_(mode == "fwd+bwd")
    scale = math.sqrt(d)
    if kernel == "ours":
        f = lambda: _ext.embed_sinusoidal(tokens, weight, scale=scale)  # noqa: E731
    else:
        table = sinusoidal_positions(torch.arange(SEQ_LEN, device=DEVICE), d, dtype)
        eager = _eager
        if kernel == "compile":
            # Every case recompiles _eager; reset so dynamo's per-function recompile limit (8)
            # never silently falls back to eager.
            torch._dynamo.reset()
            eager = torch.compile(_eager, dynamic=False)
        f = lambda: eager(tokens, weight, table, scale)  # noqa: E731

    elt = weight.element_size()
    unique_ids = int(tokens.unique().numel())
    nbytes = n * tokens.element_size() + (n + unique_ids) * d * elt
    if mode == "fwd":
        fn = f
    else:
        grad = torch.randn(tokens.shape[0], SEQ_LEN, d, device=DEVICE, dtype=dtype)
        nbytes += n * tokens.element_size() + n * d * elt + VOCAB * d * elt

        def fn():
            weight.grad = None
            f().backward(grad)

    with torch.no_grad() if mode == "fwd" else torch.enable_grad():
        run_bench(
            benchmark, fn, nbytes=nbytes, warmup=3, rounds=20 if HAS_CUDA else 10,
            kernel=kernel, mode=mode, tokens=n, d_model=d, vocab=VOCAB, dtype=dtype, unique_ids=unique_ids,
            copy_bandwidth_gbps=_roof_gbps(),
        )
