"""Fused position-wise FFN: y = dropout(act(x W1ᵀ + b1)) W2ᵀ + b2, forward and backward.

Forward: two launches of the Triton GEMM in kernels/matmul.py,

    a = dropout(act(x W1ᵀ + b1))      bias, activation (relu or exact erf-GELU) and Philox dropout
                                      fused in the first GEMM's epilogue; a is (M, d_ff)
    y = a W2ᵀ + b2                    bias fused in the second GEMM's epilogue

Backward, with g = dy (M, d_model):

    db2 = Σ_rows g                     a torch reduction in fp32
    dW2 = gᵀ a                         (d_model, d_ff)
    dh  = (g W2) ⊙ act'(h) ⊙ keep/(1-p)  one Triton GEMM with the derivative in its epilogue
    db1 = Σ_rows dh                    per-row-tile fp32 partials from that epilogue, then a sum
    dW1 = dhᵀ x                        (d_ff, d_model)
    dx  = dh W1                        (M, d_model), Triton GEMM

Store or recompute the pre-activation h? relu stores nothing extra: the saved GEMM output
a = dropout(relu(h)) is positive exactly where the gradient flows (kept and h > 0), so act' and
the dropout mask both come from a, which the backward needs anyway for dW2. gelu stores h (one
extra (M, d_ff) write in the forward and read in the backward, only when a gradient is needed):
recomputing h would cost a whole x W1ᵀ GEMM (2·M·d_model·d_ff flops), far more time than moving
M·d_ff elements on any GPU where the FFN is compute bound. gelu's dropout mask is replayed from
the same Philox counters, not stored.

Weight gradients: torch.matmul (cuBLAS) by default (`WGRAD_KERNEL = "torch"`). Their reduction
dim is the token count (K = M up to 64k) while the output, d_model x d_ff, has few tiles (64 tiles
of 128x128 at d512/ff2048, fewer than an H100 has SMs): that wants split-K, which cuBLAS has and
our GEMM does not. Set WGRAD_KERNEL = "triton" to run them on our GEMM (the tests cover both).

Limits: 16 <= d_model, d_ff <= 16384 (the tested range); any number of tokens and leading dims;
x, weights and biases share one dtype: float32, float16 or bfloat16, fp32 accumulation.
bf16 under TRITON_INTERPRET=1 upcasts GEMM operands to fp32 (see kernels/matmul.py).
"""

from __future__ import annotations

import torch

from ._common import check_device, check_dtype, dropout_seed_offset
from .matmul import matmul, matmul_dact

MIN_DIM, MAX_DIM = 16, 16384
WGRAD_KERNEL = "torch"  # "torch" (cuBLAS, split-K) or "triton" (our GEMM); see the docstring


