"""Fused (dropout +) residual add + LayerNorm (kernels/add_layer_norm.py) against the eager
reference `add_layer_norm_ref` and, independently, `F.layer_norm` after an add.

On CPU every case runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes stay
small; the GPU-only case at the bottom is marked requires_cuda and skipped here.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, report_diff, requires_cuda

from scratchformer import ops
from scratchformer.kernels import add_layer_norm as LN
from scratchformer.kernels.add_layer_norm import add_layer_norm, check_limits
from scratchformer.reference import add_layer_norm_ref

# (dtype, atol, rtol). fp32: both sides compute in fp32; only summation order differs.
# fp16/bf16: both sides round s = x + residual once to the storage dtype and normalise that s
# (docs/numerics.md), so x̂ agrees up to fp32 summation order; y and every gradient are one
# rounding of an fp32 value (<= 1 ulp: 2^-11 / 2^-8 relative) of a quantity that reaches |x̂| ~ 3
# to 4, and dweight adds that up over the rows. Hence a few ulps of headroom. The exact cases
# (forward and backward seeing the same x̂) are in test_layer_norm_numerics.py.
DTYPES = [
    (torch.float32, 1e-4, 1e-4),
    (torch.float16, 1e-2, 1e-2),
    (torch.bfloat16, 8e-2, 4e-2),
]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _inputs(shape, dtype, *, residual=True, bias=True, param_dtype=None):
    N = shape[-1]
    param_dtype = param_dtype or dtype
    x = torch.randn(shape, dtype=dtype, device=DEVICE, requires_grad=True)
    r = torch.randn(shape, dtype=dtype, device=DEVICE, requires_grad=True) if residual else None
    w = (1.0 + 0.5 * torch.randn(N, device=DEVICE)).to(param_dtype).requires_grad_()
    b = (0.5 * torch.randn(N, device=DEVICE)).to(param_dtype).requires_grad_() if bias else None
    return x, r, w, b


def _leaves(*ts):
    return [t for t in ts if t is not None]


def _check_all(fn_ours, fn_ref, inputs, atol, rtol, *, with_s=True):
    """Compare y (and s) and the gradient of every input, a gradient flowing into s as well."""
    out = fn_ours(*inputs)
    ref = fn_ref(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    grads_out = [torch.randn_like(o) for o in out]
    for name, o, r in zip(("y", "s"), out, ref):
        report_diff(name, o, r)
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol)
    leaves = _leaves(*inputs)
    g_ours = torch.autograd.grad(out, leaves, grads_out)
    g_ref = torch.autograd.grad(ref, leaves, grads_out)
    for i, (a, b) in enumerate(zip(g_ours, g_ref)):
        report_diff(f"grad[{i}]", a, b)
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def _check_with_dropout(inputs, p, atol, rtol):
    """`_check_all` of ours against the reference fed our dropout mask (seed 3)."""
    _, _, mask = add_layer_norm(*inputs, dropout_p=p, seed=3, return_residual=True, return_dropout_mask=True)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, dropout_p=p, seed=3, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, dropout_p=p, dropout_mask=mask, return_residual=True),
        inputs, atol, rtol,
    )


# Rows: 1 (a single program), 7 and 33 (not multiples of the backward's rows per program), 100.
# Hidden: 16 (smallest claimed), 48 and 100 (not powers of two: masked tails), 256.
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("N", [16, 48, 100, 256])
@pytest.mark.parametrize("rows", [1, 7, 33, 100])
def test_add_layer_norm_matches_ref(rows, N, dtype, atol, rtol):
    inputs = _inputs((rows, N), dtype)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, 1e-5, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, 1e-5, return_residual=True),
        inputs, atol, rtol,
    )


@pytest.mark.parametrize("return_residual", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("has_residual", [True, False])
def test_add_layer_norm_flags_match_ref_and_torch(has_residual, has_bias, return_residual):
    """Optional residual/bias/s, against the reference and against F.layer_norm after an add."""
    inputs = _inputs((2, 7, 48), torch.float32, residual=has_residual, bias=has_bias)

    def torch_ln(x, r, w, b):
        s = x if r is None else x + r
        y = F.layer_norm(s, (s.shape[-1],), w, b, 1e-5)
        return (y, s) if return_residual else y

    ours = lambda x, r, w, b: add_layer_norm(x, r, w, b, 1e-5, return_residual=return_residual)  # noqa: E731
    ref = lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, 1e-5, return_residual=return_residual)  # noqa: E731
    _check_all(ours, ref, inputs, 1e-5, 1e-5)
    _check_all(ours, torch_ln, inputs, 1e-5, 1e-5)


# A larger hidden size: BLOCK_N 1024 with a ragged tail, and 2048 exactly.
@pytest.mark.parametrize("dtype,atol,rtol", [DTYPES[0], DTYPES[2]], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N", [1000, 2048])
def test_add_layer_norm_large_hidden(N, dtype, atol, rtol):
    inputs = _inputs((5, N), dtype)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, return_residual=True),
        inputs, atol, rtol,
    )


def test_add_layer_norm_fp32_params_with_bf16_activations():
    """Mixed precision: weight/bias kept in fp32 while activations are bf16."""
    inputs = _inputs((7, 100), torch.bfloat16, param_dtype=torch.float32)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b),
        inputs, 8e-2, 4e-2,
    )


def _as_stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 t as a kernel's store to `dtype` rounds it: to nearest even on a GPU, as torch's cast;
    Triton's interpreter truncates fp32 to bf16 (Triton 3.6 and 3.9, an explicit
    fp_downcast_rounding="rtne" too; fp16 it rounds to nearest even)."""
    if DEVICE == "cuda" or dtype != torch.bfloat16:
        return t.to(dtype)
    return (t.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # the low 16 bits dropped


BF16, FP16 = torch.bfloat16, torch.float16


@pytest.mark.parametrize("low,x_low,dropout_p,return_residual,used", [  # used: which of y and its copy the loss reads
    (BF16, False, 0.0, False, "both"), (BF16, True, 0.3, True, "both"), (BF16, True, 0.0, False, "copy"),
    (BF16, False, 0.3, True, "y"), (FP16, True, 0.3, False, "both")])  # (kernel variants: tests/test_compile_budget.py)
def test_a_copy_of_y_in_another_dtype_is_y_stored_in_it(low, x_low, dropout_p, return_residual, used):
    """copy_dtype (the Post-LN model's next sublayer input under autocast): y as without it, bit for
    bit, and its copy the fp32 y stored in that dtype (`_as_stored`); the gradients those of y's
    alone given the sum of both outputs' gradients in fp32 (as autograd adds a cast's gradient to
    y's), also when only one of them is used; and the eager reference's values."""
    x, r, w, b = _inputs((33, 100), torch.float32, param_dtype=torch.float32)
    if x_low:  # the sublayer's output in 16 bits on the fp32 stream, as the model runs it
        x = x.detach().to(low).requires_grad_()
    kw = dict(dropout_p=dropout_p, seed=3, return_residual=return_residual)
    out = add_layer_norm(x, r, w, b, copy_dtype=low, **kw)
    plain = add_layer_norm(x, r, w, b, **kw)
    y, *s, copy = out
    y_plain, *s_plain = plain if return_residual else (plain,)
    assert copy.dtype == low and torch.equal(copy, _as_stored(y_plain, low))
    assert y.dtype == torch.float32 and torch.equal(y, y_plain) and all(map(torch.equal, s, s_plain))
    g_y = torch.randn_like(y) if used != "copy" else None
    g_copy = torch.randn_like(copy) if used != "y" else None
    g_s = [torch.randn_like(t) for t in s]
    ours = torch.autograd.grad([t for t, g in zip(out, [g_y, *g_s, g_copy]) if g is not None], (x, r, w, b),
                               [g for g in (g_y, *g_s, g_copy) if g is not None])
    g_sum = g_copy.float() if g_y is None else g_y if g_copy is None else g_y + g_copy.float()
    want = torch.autograd.grad((y_plain, *s_plain), (x, r, w, b), [g_sum, *g_s])
    for a, c in zip(ours, want):
        assert a.dtype == c.dtype and torch.equal(a, c)
    mask = add_layer_norm(x, r, w, b, dropout_p=dropout_p, seed=3, return_dropout_mask=True)[1]
    ref = add_layer_norm_ref(x, r, w, b, dropout_p=dropout_p, dropout_mask=mask if dropout_p else None,
                             return_residual=return_residual, copy_dtype=low)
    torch.testing.assert_close(ref[-1], copy, atol=2e-2, rtol=2e-2)  # a rounding apart, or the interpreter's
    torch.testing.assert_close(ref[0], y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("low,dropout_p", [(BF16, 0.0), (BF16, 0.3), (FP16, 0.3)])
def test_y_in_another_dtype_is_y_stored_in_it(low, dropout_p):
    """y_dtype (the Pre-LN model's sublayer input under autocast): y the fp32 y stored in that dtype
    (`_as_stored`), s in the stream's as without it, and the gradients those given y's gradient in
    fp32 (as a cast's backward hands it on); and the eager reference's values."""
    x, r, w, b = _inputs((33, 100), torch.float32, param_dtype=torch.float32)
    kw = dict(dropout_p=dropout_p, seed=3, return_residual=True)
    (y, s), (y_plain, s_plain) = add_layer_norm(x, r, w, b, y_dtype=low, **kw), add_layer_norm(x, r, w, b, **kw)
    assert y.dtype == low and torch.equal(y, _as_stored(y_plain, low))
    assert s.dtype == torch.float32 and torch.equal(s, s_plain)
    g_y, g_s = torch.randn_like(y), torch.randn_like(s)
    ours = torch.autograd.grad((y, s), (x, r, w, b), (g_y, g_s))
    want = torch.autograd.grad((y_plain, s_plain), (x, r, w, b), (g_y.float(), g_s))
    for a, c in zip(ours, want):
        assert a.dtype == c.dtype and torch.equal(a, c)
    mask = add_layer_norm(x, r, w, b, dropout_p=dropout_p, seed=3, return_dropout_mask=True)[1]
    ref_y, ref_s = add_layer_norm_ref(x, r, w, b, dropout_p=dropout_p, dropout_mask=mask if dropout_p else None,
                                      return_residual=True, y_dtype=low)
    assert ref_y.dtype == low
    torch.testing.assert_close(ref_y, y, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ref_s, s, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("low,dropout_p,return_residual", [  # each dtype with and without dropout and s's gradient
    (torch.bfloat16, 0.0, True), (torch.bfloat16, 0.3, False), (torch.float16, 0.0, False), (torch.float16, 0.3, True)])
def test_a_16_bit_x_on_an_fp32_stream_is_the_cast_x_bit_for_bit(low, dropout_p, return_residual):
    """x in 16 bits (a sublayer's autocast output) under an fp32 residual, read as it is: y and s in
    fp32 and every gradient as when x is cast to fp32 first (the model's way until 2026-12-05, a cast
    kernel each way), dx rounded once to x's dtype (as the cast's backward rounded it; `_as_stored`
    in the interpreter), bit for bit, with and without dropout (one seed: one mask); and the eager
    reference's numbers, given the same mixed inputs."""
    x, r, w, b = _inputs((33, 100), torch.float32, param_dtype=torch.float32)
    x_low = x.detach().to(low).requires_grad_()
    x_up = x_low.detach().float().requires_grad_()  # the same values, cast first

    def run(x_in):
        out = add_layer_norm(x_in, r, w, b, dropout_p=dropout_p, seed=3, return_residual=return_residual)
        out = out if isinstance(out, tuple) else (out,)
        grads = [torch.linspace(-1, 1, o.numel(), device=DEVICE).view_as(o) for o in out]
        return out, torch.autograd.grad(out, (x_in, r, w, b), grads)

    (out, grads), (want, want_grads) = run(x_low), run(x_up)
    for o, t in zip(out, want):
        assert o.dtype == torch.float32 and torch.equal(o, t)
    dx, *rest = grads
    assert dx.dtype == low and torch.equal(dx, _as_stored(want_grads[0], low))
    for g, t in zip(rest, want_grads[1:]):
        assert g.dtype == torch.float32 and torch.equal(g, t)
    # and the eager reference given the same mixed inputs and our dropout mask: y and s in fp32 to
    # fp32's tolerance, dx to one rounding to x's dtype
    mask = add_layer_norm(x_low, r, w, b, dropout_p=dropout_p, seed=3, return_dropout_mask=True)[1]
    ref = add_layer_norm_ref(x_low, r, w, b, dropout_p=dropout_p, dropout_mask=mask if dropout_p else None,
                             return_residual=return_residual)
    ref = ref if isinstance(ref, tuple) else (ref,)
    ref_grads = torch.autograd.grad(ref, (x_low, r, w, b), [torch.linspace(-1, 1, o.numel(), device=DEVICE).view_as(o)
                                                              for o in ref])
    for o, t in zip(out, ref):
        assert t.dtype == torch.float32
        torch.testing.assert_close(o, t, atol=1e-4, rtol=1e-4)
    assert ref_grads[0].dtype == low
    torch.testing.assert_close(dx, ref_grads[0], atol=2e-2, rtol=2e-2)
    for g, t in zip(rest, ref_grads[1:]):
        torch.testing.assert_close(g, t, atol=1e-4, rtol=1e-4)


def test_add_layer_norm_strided_rows():
    """Rows with a stride (a slice of a wider buffer, 3-D leading dims) go in without a copy;
    a non-contiguous last dim is copied by the launcher; both give the reference's numbers."""
    base = torch.randn(3, 5, 96, device=DEVICE)
    x = base[..., :48].requires_grad_(False)  # row stride 96
    r = torch.randn(5, 3, 48, device=DEVICE).transpose(0, 1)  # leading dims permuted
    w, b = torch.randn(48, device=DEVICE), torch.randn(48, device=DEVICE)
    torch.testing.assert_close(add_layer_norm(x, r, w, b), add_layer_norm_ref(x, r, w, b), atol=1e-5, rtol=1e-5)
    xt = torch.randn(48, 7, device=DEVICE).t()  # last-dim stride 7: copied
    torch.testing.assert_close(add_layer_norm(xt, None, w, b), add_layer_norm_ref(xt, None, w, b), atol=1e-5, rtol=1e-5)


def test_add_layer_norm_grad_of_broadcast_dy():
    """y.sum() hands the backward an expanded dy (stride 0): read correctly."""
    x, r, w, b = _inputs((7, 48), torch.float32)
    g_ours = torch.autograd.grad(add_layer_norm(x, r, w, b).sum(), (x, r, w, b))
    g_ref = torch.autograd.grad(add_layer_norm_ref(x, r, w, b).sum(), (x, r, w, b))
    for a, c in zip(g_ours, g_ref):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_m", [1, 4])
def test_add_layer_norm_rows_per_tile(block_m, monkeypatch):
    """The kernels take BLOCK_M rows at a time (`_block_m`: one on a GPU from 512 columns up, as
    many as the interpreter likes here). Forcing the GPU's one row, and a tile that leaves 33 rows
    ragged, gives the reference's outputs and gradients with dropout on, and the same dropout
    mask: the Philox stream does not depend on the tiling."""
    inputs = _inputs((33, 100), torch.float32)
    _, _, free_mask = add_layer_norm(*inputs, dropout_p=0.3, seed=5, return_residual=True, return_dropout_mask=True)
    monkeypatch.setattr(LN, "_block_m", lambda rows, block_n: block_m)
    _, _, mask = add_layer_norm(*inputs, dropout_p=0.3, seed=5, return_residual=True, return_dropout_mask=True)
    assert torch.equal(mask, free_mask)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, dropout_p=0.3, seed=5, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, dropout_p=0.3, dropout_mask=mask, return_residual=True),
        inputs, 1e-5, 1e-5,
    )


def test_add_layer_norm_weight_grad_deterministic():
    """dweight/dbias use per-program partials and a fixed-order sum: bitwise repeatable."""
    x, r, w, b = _inputs((100, 256), torch.float32)
    g = torch.randn(100, 256, device=DEVICE)
    first = torch.autograd.grad(add_layer_norm(x, r, w, b), (w, b), g)
    second = torch.autograd.grad(add_layer_norm(x, r, w, b), (w, b), g)
    assert all(torch.equal(a, c) for a, c in zip(first, second))


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("has_residual", [True, False])
def test_add_layer_norm_dropout_matches_ref_with_replayed_mask(has_residual):
    """The debug path returns the kernel's keep mask; the reference replays it exactly, and the
    backward (which regenerates the mask from Philox) matches the reference's gradients."""
    inputs = _inputs((33, 100), torch.float32, residual=has_residual)
    p = 0.3
    y, s, mask = add_layer_norm(*inputs, dropout_p=p, seed=123, return_residual=True, return_dropout_mask=True)
    assert mask.dtype == torch.bool and mask.shape == inputs[0].shape
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, dropout_p=p, seed=123, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, dropout_p=p, dropout_mask=mask, return_residual=True),
        inputs, 1e-5, 1e-5,
    )


