"""Fused output projection + label-smoothed cross-entropy: the loss of x Wᵀ + b without the logits.

For rows x (N, d), the generator's weight W (V, d) and bias b (V,), targets t (N,) and smoothing ε,

    z = x Wᵀ + b,   p = softmax(z),   lse = log Σ_j exp(z_j)
    nll  = lse - z_t
    loss = (1 - ε) nll + ε / (V - 2) Σ_{j ∉ {t, pad}} (lse - z_j)

summed over the rows whose target is not `pad` (those contribute 0). This is the trainer's loss
(annotated-transformer's LabelSmoothing: ε spread over the V - 2 tokens that are neither gold nor
PAD; `scratchformer.reference.cross_entropy_ref`). Its gradient is p minus the smoothed target q:

    ∂loss/∂z_j = p_j - q_j,  q_t = 1 - ε,  q_pad = 0,  q_j = ε / (V - 2) otherwise

and dx = (p - q) W, dW = (p - q)ᵀ x, db = Σ_rows (p - q).

The logits of a whole batch, (N, V) with V up to 30k, are the largest activation of a small
model's training step: the unfused loss keeps them in fp32 for log_softmax's backward and makes
three more (N, V) tensors in its backward. Here the rows go through in chunks (Liger-Kernel's
FusedLinearCrossEntropy; Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models"): a chunk's logits come from one cuBLAS GEMM, one Triton program per row reads them once
for the running max and sum of exp (online softmax) and once more to overwrite them in place with
p - q, and two more GEMMs turn that into the chunk's dx and its share of dW. So the gradient is
computed in the forward, and the backward only scales dx, dW and db by the loss's incoming
gradient (a scalar: the loss is a sum). At most `CHUNK_ELEMENTS` logits exist at a time; without
a gradient wanted the forward stops after the loss.

Why chunks of up to 2^24 logits and not Liger's ~N·d: each chunk is four launches, and the
training step is host-bound on an H100 (issue 17); 2^24 bf16 logits are 32 MiB, two chunks at the
Multi30k shapes (4,096 tokens x 8,000), four at CNN/DailyMail's (2,048 x 30,522).

Torch op (registration section): `scratchformer::linear_cross_entropy(x, weight, bias?, target,
label_smoothing, ignore_index, needs_grad) -> (loss, nll, dx, dw, db)`, loss and nll per row
(fp32), the gradients empty (0,) unless needs_grad; `LinearCrossEntropyFunction` saves them.

Limits: x, weight and bias share one dtype (float32, float16, bfloat16; the GEMMs accumulate in
fp32, the row pass computes in fp32, dW sums the chunks in fp32); V >= 3 when ε > 0; targets
int64 in [0, V).
"""

from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from ._common import (
    NONE_SHAPE,
    call_op,
    check_device,
    check_dtype,
    check_number,
    check_tensors,
    define_op,
    first_order,
    next_pow2,
    no_autograd,
    or_empty,
)

CHUNK_ELEMENTS = 1 << 24  # logits per chunk (see the docstring)
MAX_BLOCK_V = 4096


