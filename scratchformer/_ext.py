"""Python side of the C++/CUDA ops in `scratchformer._C` (csrc/): fake impls, autograd, wrappers.

The ops (schemas in csrc/embed.cpp):

    scratchformer::embed_sinusoidal(tokens, weight, scale, pos_offset, pos_encoding, padding_idx=None)
        weight[tokens] * scale + PE(pos_offset + j), PE the paper's sin/cos encoding computed on
        the fly. tokens (B, L) int32/int64; weight (V, d_model) float; -> (B, L, d_model) in
        weight's dtype. Differentiable in weight; padding_idx's row gets no gradient.
    scratchformer::embed_sinusoidal_backward(grad, tokens, num_weights, scale, padding_idx)
        grad_weight (V, d) = scale * scatter-add of grad (B, L, d) over tokens, padding_idx = -1
        for none. Deterministic (fixed summation order) on CPU and CUDA.
    scratchformer::add_sinusoidal(x, pos_offset)
        x (..., L, d_model) + PE(pos_offset + j); gradient passes through unchanged.

PE accuracy: angles in double, sin/cos polynomials in float on the reduced argument; max error
vs the float64 table 7.8e-8 on CPU up to position 100k (float32 rounding alone: 3.0e-8), 9.0e-8
at the last position the ops accept, 2^29 - 1 (pos_offset + L <= 2^29, MAX_POSITIONS). On
CUDA the same scheme runs with FMA contraction (to be measured on a GPU; the tests bound it by
2.5e-7). Out-of-range token ids: RuntimeError naming the id and its (b, j) on CPU; on CUDA a
device-side assert (the id is printed) that surfaces at the next synchronisation, as with
F.embedding.

Fake impls make the ops traceable by torch.compile; autograd goes through the backward op, so a
compiled graph keeps it as one node. Imported lazily by `scratchformer.ops` (never by
`import scratchformer`), so a missing build only matters to the `triton` backend.
"""

from __future__ import annotations

import torch

from .op_checks import MAX_POSITIONS

__all__ = ["embed_sinusoidal", "embed_sinusoidal_backward", "add_sinusoidal", "available"]

_LOAD_ERROR: str | None = None
try:
    from scratchformer import _C  # noqa: F401  (loading the library runs TORCH_LIBRARY)
except ImportError as e:  # not built, or built against another torch
    _LOAD_ERROR = f"importing scratchformer._C failed: {e}"
else:
    if not hasattr(torch.ops.scratchformer, "embed_sinusoidal"):
        _LOAD_ERROR = "scratchformer._C is stale: it does not define scratchformer::embed_sinusoidal"


def available() -> bool:
    """True when the compiled ops are loaded."""
    return _LOAD_ERROR is None


def _require() -> None:
    if _LOAD_ERROR is not None:
        raise RuntimeError(
            f"the scratchformer C++/CUDA extension is not available ({_LOAD_ERROR}); build it with "
            "`pip install --no-build-isolation -e .` from the repository root"
        )


# ---------------------------------------------------------------------------------------------
# fake (meta) impls: shapes, dtypes and the checks that need no data (same messages as C++)
# ---------------------------------------------------------------------------------------------


# the floating types the kernels are built for (is_floating_point() also admits the float8 types)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_float(op, name, t):
    torch._check(
        t.dtype in _FLOATS,
        lambda: f"{op}: {name} must be floating point (float32, float16, bfloat16, float64), got {t.dtype}",
    )