def test_add_layer_norm_dropout_reproducible():
    x, r, w, b = _inputs((33, 100), torch.float32)
    y1 = add_layer_norm(x, r, w, b, dropout_p=0.5, seed=7)
    y2 = add_layer_norm(x, r, w, b, dropout_p=0.5, seed=7)
    y3 = add_layer_norm(x, r, w, b, dropout_p=0.5, seed=8)
    assert torch.equal(y1, y2) and not torch.equal(y1, y3)
    # No seed: drawn from torch's generator, so manual_seed reproduces the stream.
    torch.manual_seed(42)
    z1 = add_layer_norm(x, r, w, b, dropout_p=0.5)
    z2 = add_layer_norm(x, r, w, b, dropout_p=0.5)
    torch.manual_seed(42)
    z3 = add_layer_norm(x, r, w, b, dropout_p=0.5)
    assert torch.equal(z1, z3) and not torch.equal(z1, z2)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_add_layer_norm_dropout_keep_rate(p):
    """Kept fraction within 4 sigma of 1 - p (binomial), over 100 x 256 = 25600 draws."""
    x = torch.randn(100, 256, device=DEVICE)
    w = torch.ones(256, device=DEVICE)
    _, mask = add_layer_norm(x, None, w, None, dropout_p=p, seed=0, return_dropout_mask=True)
    n = mask.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    kept = mask.float().mean().item()
    print(f"kept {kept:.4f}, expected {1 - p:.4f} +- {4 * sigma:.4f}")
    assert abs(kept - (1 - p)) < 4 * sigma


