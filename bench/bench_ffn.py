"""FFN throughput: TFLOP/s per kernel (triton, eager, compile), and our GEMM alone vs torch.matmul.

kernel: triton = our fused FFN (kernels/ffn.py: Triton GEMMs with bias/activation/dropout
epilogues; weight gradients on cuBLAS, see WGRAD_KERNEL there), its GEMMs on the persistent TMA
kernels on Hopper and later (kernels/matmul.py, `SCRATCHFORMER_TMA`; `extra_info["tma"]` says
whether they ran); triton-ptr = the same on the pointer kernels (TMA off), raced at two shapes on
Hopper and later (before, triton is that already); eager = cuBLAS `F.linear` + a
separate activation kernel + `F.linear`; compile = `torch.compile` of that same eager function
(static shapes, compiled afresh per case). bf16, relu, no dropout. Shapes (tokens x d_model x d_ff,
issue 16): the base preset's 512 x 2048 at 4k-64k tokens, 16k x 1024 x 4096, and 8192 x 4096 x 4096.
`test_matmul` times the first projection's GEMM alone, ours against cuBLAS (torch.matmul): the
ceiling the fused FFN's GEMMs are held to.

FLOPs: 2 · tokens · d_model · d_ff per GEMM, two GEMMs forward, x3 for forward + backward.
GPU only: everything here is skipped without CUDA.
"""

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import requires_cuda, run_bench

from scratchformer import ops

pytestmark = [pytest.mark.benchmark(group="ffn"), requires_cuda]

DTYPE = torch.bfloat16
CASES = [(4096, 512, 2048), (16384, 512, 2048), (65536, 512, 2048), (16384, 1024, 4096), (8192, 4096, 4096)]
PTR_CASES = [(16384, 512, 2048), (8192, 4096, 4096)]  # the base preset's, and the GEMM target's
SHAPES = pytest.mark.parametrize("tokens,d_model,d_ff", CASES, ids=[f"t{t}-d{d}-ff{f}" for t, d, f in CASES])


def _eager_ffn(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


@pytest.fixture
def tma(request, monkeypatch) -> bool:
    """Whether the case's GEMMs run on the TMA kernels; triton-ptr switches them off for the case."""
    from scratchformer.kernels import matmul as MM  # after requires_cuda: GPU only

    kernel = request.getfixturevalue("kernel")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    if kernel == "triton-ptr":
        shape = tuple(request.getfixturevalue(k) for k in ("tokens", "d_model", "d_ff"))
        if shape not in PTR_CASES:
            pytest.skip("the pointer kernels are raced against the TMA ones at two shapes (each case autotunes anew)")
        if not hopper:
            pytest.skip("before Hopper, triton is the pointer kernels")
        monkeypatch.setattr(MM, "TMA", False)
    return kernel == "triton" and hopper and MM.TMA is not False


def _impl(kernel):
    if kernel in ("triton", "triton-ptr"):
        ffn = ops.select("triton", "cuda").ffn
        return lambda *a: ffn(*a, activation="relu")
    if kernel == "eager":
        return _eager_ffn
    torch._dynamo.reset()  # a fresh compile per case: the sweep would pass dynamo's recompile limit
    return torch.compile(_eager_ffn, dynamic=False)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("kernel", ["triton", "triton-ptr", "eager", "compile"])
@SHAPES
def test_ffn(benchmark, tma, tokens, d_model, d_ff, kernel, mode):
    grad = mode == "fwd_bwd"
    make = functools.partial(torch.randn, device="cuda", dtype=DTYPE, requires_grad=grad)
    x = make(tokens, d_model)
    w1, b1 = make(d_ff, d_model) / d_model**0.5, make(d_ff)
    w2, b2 = make(d_model, d_ff) / d_ff**0.5, make(d_model)
    params = [t.detach().requires_grad_(grad) for t in (x, w1, b1, w2, b2)]
    dy = torch.randn(tokens, d_model, device="cuda", dtype=DTYPE)
    fn = _impl(kernel)

    def fwd():
        with torch.no_grad():
            return fn(*params)

    def fwd_bwd():
        return torch.autograd.grad(fn(*params), params, dy)

    flops = 2 * 2 * tokens * d_model * d_ff * (3 if grad else 1)
    run_bench(
        benchmark, fwd_bwd if grad else fwd, flops=flops,
        tokens=tokens, d_model=d_model, d_ff=d_ff, kernel=kernel, mode=mode, dtype=DTYPE, tma=tma,
    )


@pytest.mark.parametrize("kernel", ["triton", "triton-ptr", "torch"])
@SHAPES
def test_matmul(benchmark, tma, tokens, d_model, d_ff, kernel):
    """The first projection's GEMM alone, no epilogue: (tokens, d_model) @ (d_model, d_ff)."""
    from scratchformer.kernels.matmul import matmul  # after ops.select's checks, GPU only

    a = torch.randn(tokens, d_model, device="cuda", dtype=DTYPE)
    w = torch.randn(d_ff, d_model, device="cuda", dtype=DTYPE)
    b = w.t()  # nn.Linear layout, as the FFN uses it
    fn = (lambda: torch.matmul(a, b)) if kernel == "torch" else (lambda: matmul(a, b))
    run_bench(
        benchmark, fn, flops=2 * tokens * d_model * d_ff,
        tokens=tokens, d_model=d_model, d_ff=d_ff, kernel=kernel, dtype=DTYPE, what="matmul", tma=tma,
    )