def _check_embed(tokens, weight, pos_offset, pos_encoding, padding_idx):
    torch._check(
        tokens.dtype in (torch.int32, torch.int64),
        lambda: f"embed_sinusoidal: tokens must be int64 or int32, got {tokens.dtype}",
    )
    _check_float("embed_sinusoidal", "weight", weight)
    torch._check(
        tokens.dim() == 2,
        lambda: f"embed_sinusoidal: tokens must be 2-D (B, L), got a {tokens.dim()}-D tensor of "
        f"shape {list(tokens.shape)}",
    )
    torch._check(
        weight.dim() == 2,
        lambda: f"embed_sinusoidal: weight must be 2-D (V, d_model), got a {weight.dim()}-D tensor "
        f"of shape {list(weight.shape)}",
    )
    torch._check(
        tokens.device == weight.device,
        lambda: f"embed_sinusoidal: tokens are on {tokens.device} but weight is on {weight.device}; "
        "both must be on the same device",
    )
    torch._check(pos_offset >= 0, lambda: f"embed_sinusoidal: pos_offset must be >= 0, got {pos_offset}")
    _check_positions("embed_sinusoidal", not pos_encoding or pos_offset <= MAX_POSITIONS - tokens.shape[1],
                     pos_offset, tokens.shape[1])
    torch._check(
        not pos_encoding or weight.shape[1] % 2 == 0,
        lambda: "embed_sinusoidal: d_model must be even for the sinusoidal encoding, got "
        f"{weight.shape[1]}",
    )
    if padding_idx is not None:
        torch._check(
            0 <= padding_idx < weight.shape[0],
            lambda: f"embed_sinusoidal: padding_idx must be in [0, {weight.shape[0]}) (the Python "
            f"wrapper maps negative values), got {padding_idx}",
        )


def _check_embed_backward(grad, tokens, num_weights, padding_idx):
    op = "embed_sinusoidal_backward"
    torch._check(
        tokens.dtype in (torch.int32, torch.int64), lambda: f"{op}: tokens must be int64 or int32, got {tokens.dtype}"
    )
    _check_float(op, "grad", grad)
    torch._check(
        grad.dim() == 3 and tokens.dim() == 2 and grad.shape[:2] == tokens.shape,
        lambda: f"{op}: grad must be (B, L, d_model) for tokens (B, L); got grad {list(grad.shape)} and tokens "
        f"{list(tokens.shape)}",
    )
    torch._check(
        grad.device == tokens.device, lambda: f"{op}: grad is on {grad.device} but tokens are on {tokens.device}"
    )
    torch._check(num_weights >= 0, lambda: f"{op}: num_weights must be >= 0, got {num_weights}")
    torch._check(
        padding_idx == -1 or 0 <= padding_idx < num_weights,
        lambda: f"{op}: padding_idx must be -1 (none) or in [0, {num_weights}), got {padding_idx}",
    )


def _check_positions(op, ok, pos_offset, L):
    torch._check(
        ok,
        lambda: f"{op}: positions must be below {MAX_POSITIONS} (2^29, where the float sinusoid stops "
        f"being accurate), got pos_offset {pos_offset} and L {L}",
    )


