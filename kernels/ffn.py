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
the same Philox counters, not stored: the forward's (seed, offset) live in a (2,) int64 tensor in
device memory (`_common.dropout_rng`, drawn on the device per call, so a CUDA graph replay or a
compiled call draws afresh) that both GEMM epilogues load.

Weight gradients: torch.matmul (cuBLAS) by default (`WGRAD_KERNEL = "torch"`). Their reduction
dim is the token count (K = M up to 64k) while the output, d_model x d_ff, has few tiles (64 tiles
of 128x128 at d512/ff2048, fewer than an H100 has SMs): that wants split-K, which cuBLAS has and
our GEMM does not. Set WGRAD_KERNEL = "triton" to run them on our GEMM (the tests cover both).

Torch ops (registration section): `scratchformer::ffn(x, w1, b1?, w2, b2?, activation, dropout_p,
rng?, store_pre) -> (y, a, h)` (a and h are the saved activations, not differentiable; h empty
unless store_pre) and `scratchformer::ffn_backward` -> (dx, dw1, db1, dw2, db2). Linked by one
autograd (`_setup_context` + `_backward`, registered on the op and as `FFNFunction`), which saves
rng (None without dropout) for the backward (how they are registered, and why:
`kernels/_common.py`).

Limits: 16 <= d_model, d_ff <= 16384 (the tested range); any number of tokens and leading dims;
x, weights and biases share one dtype: float32, float16 or bfloat16, fp32 accumulation.
bf16 under TRITON_INTERPRET=1 upcasts GEMM operands to fp32 (see kernels/matmul.py).
"""

from __future__ import annotations

import torch

from ._common import (
    NONE_SHAPE,
    call_op,
    check_device,
    check_dropout,
    check_dtype,
    check_flag,
    check_tensors,
    define_op,
    dropout_rng,
    op_autograd,
    or_empty,
)
from .matmul import launch_matmul, launch_matmul_dact

MIN_DIM, MAX_DIM = 16, 16384
WGRAD_KERNEL = "torch"  # "torch" (cuBLAS, split-K) or "triton" (our GEMM); see the docstring


def _check_inputs(x, w1, b1, w2, b2, activation, dropout_p, seed=None):
    check_tensors("ffn", ("b1", "b2"), x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    _check_device_dtype(x, w1, b1, w2, b2)
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
    _check_widths(d_model, d_ff)
    check_dropout("ffn", dropout_p, seed)


def check_limits(x, w1, b1, w2, b2, **_):
    """What only this kernel refuses of the calls the backend-wide check (`op_checks.check_ffn`,
    which `scratchformer.ops` runs first) passes: devices, dtypes and widths, in `ffn`'s order
    and with its messages. `ffn_trusted` after both is `ffn`, its inputs checked once."""
    _check_device_dtype(x, w1, b1, w2, b2)
    _check_widths(x.shape[-1], w1.shape[0])


def _check_device_dtype(*tensors):
    check_device("ffn", *tensors)
    check_dtype("ffn", *tensors)


def _check_widths(d_model, d_ff):
    for name, d in (("d_model", d_model), ("d_ff", d_ff)):
        if not MIN_DIM <= d <= MAX_DIM:
            raise ValueError(f"ffn: {name} must be in [{MIN_DIM}, {MAX_DIM}], got {d}")


def ffn_fwd(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, rng=None, store_pre=False, store_mask=False):
    """Launch the forward. x (..., d_model); rng the (2,) int64 [seed, offset] tensor on x's device
    (`dropout_rng`), needed when dropout_p > 0. Returns y (x's shape), a = dropout(act(h)) (M, d_ff),
    h (M, d_ff) or None (store_pre), keep mask (..., d_ff) bool or None (store_mask). Trusts its
    inputs as `ffn` checked them."""
    d_model, d_ff = x.shape[-1], w1.shape[0]
    x2 = x.reshape(-1, d_model)  # a view when the leading dims allow; any strides are fine
    out = launch_matmul(x2, w1.t(), b1, activation, dropout_p, rng, store_pre, store_mask)
    a = out[0]
    pre = out[1] if store_pre else None
    mask = out[-1].view(*x.shape[:-1], d_ff) if store_mask else None
    y = launch_matmul(a, w2.t(), b2)[0]
    return y.view(*x.shape[:-1], d_model), a, pre, mask


def _wgrad(a, b):
    """a (P, M) @ b (M, Q) for a weight gradient, reduced over tokens M; see WGRAD_KERNEL."""
    if WGRAD_KERNEL == "triton":
        return launch_matmul(a, b)[0]
    return torch.matmul(a, b)


def ffn_bwd(dy, x, w1, w2, a, pre, *, activation, has_b1, has_b2, dropout_p=0.0, rng=None, needs_dx=True):
    """Launch the backward. dy (..., d_model); rng the forward's (gelu replays its mask). Returns dx
    (x's shape) or None, dw1, db1, dw2, db2."""
    d_model = x.shape[-1]
    x2 = x.reshape(-1, d_model)
    g = dy.reshape(-1, d_model)
    # g has the bias's dtype: torch's sum accumulates 16-bit floats in fp32 (CUDA and CPU) and rounds
    # once, as the fp32 sum cast after did (the same values on the CPU machine, 7-70k rows), in one
    # kernel where that took two
    db2 = g.sum(0) if has_b2 else None
    dw2 = _wgrad(g.t(), a)  # (d_model, d_ff)
    dh, db1 = launch_matmul_dact(g, w2, a if activation == "relu" else pre, activation, dropout_p, rng, has_b1,
                                 w1.dtype)  # db1 rounded to the bias's dtype where it is summed: no cast after
    dw1 = _wgrad(dh.t(), x2)  # (d_ff, d_model)
    dx = launch_matmul(dh, w1)[0].view(*x.shape) if needs_dx else None  # unpacked: a torch.Size parses slower
    return dx, dw1, db1, dw2, db2


# ---------------------------------------------------------------------------------------------
# torch ops: scratchformer::ffn and scratchformer::ffn_backward, and the autograd.Function linking
# them (why ops, and why autograd outside them: kernels/_common.py). The GEMMs are autotuned with
# an early_config_prune hook and the weight gradients may go to torch.matmul (WGRAD_KERNEL). The
# op is opaque to torch.compile (one node, fake impl for shapes) and to autocast (the caller casts).
# ---------------------------------------------------------------------------------------------

@define_op(
    "ffn",
    "(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation, float dropout_p, Tensor? rng, "
    "bool store_pre) -> (Tensor, Tensor, Tensor)",
)
def _ffn_op(x, w1, b1, w2, b2, activation, dropout_p, rng, store_pre):
    """(y, a, h): y (..., d_model) contiguous; a = dropout(act(h)) (M, d_ff), which the backward
    needs; the pre-activation h (M, d_ff) when store_pre (gelu with a gradient), else empty (0,).
    Dropout is a pure function of rng's (seed, offset) ((2,) int64 on x's device; None without)."""
    y, a, pre, _ = ffn_fwd(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, rng=rng,
                           store_pre=store_pre)
    return y, a, pre if pre is not None else x.new_empty(NONE_SHAPE)


@torch.library.register_fake(_ffn_op)
def _(x, w1, b1, w2, b2, activation, dropout_p, rng, store_pre):
    _check_inputs(x, w1, b1, w2, b2, activation, dropout_p)  # no data read
    d_ff = w1.shape[0]
    M = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(M, d_ff), x.new_empty((M, d_ff) if store_pre else NONE_SHAPE)


@define_op(
    "ffn_backward",
    "(Tensor dy, Tensor x, Tensor w1, Tensor w2, Tensor a, Tensor pre, str activation, bool has_b1, "
    "bool has_b2, float dropout_p, Tensor? rng, bool needs_dx) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _ffn_backward_op(dy, x, w1, w2, a, pre, activation, has_b1, has_b2, dropout_p, rng, needs_dx):
    """(dx, dw1, db1, dw2, db2), each contiguous in its input's shape; dx, db1, db2 are empty (0,)
    when not asked for (needs_dx, has_b1, has_b2). gelu's mask is replayed from the forward's rng."""
    dx, dw1, db1, dw2, db2 = ffn_bwd(
        dy, x, w1, w2, a, pre, activation=activation, has_b1=has_b1, has_b2=has_b2, dropout_p=dropout_p,
        rng=rng, needs_dx=needs_dx,
    )
    return or_empty(dx, x), dw1.contiguous(), or_empty(db1, x), dw2.contiguous(), or_empty(db2, x)


@torch.library.register_fake(_ffn_backward_op)
def _(dy, x, w1, w2, a, pre, activation, has_b1, has_b2, dropout_p, rng, needs_dx):
    d_model, d_ff = w2.shape
    dx = x.new_empty(x.shape if needs_dx else NONE_SHAPE)
    return dx, w1.new_empty(w1.shape), w1.new_empty(d_ff if has_b1 else 0), w2.new_empty(w2.shape), \
        w2.new_empty(d_model if has_b2 else 0)


def _setup_context(ctx, inputs, output):
    """scratchformer::ffn's autograd (`op_autograd`): its backward op, with the forward's inputs;
    the rng tensor is saved, so the backward replays the forward's dropout mask."""
    x, w1, b1, w2, b2, activation, dropout_p, rng, _store_pre = inputs
    _y, a, pre = output
    ctx.mark_non_differentiable(a, pre)
    # y is the only differentiable output, so the backward always gets dy; without this, autograd
    # would also build zero gradients for a and pre, (M, d_ff) each, and pass them in unread
    ctx.set_materialize_grads(False)
    if any(ctx.needs_input_grad[:5]):
        ctx.save_for_backward(x, w1, w2, a, pre, rng)
    ctx.cfg = (activation, b1 is not None, b2 is not None, dropout_p)


def _backward(ctx, dy, da, dpre):  # a and pre are saved activations, not differentiable
    x, w1, w2, a, pre, rng = ctx.saved_tensors
    activation, has_b1, has_b2, dropout_p = ctx.cfg
    if activation == "gelu" and pre.numel() != a.numel():
        raise RuntimeError("ffn: the gelu backward needs the pre-activation, which the forward did not store "
                           "(store_pre=False)")
    dx, dw1, db1, dw2, db2 = call_op(_ffn_backward_op, dy, x, w1, w2, a, pre, *ctx.cfg, rng, ctx.needs_input_grad[0])
    return (dx if ctx.needs_input_grad[0] else None, dw1, db1 if has_b1 else None, dw2,
            db2 if has_b2 else None, None, None, None, None)


FFNFunction = op_autograd("FFNFunction", _ffn_op, _ffn_backward_op, _setup_context, _backward)


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
    act(h) with in-kernel Philox; seed (int) fixes the stream, else its (seed, offset) is drawn
    on x's device from torch's generator for that device (`_common.dropout_rng`: `torch.manual_seed`
    makes runs reproducible, and each call, CUDA graph replay or compiled call draws afresh).

    Returns y (..., d_model) in x's dtype; with return_dropout_mask (debug), (y, mask) where mask
    (..., d_ff) bool is the keep mask (True = kept). Raises ValueError naming a bad input.
    """
    _check_inputs(x, w1, b1, w2, b2, activation, dropout_p, seed)
    check_flag("ffn", "return_dropout_mask", return_dropout_mask)
    return ffn_trusted(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, seed=seed,
                       return_dropout_mask=return_dropout_mask)


def ffn_trusted(x, w1, b1, w2, b2, *, activation="relu", dropout_p=0.0, seed=None, return_dropout_mask=False):
    """`ffn` without its checks, for a caller that ran them: `scratchformer.ops`, whose check
    (`op_checks.check_ffn`) and `check_limits` refuse every call `ffn`'s checks would."""
    rng = dropout_rng(dropout_p, seed, x.device)
    params = (x, w1, b1, w2, b2)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    args = (x, w1, b1, w2, b2, activation, float(dropout_p), rng, needs_grad and activation == "gelu")
    y, _, _ = FFNFunction.apply(*args) if needs_grad else call_op(_ffn_op, *args)  # no gradient: the op alone
    mask = None
    if return_dropout_mask:  # debug: replay the first GEMM's Philox stream into a stored mask
        with torch.no_grad():
            mask = ffn_fwd(x, w1, b1, w2, b2, activation=activation, dropout_p=dropout_p, rng=rng,
                           store_mask=True)[3]
    return (y, mask) if return_dropout_mask else y