# ---------------------------------------------------------------------------------------------
# through the backend switch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("return_residual", [True, False])
def test_ops_triton_matches_eager(return_residual):
    x, r, w, b = _inputs((2, 7, 100), torch.float32)
    outs = {
        k: ops.select(k, DEVICE).add_layer_norm(x, r, w, b, 1e-5, return_residual=return_residual)
        for k in ("triton", "eager")
    }
    ours, ref = outs["triton"], outs["eager"]
    ours = ours if isinstance(ours, tuple) else (ours,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for a, c in zip(ours, ref):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    g = [torch.randn_like(o) for o in ours]
    for a, c in zip(torch.autograd.grad(ours, (x, r, w, b), g), torch.autograd.grad(ref, (x, r, w, b), g)):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_every_backend_drops_x_not_the_residual_and_scales_what_it_keeps(kernel):
    """dropout(x) + residual: each element of s - residual is 0 (dropped) or x / (1 - p) (kept, scaled), both
    occur at p = 0.5 over 33 x 100 draws, and y is the LayerNorm of that s (F.layer_norm): an invariant
    that needs no mask, so it holds every backend to the same dropout."""
    x, r, w, b = (t.detach() for t in _inputs((33, 100), torch.float32))
    p = 0.5
    y, s = ops.select(kernel, DEVICE).add_layer_norm(x, r, w, b, 1e-5, dropout_p=p, return_residual=True)
    added = s - r
    kept = torch.isclose(added, x / (1 - p), rtol=1e-5, atol=1e-5)
    dropped = added.abs() <= 1e-6
    assert (kept | dropped).all() and kept.any() and dropped.any()
    torch.testing.assert_close(y, F.layer_norm(s, (100,), w, b, 1e-5), atol=1e-5, rtol=1e-5)


def test_no_rows_give_empty_outputs_and_zero_weight_gradients():
    """x of shape (0, 48): y and s empty, dx empty, and dweight, dbias zeros (a sum over no rows; their
    partial-sum buffers are written by no program)."""
    x, r, w, b = _inputs((0, 48), torch.float32)
    y, s = add_layer_norm(x, r, w, b, return_residual=True)
    assert y.shape == s.shape == (0, 48)
    dx, dw, db = torch.autograd.grad((y, s), (x, w, b), (torch.ones_like(y), torch.ones_like(s)))
    assert dx.shape == (0, 48) and torch.equal(dw, torch.zeros_like(w)) and torch.equal(db, torch.zeros_like(b))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_add_layer_norm_bad_inputs():
    x = torch.randn(4, 48, device=DEVICE)
    w = torch.ones(48, device=DEVICE)
    with pytest.raises(ValueError, match=r"weight must have shape \(48,\)"):
        add_layer_norm(x, None, torch.ones(32, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"residual shape \(4, 32\) != x shape \(4, 48\)"):
        add_layer_norm(x, torch.randn(4, 32, device=DEVICE), w, None)
    with pytest.raises(ValueError, match="dtype mismatch"):
        add_layer_norm(x, x.half(), w, None)
    with pytest.raises(ValueError, match="weight dtype must be torch.float32"):
        add_layer_norm(x, None, w.half(), None)
    with pytest.raises(ValueError, match="weight torch.float32 and bias torch.bfloat16 dtypes differ"):  # each allowed
        add_layer_norm(x.bfloat16(), None, w, torch.zeros(48, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16, got torch.float64"):
        add_layer_norm(x.double(), None, w.double(), None)
    with pytest.raises(ValueError, match="different devices"):
        add_layer_norm(x, None, torch.ones(48, device="meta"), None)
    with pytest.raises(ValueError, match="add_layer_norm: unsupported device meta"):  # one device, but not a kernel's
        add_layer_norm(x.to("meta"), None, w.to("meta"), None)
    big = torch.randn(1, 20000, device=DEVICE)
    with pytest.raises(ValueError, match="hidden size N must be <= 16384.*got 20000"):
        add_layer_norm(big, None, torch.ones(20000, device=DEVICE), None)

    for N in (1, 16384):  # the bound is inclusive: one past it is refused (checked without a launch)
        check_limits(torch.empty(1, N, device=DEVICE), None, torch.empty(N, device=DEVICE), None)
    with pytest.raises(ValueError, match="hidden size N must be <= 16384 .*got 16385"):
        check_limits(torch.empty(1, 16385, device=DEVICE), None, torch.empty(16385, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0"):
        add_layer_norm(x, None, w, None, dropout_p=1.0)
    with pytest.raises(ValueError, match="y_dtype must be None, torch.float32, torch.float16 or torch.bfloat16, got "
                                         "torch.float64"):
        add_layer_norm(x, None, w, None, y_dtype=torch.float64)
    with pytest.raises(ValueError, match="copy_dtype must be None, .* got torch.int8"):
        add_layer_norm(x, None, w, None, copy_dtype=torch.int8)
    for kernel in ("eager", "torch", "triton"):  # the backends' own check: a floating-point dtype
        with pytest.raises(ValueError, match="copy_dtype must be None or a floating-point torch.dtype, got 'bf16'"):
            ops.select(kernel, DEVICE).add_layer_norm(x, None, w, None, copy_dtype="bf16")
    # weight is required (bias is optional): None was skipped by the checks, then weight.contiguous() raised
    # AttributeError 'NoneType' object has no attribute 'contiguous' in the launcher
    with pytest.raises(ValueError, match=r"add_layer_norm: weight must be a tensor, got NoneType"):
        add_layer_norm(x, None, None, None)


# ---------------------------------------------------------------------------------------------
# GPU only (skipped on CPU): sizes too slow for the interpreter
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,N", [(4096, 1024), (1000, 4096), (513, 8192), (64, 16384)])
def test_add_layer_norm_gpu_sizes(rows, N, dtype, atol, rtol):
    inputs = _inputs((rows, N), dtype)
    _check_all(
        lambda x, r, w, b: add_layer_norm(x, r, w, b, return_residual=True),
        lambda x, r, w, b: add_layer_norm_ref(x, r, w, b, return_residual=True),
        inputs, atol, rtol,
    )


@pytest.mark.parametrize("N", [16, 100, 256, 512, 1024, 4096, 16384])
@pytest.mark.parametrize("rows", [3, 65536])
def test_forward_tuning_candidates_hold_the_heuristic_and_fit(N, rows):
    """The GPU's tuned forward (`_prune_fwd`) always offers `_block_m`'s own (rows, warps) first,
    so tuning can only keep it or beat it, then list configs whose tile fits 8k fp32 values with
    at least 4 a thread; each candidate once."""
    bn = LN.next_pow2(N)
    got = [(c.kwargs["BLOCK_M"], c.num_warps) for c in LN._prune_fwd(LN.TILE_CONFIGS, {"M": rows}, BLOCK_N=bn)]
    bm = LN._block_m(rows, bn)
    assert got[0] == (bm, LN._num_warps(bm, bn)) and len(set(got)) == len(got)
    assert all(128 * w <= m * bn <= 1 << 13 for m, w in got[1:])
    if N == 512:  # the missed case of 2026-11-26: tiles of several rows are offered
        assert {(4, 8), (8, 8), (16, 8)} <= set(got)


@pytest.mark.parametrize("N", [16, 512, 1024, 2048, 4096, 8192, 16384])
@pytest.mark.parametrize("rows_per_program", [1, 125])
def test_backward_tuning_candidates_hold_the_heuristic_and_fit(N, rows_per_program, monkeypatch):
    """The tuned backward (`_prune_bwd`): the pinned tile for its rows per program first (`_bwd_tile`,
    at the pinned loop depth, then the others), then the tiles of at most 4k fp32 values (it keeps
    about twice the forward's live tiles; 8k at 16 warps, as many a thread) with at least 4 a
    thread, each at every loop depth: one row at 16 warps from 2,048 to 8,192 columns, where one row
    at 8 warps took all 255 registers at 8,192 (`BWD_WIDE_TILES`). At
    N 512 the pinned tile is the eighth window's pick, 2 rows at 8 warps (the forward's rule, one
    row at 2 warps, left 8 warps an SM in flight: 0.54 of the copy bandwidth), and the tuner offers
    more rows and warps still, and the old pick."""
    monkeypatch.setattr(LN, "INTERPRET", False)  # the GPU's heuristic (the interpreter's packs rows)
    bn = LN.next_pow2(N)
    rows = torch.empty(0, N, dtype=torch.bfloat16)  # dy, s and ds_out: what a pipelined block loads
    nargs = {"rows_per_program": rows_per_program, "dy_ptr": rows, "s_ptr": rows, "ds_out_ptr": rows,
             "dy_copy_ptr": rows}
    got = [(c.kwargs["BLOCK_M"], c.num_warps, c.kwargs["LOOP_STAGES"])
           for c in LN._prune_bwd(LN.BWD_TILE_CONFIGS, nargs, BLOCK_N=bn, HAS_DS=True, HAS_DY_COPY=False)]
    own = LN._bwd_tile(rows_per_program, bn)
    n_own = sum(g[:2] == own for g in got)
    assert got[0] == (*own, LN._loop_stages(own[0], bn, 6)) and len(set(got)) == len(got)
    assert {g[:2] for g in got[:n_own]} == {own}  # the pinned tile at every depth that fits, then the others
    assert all(128 * w <= m * bn <= (1 << 12) * max(1, w // 8) for m, w, _ in got[n_own:])
    # each tile unpipelined and at every depth whose loads in flight (dy, s, ds_out: 6 bytes an
    # element a row block ahead) fit the pipeline's shared-memory budget
    tiles = {(m, w) for m, w, _ in got}
    assert set(got) == {(m, w, st) for m, w in tiles for st in LN.LOOP_STAGE_CHOICES
                        if (st - 1) * m * bn * 6 <= LN.MAX_PIPELINE_BYTES}
    if N == 512 and rows_per_program > 1:
        assert got[0] == (2, 8, 3) and {(1, 2), (4, 8), (8, 8)} <= tiles  # pipelined 3 deep, as tuned
        assert {st for m, w, st in got if (m, w) == (2, 8)} == set(LN.LOOP_STAGE_CHOICES)
    if N >= 1024:  # the forward's rule, as tuned there
        assert own == LN._fwd_tile(rows_per_program, bn)
    if N == 16384:  # a row block ahead would take 96 KiB: nothing pipelined
        assert {st for *_, st in got} == {1}
    assert ((1, 16) in tiles) == (2048 <= N <= 8192)


@pytest.mark.parametrize(("block_m", "N", "loaded_bytes", "depth"), [
    (1, 512, 6, 3), (1, 4096, 6, 3),  # the tuned depth up to 4096 columns: 2 blocks ahead, 48 KiB at 4096
    (1, 4096, 12, 2), (1, 2048, 12, 3),  # fp32 dy, s and ds_out: as deep as 48 KiB allows
    (8, 4096, 6, 1), (1, 8192, 6, 1), (1, 16384, 4, 1),  # nothing ahead fits, or wider than tuned deep
])
def test_pinned_backward_depth_is_the_tuned_one_that_fits(block_m, N, loaded_bytes, depth):
    """The pinned backward's loop depth (`_loop_stages`): 3 row blocks in flight up to N 4096 (the
    eighth window's tuned choice), shallower when the blocks ahead would pass MAX_PIPELINE_BYTES,
    unpipelined beyond 4096 columns (the tuner's choice at 8192)."""
    assert LN._loop_stages(block_m, N, loaded_bytes) == depth
    assert LN._pipeline_bytes(depth, block_m, N, loaded_bytes) <= LN.MAX_PIPELINE_BYTES


@pytest.mark.parametrize("block_m", [1, 2, 4, 16])
def test_backward_rows_split_into_whole_blocks(block_m, monkeypatch):
    """The backward's programs each take cdiv(rows, programs) rows rounded up to whole BLOCK_M
    blocks, in the kernel (as the tuned launch needs): 37 rows over 5 programs at every BLOCK_M,
    some programs left without rows (their dw/db partials must be zeros), fp32 with dropout,
    against the reference."""
    if not LN.INTERPRET:  # each forced block size would be a compile of its own on a GPU
        pytest.skip("the interpreter's check of the split (the GPU runs every real tile in the forced-candidate test)")
    monkeypatch.setattr(LN, "_block_m", lambda rows, block_n: block_m)
    monkeypatch.setattr(LN, "_bwd_programs", lambda M, device: 5)
    _check_with_dropout(_inputs((37, 48), torch.float32), 0.2, *DTYPES[0][1:])


@pytest.mark.parametrize("N", [16, 48, 512])
def test_gpu_pinned_tiles_match_ref(N, monkeypatch):
    """The tiles a GPU pins (SCRATCHFORMER_AUTOTUNE=0: the recipes' training), run here: the
    forward's one row from 512 columns and the backward's 8 warps over 1,024 values up to 512
    columns (16 rows of 16 columns a program's iteration, 2 rows of 512), 37 rows over 4 programs,
    fp32 with dropout, against the reference."""
    monkeypatch.setattr(LN, "AUTOTUNE", False)
    monkeypatch.setattr(LN, "INTERPRET", False)  # the GPU's tile choices; the kernels stay interpreted
    assert LN._bwd_tile(10, LN.next_pow2(N))[1] == LN.BWD_NARROW_WARPS
    _check_with_dropout(_inputs((37, N), torch.float32), 0.2, *DTYPES[0][1:])


@requires_cuda
@pytest.mark.parametrize("config", range(9))
def test_every_tuning_candidate_matches_ref(config, monkeypatch):
    """Each candidate tile of the tuned kernels (forced, forward and backward), bf16 with dropout:
    the reference's outputs and gradients under the same mask."""
    c = LN.TILE_CONFIGS[config]
    monkeypatch.setattr(LN, "_block_m", lambda rows, block_n: c.kwargs["BLOCK_M"])
    monkeypatch.setattr(LN, "_num_warps", lambda block_m, block_n: c.num_warps)
    monkeypatch.setattr(LN, "_bwd_tile", lambda rows, block_n: (c.kwargs["BLOCK_M"], c.num_warps))
    monkeypatch.setattr(LN, "AUTOTUNE", False)
    _check_with_dropout(_inputs((1000, 512), torch.bfloat16), 0.2, *DTYPES[2][1:])


@requires_cuda
def test_wide_backward_tile_matches_ref(monkeypatch):
    """The backward's 16-warp tile (`BWD_WIDE_TILES`), forced, at 8,192 columns, where the tuner
    offers it: bf16 with dropout, the reference's outputs and gradients under the same mask."""
    c = LN.BWD_WIDE_TILES[0]
    monkeypatch.setattr(LN, "_bwd_tile", lambda rows, block_n: (c.kwargs["BLOCK_M"], c.num_warps))
    monkeypatch.setattr(LN, "AUTOTUNE", False)
    _check_with_dropout(_inputs((300, 8192), torch.bfloat16), 0.2, *DTYPES[2][1:])


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("block_m", [1, 4])
def test_pipelined_backward_matches_ref(block_m, stages, monkeypatch):
    """The backward with its row loop pipelined (`LOOP_STAGES` 2 and 3, the tuner's other
    candidates), forced, over 8 programs: more row blocks a program than stages, a last block cut
    short (1,001 rows of 512 on a GPU; 67 of 48 in the interpreter, where two programs get no rows);
    bf16 with dropout, against the reference. In the interpreter, which runs the loop unpipelined,
    it checks the launch's plumbing; on a GPU, the compiled pipeline."""
    monkeypatch.setattr(LN, "AUTOTUNE", False)
    monkeypatch.setattr(LN, "_loop_stages", lambda block_m, block_n, loaded_bytes: stages)
    monkeypatch.setattr(LN, "_block_m", lambda rows, block_n: block_m)
    monkeypatch.setattr(LN, "_bwd_tile", lambda rows, block_n: (block_m, LN._num_warps(block_m, block_n)))
    monkeypatch.setattr(LN, "_bwd_programs", lambda M, device: 8)
    shape = (1001, 512) if torch.cuda.is_available() else (67, 48)
    _check_with_dropout(_inputs(shape, torch.bfloat16), 0.2, *DTYPES[2][1:])


@requires_cuda
@pytest.mark.parametrize("N", [512, 1024])
def test_tuned_kernels_match_ref(N, monkeypatch):
    """The autotuned launches of the forward and the backward (tuning on the first call, the chosen
    tile launched directly after: `launch_tuned`), twice, with and without dropout."""
    monkeypatch.setattr(LN, "AUTOTUNE", True)
    for p in (0.0, 0.2, 0.2):
        _check_with_dropout(_inputs((777, N), torch.bfloat16), p, *DTYPES[2][1:])