def _check_inputs(x, w1, b1, w2, b2, activation, dropout_p):
    check_device("ffn", x, w1, b1, w2, b2)
    check_dtype("ffn", x, w1, b1, w2, b2)
    if activation not in ("relu", "gelu"):
        raise ValueError(f"ffn: activation must be 'relu' or 'gelu', got {activation!r}")
    if x.dim() < 1:
        raise ValueError("ffn: x must be (..., d_model), got a scalar")
    d_model = x.shape[-1]
    if w1.dim() != 2 or w1.shape[1] != d_model:
        raise ValueError(f"ffn: w1 must be (d_ff, {d_model}) for x's d_model {d_model}, got {tuple(w1.shape)}")
    d_ff = w1.shape[0]
    if w2.dim() != 2 or w2.shape != (d_model, d_ff):
        raise ValueError(f"ffn: w2 must be ({d_model}, {d_ff}) (d_model, d_ff), got {tuple(w2.shape)}")
    if b1 is not None and b1.shape != (d_ff,):
        raise ValueError(f"ffn: b1 must be ({d_ff},), got {tuple(b1.shape)}")
    if b2 is not None and b2.shape != (d_model,):
        raise ValueError(f"ffn: b2 must be ({d_model},), got {tuple(b2.shape)}")
    for name, d in (("d_model", d_model), ("d_ff", d_ff)):
        if not MIN_DIM <= d <= MAX_DIM:
            raise ValueError(f"ffn: {name} must be in [{MIN_DIM}, {MAX_DIM}], got {d}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"ffn: dropout_p must be in [0, 1), got {dropout_p}")


def ffn_fwd(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, seed=0, rng_offset=0,
            store_pre=False, store_mask=False):
    """Launch the forward. x (..., d_model). Returns y (x's shape), a = dropout(act(h)) (M, d_ff),
    h (M, d_ff) or None (store_pre), keep mask (..., d_ff) bool or None (store_mask). Trusts its
    inputs as `ffn` checked them."""
    d_model, d_ff = x.shape[-1], w1.shape[0]
    x2 = x.reshape(-1, d_model)  # a view when the leading dims allow; any strides are fine
    out = matmul(
        x2, w1.t(), bias=b1, activation=activation, dropout_p=dropout_p, seed=seed,
        rng_offset=rng_offset, store_pre=store_pre, store_mask=store_mask,
    )
    out = out if isinstance(out, tuple) else (out,)
    a = out[0]
    pre = out[1] if store_pre else None
    mask = out[-1].view(*x.shape[:-1], d_ff) if store_mask else None
    y = matmul(a, w2.t(), bias=b2)
    return y.view(*x.shape[:-1], d_model), a, pre, mask


def _wgrad(a, b):
    """a (P, M) @ b (M, Q) for a weight gradient, reduced over tokens M; see WGRAD_KERNEL."""
    if WGRAD_KERNEL == "triton":
        return matmul(a, b)
    return torch.matmul(a, b)


def ffn_bwd(dy, x, w1, w2, a, pre, *, activation, has_b1, has_b2, dropout_p=0.0, seed=0, rng_offset=0,
            needs_dx=True):
    """Launch the backward. dy (..., d_model). Returns dx (x's shape) or None, dw1, db1, dw2, db2."""
    d_model = x.shape[-1]
    x2 = x.reshape(-1, d_model)
    g = dy.reshape(-1, d_model)
    db2 = g.float().sum(0).to(w2.dtype) if has_b2 else None
    dw2 = _wgrad(g.t(), a)  # (d_model, d_ff)
    dh, db1 = matmul_dact(
        g, w2, a if activation == "relu" else pre, activation=activation, dropout_p=dropout_p,
        seed=seed, rng_offset=rng_offset, bias_grad=has_b1,
    )
    db1 = db1.to(w1.dtype) if has_b1 else None
    dw1 = _wgrad(dh.t(), x2)  # (d_ff, d_model)
    dx = matmul(dh, w1).view(x.shape) if needs_dx else None
    return dx, dw1, db1, dw2, db2


class FFNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2, activation, dropout_p, seed, rng_offset, return_mask):
        needs_grad = any(ctx.needs_input_grad[:5])
        y, a, pre, mask = ffn_fwd(
            x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, seed=seed,
            rng_offset=rng_offset, store_pre=needs_grad and activation == "gelu", store_mask=return_mask,
        )
        ctx.save_for_backward(x, w1, w2, a, pre)
        ctx.cfg = dict(activation=activation, has_b1=b1 is not None, has_b2=b2 is not None,
                       dropout_p=dropout_p, seed=seed, rng_offset=rng_offset)
        if mask is not None:
            ctx.mark_non_differentiable(mask)
        return y, mask

    @staticmethod
    def backward(ctx, dy, dmask):
        x, w1, w2, a, pre = ctx.saved_tensors
        dx, dw1, db1, dw2, db2 = ffn_bwd(dy, x, w1, w2, a, pre, needs_dx=ctx.needs_input_grad[0], **ctx.cfg)
        return dx, dw1, db1, dw2, db2, None, None, None, None, None


def ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    *,
    activation: str = "relu",
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_dropout_mask: bool = False,
):
    """dropout(act(x W1ᵀ + b1)) W2ᵀ + b2, nn.Linear weight layout.

    x (..., d_model), any leading dims and strides; w1 (d_ff, d_model); b1 (d_ff,) or None;
    w2 (d_model, d_ff); b2 (d_model,) or None; all one dtype (float32/float16/bfloat16);
    16 <= d_model, d_ff <= 16384. activation "relu" or "gelu" (exact erf). dropout_p drops
    act(h) with in-kernel Philox; seed fixes the stream, else it is drawn from torch's default
    generator (so `torch.manual_seed` makes runs reproducible).

    Returns y (..., d_model) in x's dtype; with return_dropout_mask (debug), (y, mask) where mask
    (..., d_ff) bool is the keep mask (True = kept). Raises ValueError naming a bad input.
    """
    _check_inputs(x, w1, b1, w2, b2, activation, dropout_p)
    seed, rng_offset = dropout_seed_offset(dropout_p, seed)
    y, mask = FFNFunction.apply(
        x, w1, b1, w2, b2, activation, float(dropout_p), int(seed), int(rng_offset), bool(return_dropout_mask)
    )
    return (y, mask) if return_dropout_mask else y