def _register_fakes() -> None:
    @torch.library.register_fake("scratchformer::embed_sinusoidal")
    def _(tokens, weight, scale, pos_offset, pos_encoding, padding_idx=None):
        _check_embed(tokens, weight, pos_offset, pos_encoding, padding_idx)
        return weight.new_empty((tokens.shape[0], tokens.shape[1], weight.shape[1]))

    @torch.library.register_fake("scratchformer::embed_sinusoidal_backward")
    def _(grad, tokens, num_weights, scale, padding_idx):
        _check_embed_backward(grad, tokens, num_weights, padding_idx)
        return grad.new_empty((num_weights, grad.shape[2]))

    @torch.library.register_fake("scratchformer::add_sinusoidal")
    def _(x, pos_offset):
        _check_float("add_sinusoidal", "x", x)
        torch._check(x.dim() >= 2, lambda: f"add_sinusoidal: x must be (..., L, d_model), got a {x.dim()}-D tensor")
        torch._check(
            x.shape[-1] % 2 == 0,
            lambda: "add_sinusoidal: d_model must be even for the sinusoidal encoding, got "
            f"{x.shape[-1]}",
        )
        torch._check(pos_offset >= 0, lambda: f"add_sinusoidal: pos_offset must be >= 0, got {pos_offset}")
        _check_positions("add_sinusoidal", pos_offset <= MAX_POSITIONS - x.shape[-2], pos_offset, x.shape[-2])
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _register_autograd() -> None:
    # d out / d weight: out[b, j] = weight[tokens[b, j]] * scale + PE, so grad_weight is the scaled
    # scatter-add of grad over tokens (padding_idx's row excluded): the backward op.

    def _embed_setup_context(ctx, inputs, output):
        tokens, weight, scale, _pos_offset, _pos_encoding, padding_idx = inputs
        ctx.num_weights = weight.shape[0]
        ctx.scale = scale
        ctx.padding_idx = -1 if padding_idx is None else padding_idx
        ctx.save_for_backward(tokens if ctx.needs_input_grad[1] else None)

    def _embed_backward(ctx, grad):
        grad_weight = None
        if ctx.needs_input_grad[1]:
            (tokens,) = ctx.saved_tensors
            grad_weight = torch.ops.scratchformer.embed_sinusoidal_backward.default(
                grad, tokens, ctx.num_weights, ctx.scale, ctx.padding_idx
            )
        return None, grad_weight, None, None, None, None

    torch.library.register_autograd(
        "scratchformer::embed_sinusoidal", _embed_backward, setup_context=_embed_setup_context
    )

    # The backward is linear in grad: its own gradient is the forward's gather (no PE) with the
    # padding row zeroed, which gives double backward for free.
    def _bwd_setup_context(ctx, inputs, output):
        _grad, tokens, _num_weights, scale, padding_idx = inputs
        ctx.scale, ctx.padding_idx = scale, padding_idx
        ctx.save_for_backward(tokens if ctx.needs_input_grad[0] else None)

    def _bwd_backward(ctx, grad_grad_weight):
        grad_grad = None
        if ctx.needs_input_grad[0]:
            (tokens,) = ctx.saved_tensors
            ggw = grad_grad_weight
            if ctx.padding_idx >= 0:
                ggw = ggw.index_fill(0, torch.tensor([ctx.padding_idx], device=ggw.device), 0)
            grad_grad = torch.ops.scratchformer.embed_sinusoidal.default(
                tokens, ggw, ctx.scale, 0, False, None
            )
        return grad_grad, None, None, None, None

    torch.library.register_autograd(
        "scratchformer::embed_sinusoidal_backward", _bwd_backward, setup_context=_bwd_setup_context
    )

    def _add_setup_context(ctx, inputs, output):
        pass

    def _add_backward(ctx, grad):
        return grad, None

    torch.library.register_autograd(
        "scratchformer::add_sinusoidal", _add_backward, setup_context=_add_setup_context
    )


if _LOAD_ERROR is None:
    _register_fakes()
    _register_autograd()


# ---------------------------------------------------------------------------------------------
# typed wrappers
# ---------------------------------------------------------------------------------------------


def embed_sinusoidal(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: float,
    pos_offset: int = 0,
    pos_encoding: bool = True,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """weight[tokens] * scale + PE(pos_offset + j) for the token at sequence index j.

    tokens (B, L) int32/int64 on weight's device; weight (V, d_model) float32/float16/bfloat16
    (float64 on CPU), d_model even when pos_encoding. Computed in fp32, one rounding to weight's
    dtype. padding_idx (negative counts from V, as in F.embedding) gets no gradient. Returns
    (B, L, d_model) in weight's dtype. Out-of-range ids: RuntimeError naming the id on CPU,
    device-side assert on CUDA. The wrappers pass their arguments as given: the op's schema refuses
    a float where an int goes, or a string for a bool, naming it (they were cast: 2.9 ran as 2).
    """
    _require()
    if padding_idx is not None and -weight.shape[0] <= padding_idx < 0:  # else the op names it as given
        padding_idx += weight.shape[0]
    return torch.ops.scratchformer.embed_sinusoidal.default(
        tokens, weight, scale, pos_offset, pos_encoding, padding_idx
    )


def embed_sinusoidal_backward(
    grad: torch.Tensor, tokens: torch.Tensor, num_weights: int, *, scale: float, padding_idx: int = -1
) -> torch.Tensor:
    """grad_weight (num_weights, d) = scale * scatter-add of grad (B, L, d) over tokens (B, L);
    row padding_idx (-1: none) stays zero. Deterministic. In grad's dtype."""
    _require()
    return torch.ops.scratchformer.embed_sinusoidal_backward.default(
        grad, tokens, num_weights, scale, padding_idx
    )


def add_sinusoidal(x: torch.Tensor, *, pos_offset: int = 0) -> torch.Tensor:
    """x (..., L, d_model) + PE(pos_offset + j) along dim -2; d_model even. Same dtype as x."""
    _require()
    return torch.ops.scratchformer.add_sinusoidal.default(x, pos_offset)
