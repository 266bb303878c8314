"""The generator + training loss: time and peak memory per kernel, bf16.

kernel: triton = the fused `linear_cross_entropy` (kernels/cross_entropy.py: chunks of at most
2^24 logits, cuBLAS GEMMs, our row kernel for the loss and the gradient); eager = the spec
(`reference.linear_cross_entropy_ref`: the whole logits, log_softmax in fp32); torch = `F.linear` +
that loss; compile = `torch.compile` of the torch one (static shapes, compiled afresh per case).
Each is the backend's op as the model calls it: label smoothing 0.1, one row in eight PAD.

Shapes (tokens x d_model x vocabulary): the Multi30k/IWSLT `small` model's (4,096 x 256 x 8,000),
the `base` preset at CNN/DailyMail's target batch (2,048 x 512 x 30,522), and a larger batch
(16,384 x 512 x 32,000). `peak_memory_bytes` in extra_info: one call's peak above what its inputs
hold (issue 17's memory target is the training step's; this is the part the loss contributes).

FLOPs: 2 · tokens · d_model · V for the logits GEMM; forward + backward x3.
GPU only: everything here is skipped without CUDA.
"""

import pytest
import torch
from conftest import peak_memory, requires_cuda, run_bench

from scratchformer import ops

pytestmark = [pytest.mark.benchmark(group="cross_entropy"), requires_cuda]

DTYPE = torch.bfloat16
CASES = [(4096, 256, 8000), (2048, 512, 30522), (16384, 512, 32000)]


def _impl(kernel):
    if kernel != "compile":
        return ops.select(kernel, "cuda").linear_cross_entropy
    torch._dynamo.reset()  # a fresh compile per case
    return torch.compile(ops.select("torch", "cuda").linear_cross_entropy, dynamic=False)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("kernel", ["triton", "eager", "torch", "compile"])
@pytest.mark.parametrize("tokens,d_model,vocab", CASES, ids=[f"t{t}-d{d}-v{v}" for t, d, v in CASES])
def test_linear_cross_entropy(benchmark, tokens, d_model, vocab, kernel, mode):
    grad = mode == "fwd_bwd"
    x = torch.randn(tokens, d_model, device="cuda", dtype=DTYPE).requires_grad_(grad)
    w = (torch.randn(vocab, d_model, device="cuda") / d_model**0.5).to(DTYPE).requires_grad_(grad)
    target = torch.randint(4, vocab, (tokens,), device="cuda")
    target[::8] = 0  # PAD
    fn = _impl(kernel)

    def fwd():
        with torch.no_grad():
            return fn(x, w, None, target, label_smoothing=0.1, ignore_index=0)

    def fwd_bwd():
        return torch.autograd.grad(fn(x, w, None, target, label_smoothing=0.1, ignore_index=0)[0], (x, w))

    run = fwd_bwd if grad else fwd
    run()  # compile before measuring memory
    peak = peak_memory(run)
    run_bench(
        benchmark, run, flops=2 * tokens * d_model * vocab * (3 if grad else 1),
        tokens=tokens, d_model=d_model, vocab=vocab, kernel=kernel, mode=mode, dtype=DTYPE,
        peak_memory_bytes=peak,
    )