@triton.jit(do_not_specialize=["row0"])
def _cross_entropy_kernel(
    z_ptr, stride_z_n, target_ptr, loss_ptr, nll_ptr, row0,
    V, pad_id, gold_w, other_w,
    WRITE_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Row `row` of a chunk's logits z, the batch's row row0 + row: its loss and NLL (0 where the
    target is pad); with WRITE_GRAD, the row overwritten with p - q (zeros where the target is pad).
    The batch's target, loss and NLL are indexed from row0, not sliced: their pointers keep one
    alignment, so one compiled kernel serves every chunk."""
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z_n
    t = tl.load(target_ptr + row0 + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)  # running max
    s = tl.zeros((), tl.float32)  # running Σ exp(z - m)
    sz = tl.zeros((), tl.float32)  # Σ z over the columns but pad's (a -inf pad logit, PAD barred, adds nothing)
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        z = tl.load(z_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        sz += tl.sum(tl.where((offs < V) & (offs != pad_id), z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    # a target outside [0, V) (refused by op_checks where they read values; unread on a GPU without
    # SCRATCHFORMER_DEBUG) is never read past the row: its loss and gradient row are NaN, not a guess
    valid = (t >= 0) & (t < V)
    z_t = tl.load(z_row + t, mask=valid, other=float("nan")).to(tl.float32)
    nll = lse - z_t
    others = (V - 2) * lse - sz + z_t  # Σ over j ∉ {t, pad} of lse - z_j: inf where a logit is -inf
    keep = t != pad_id
    smoothed = tl.where(other_w != 0.0, other_w * others, 0.0)  # without smoothing, no 0 * inf
    tl.store(loss_ptr + row0 + row, tl.where(keep, gold_w * nll + smoothed, 0.0))
    tl.store(nll_ptr + row0 + row, tl.where(keep, nll, 0.0))
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            z = tl.load(z_row + offs, mask=offs < V, other=0.0).to(tl.float32)
            q = tl.where(offs == t, gold_w, tl.where(offs == pad_id, 0.0, other_w))
            g = tl.where(keep, tl.where(valid, tl.exp(z - lse) - q, float("nan")), 0.0)
            tl.store(z_row + offs, g.to(z_ptr.dtype.element_ty), mask=offs < V)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------


def check_limits(x, weight, bias, target, **_):
    """What only this kernel refuses of the calls the backend-wide check
    (`op_checks.check_linear_cross_entropy`, which `scratchformer.ops` runs first) passes: devices
    (the bias's too) and dtypes, in `linear_cross_entropy`'s order and with its messages.
    `linear_cross_entropy_trusted` after both is `linear_cross_entropy`, its inputs checked once."""
    check_device("linear_cross_entropy", x, weight, bias, target)
    check_dtype("linear_cross_entropy", x, weight, bias)


def _check_inputs(x, weight, bias, target, label_smoothing, ignore_index):
    """What the kernel needs to read in bounds: one device and dtype, (N, d) x (V, d) operands, a
    bias of V, int64 targets one per row, ignore_index a column, and V - 2 > 0 to smooth over."""
    name = "linear_cross_entropy"
    check_tensors(name, ("bias",), x=x, weight=weight, bias=bias, target=target)
    check_limits(x, weight, bias, target)
    N, V = x.shape[0], weight.shape[0]
    shapes_ok = x.dim() == weight.dim() == 2 and x.shape[1] == weight.shape[1] and \
        (bias is None or tuple(bias.shape) == (V,)) and target.dtype == torch.int64 and tuple(target.shape) == (N,)
    if not shapes_ok:
        raise ValueError(f"{name}: want x (N, d), weight (V, d), bias (V,) or None and int64 target (N,); got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)}, target {target.dtype} {tuple(target.shape)}")
    check_number(name, "label_smoothing", label_smoothing)
    integer = _is_integer(ignore_index)  # 1.5 was read as class 1
    if not (integer and 0 <= ignore_index < V and 0.0 <= label_smoothing < 1.0 and (label_smoothing == 0.0 or V >= 3)):
        raise ValueError(f"{name}: want ignore_index in [0, V) and label_smoothing in [0, 1) (V >= 3 to smooth); got "
                         f"{ignore_index}, {label_smoothing} with V = {V}")


def _is_integer(value) -> bool:
    """A Python or numpy integer (not a bool), as op_checks takes one."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _chunk_rows(N: int, V: int) -> int:
    return max(1, min(N, CHUNK_ELEMENTS // V))


def linear_cross_entropy_fwd(x, weight, bias, target, label_smoothing, ignore_index, needs_grad):
    """(loss, nll) per row, fp32 (N,) each, and with needs_grad the unscaled (dx, dw, db): dx
    (N, d) and dw (V, d) in x's dtype, db (V,) fp32 (None without a bias); else (None, None, None)."""
    N, V = x.shape[0], weight.shape[0]
    target = target.contiguous()  # the kernel indexes it by row
    loss = torch.empty(N, device=x.device, dtype=torch.float32)
    nll = torch.empty_like(loss)
    rows = _chunk_rows(N, V)
    chunks = [(start, min(start + rows, N)) for start in range(0, N, rows)]
    # contiguous whatever x's strides, as the fake impl says (empty_like kept a transposed x's strides)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if needs_grad else None
    # one chunk: dW is that chunk's GEMM (fp32 accumulation inside); several: their sum in fp32
    dw = torch.zeros(weight.shape, device=x.device, dtype=torch.float32) if needs_grad and len(chunks) != 1 else None
    db = torch.zeros(V, device=x.device, dtype=torch.float32) if needs_grad and bias is not None else None
    eps = float(label_smoothing)
    gold_w, other_w = 1.0 - eps, (eps / (V - 2) if eps > 0.0 else 0.0)
    block_v = min(next_pow2(V), MAX_BLOCK_V)
    for start, end in chunks:
        xc = x[start:end]
        z = xc @ weight.t() if bias is None else torch.addmm(bias, xc, weight.t())
        _cross_entropy_kernel[(end - start,)](
            z, z.stride(0), target, loss, nll, start,
            V, ignore_index, gold_w, other_w,
            WRITE_GRAD=needs_grad, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        )
        if not needs_grad:
            continue
        # z now holds p - q
        torch.mm(z, weight, out=dx[start:end])
        if dw is None:
            dw = z.t() @ xc
        else:
            dw += z.t() @ xc
        if db is not None:
            db += z.sum(0, dtype=torch.float32)
    if not needs_grad:
        return loss, nll, None, None, None
    return loss, nll, dx, dw.to(weight.dtype), db


# ---------------------------------------------------------------------------------------------
# registration: a torch op (opaque to torch.compile, one node with a fake impl; autocast does not
# look inside: the caller casts) and its autograd, a scalar scaling of what the forward computed
# ---------------------------------------------------------------------------------------------


@define_op(
    "linear_cross_entropy",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor target, float label_smoothing, int ignore_index, "
    "bool needs_grad) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _linear_cross_entropy_op(x, weight, bias, target, label_smoothing, ignore_index, needs_grad):
    """(loss, nll, dx, dw, db): per-row fp32 loss and NLL; the unscaled gradients, each empty (0,)
    when not computed (needs_grad False, or db without a bias)."""
    loss, nll, dx, dw, db = linear_cross_entropy_fwd(x, weight, bias, target, label_smoothing, ignore_index,
                                                     needs_grad)
    return loss, nll, or_empty(dx, x), or_empty(dw, x), or_empty(db, x)


@torch.library.register_fake(_linear_cross_entropy_op)
def _(x, weight, bias, target, label_smoothing, ignore_index, needs_grad):
    _check_inputs(x, weight, bias, target, label_smoothing, ignore_index)  # no data read
    N, V = x.shape[0], weight.shape[0]
    loss = x.new_empty(N, dtype=torch.float32)
    return (loss, x.new_empty(N, dtype=torch.float32), x.new_empty(x.shape if needs_grad else NONE_SHAPE),
            weight.new_empty(weight.shape if needs_grad else NONE_SHAPE),
            x.new_empty(V if needs_grad and bias is not None else 0, dtype=torch.float32))


# Called through the dispatcher on inputs that want a gradient, the op has none to give: its
# per-row loss would need dW reweighted per row, which its one sum over the rows cannot be
no_autograd(_linear_cross_entropy_op, "not differentiated itself: it returns the gradients of its summed loss "
            "(needs_grad=True); call linear_cross_entropy(...), whose autograd scales them")


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The summed loss and NLL; the backward scales the gradients the forward computed by the
    loss's incoming gradient (the NLL is reported, not differentiated)."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, label_smoothing, ignore_index):
        loss, nll, dx, dw, db = call_op(_linear_cross_entropy_op, x, weight, bias, target, label_smoothing,
                                        ignore_index, True)
        ctx.save_for_backward(dx, dw, db)
        ctx.has_bias = bias is not None
        nll = nll.sum()
        ctx.mark_non_differentiable(nll)
        return loss.sum(), nll

    @staticmethod
    def backward(ctx, dloss, dnll):
        first_order(ctx, "scratchformer::linear_cross_entropy")
        dx, dw, db = ctx.saved_tensors
        g = dloss.float()
        return dx * g, dw * g, (db * g).to(dw.dtype) if ctx.has_bias else None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The label-smoothed cross-entropy of the logits x Wᵀ + b against target, summed, and the
    summed NLL, without the (N, V) logits in memory (module docstring).

    x (N, d); weight (V, d), nn.Linear layout; bias (V,) or None; all one dtype (float32, float16,
    bfloat16); target (N,) int64 in [0, V), rows whose target is ignore_index left out.
    label_smoothing ε in [0, 1) spreads ε over the V - 2 classes that are neither the target nor
    ignore_index. Returns (loss, nll): fp32 scalars; loss is differentiable in x, weight and bias,
    nll is not. Raises ValueError naming a bad input.
    """
    _check_inputs(x, weight, bias, target, label_smoothing, ignore_index)
    return linear_cross_entropy_trusted(x, weight, bias, target, label_smoothing=label_smoothing,
                                        ignore_index=ignore_index)


def linear_cross_entropy_trusted(x, weight, bias, target, *, label_smoothing=0.0, ignore_index=0):
    """`linear_cross_entropy` without its checks, for a caller that ran them: `scratchformer.ops`, whose
    check (`op_checks.check_linear_cross_entropy`) and `check_limits` refuse every call its checks would."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if needs_grad:
        return LinearCrossEntropyFunction.apply(x, weight, bias, target, float(label_smoothing), int(ignore_index))
    loss, nll, _, _, _ = call_op(_linear_cross_entropy_op, x, weight, bias, target, float(label_smoothing),
                                 int(ignore_index), False)
    return loss.sum(), nll.sum()
