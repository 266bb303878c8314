"""scratchformer::embed_sinusoidal (csrc/embed.cpp, csrc/cuda/): weight[tokens] * scale + PE.

Checked against the spec (`reference.embed_ref`, `reference.sinusoidal_positions`, built in
float64) and against independent formulations (F.embedding for gradients, float64 exact sums).
CUDA cases are marked `requires_cuda` and skip on the CPU-only CI machine.
"""

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, report_diff, requires_cuda

from scratchformer import _ext, ops
from scratchformer.reference import embed_ref, sinusoidal_positions

OP = torch.ops.scratchformer

# Max |PE - float64 PE|. Measured on CPU: 7.8e-8 for every d_model tried (2..1024) up to position
# 100k, the float32 rounding of the float64 table alone being 3.0e-8; a float32 angle would give
# ~4e-3 there. CUDA contracts the polynomials into FMAs (about one more float ulp): its bound is
# looser until measured on a GPU. Forward tolerances use the looser one.
PE_MAX_ERR_CPU = 1e-7
PE_MAX_ERR = 2.5e-7

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_extension_is_built():
    # Loud, not skipped: every CPU machine can build the extension (pip install -e .).
    assert _ext.available(), _ext._LOAD_ERROR


def _weight(V, d, dtype, device="cpu", requires_grad=False):
    # Transformer init: std d^-1/2, so weight * sqrt(d) is O(1), like PE.
    w = (torch.randn(V, d, device=device) / math.sqrt(d)).to(dtype)
    return w.requires_grad_(requires_grad)


def _exact(tokens, weight, scale, pos_offset, pos_encoding=True):
    """weight[tokens] * scale + PE in float64 from the dtype-rounded weight: the true value."""
    x = weight.detach().double()[tokens.long()] * scale
    if pos_encoding:
        pos = torch.arange(pos_offset, pos_offset + tokens.shape[1], device=tokens.device)
        x = x + sinusoidal_positions(pos, weight.shape[1], torch.float64)
    return x


def sample_inputs(device, *, requires_grad=False):
    """(tokens, weight, scale, pos_offset, pos_encoding, padding_idx) for opcheck and friends."""

    def w(V, d, dtype=torch.float32):
        return _weight(V, d, dtype, device, requires_grad)

    def t(B, L, V, dtype=torch.int64):
        return torch.randint(0, V, (B, L), device=device, dtype=dtype)

    return [
        [t(1, 1, 5), w(5, 2), 1.0, 0, True, None],  # one token, d_model 2: a single sin/cos pair
        [t(2, 7, 33, torch.int32), w(33, 64), 8.0, 7, True, None],  # int32 ids, offset
        [t(3, 13, 50), w(50, 30), 5.5, 99_990, True, 3],  # far position, padding row
        [t(2, 5, 11), w(11, 7), 2.0, 0, False, None],  # odd d_model is fine without PE
    ]


# ---------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------

# Tolerance vs embed_ref, as multiples of the dtype's eps: the reference rounds twice (the
# product weight * scale, then the sum with PE) where we round once, so the two differ by up to
# ~1.5 ulp of the output (rtol 2 eps) and, where the sum cancels, by an ulp of the largest
# addend (atol 2 eps * max|addend|). fp32 adds the PE error.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("pos_offset", [0, 7, 99_990])  # start, a decoding step, near 100k
@pytest.mark.parametrize(
    "B, L, V, d",
    [
        (1, 1, 3, 2),  # one token
        (2, 7, 33, 64),  # ragged
        (3, 97, 100, 512),  # a typical d_model, prime length
        (5, 33, 1000, 130),  # d_model not a multiple of 4 or 16 (column blocks of the backward)
    ],
)
def test_embed_matches_ref(B, L, V, d, pos_offset, index_dtype, dtype):
    tokens = torch.randint(0, V, (B, L), dtype=index_dtype)
    weight = _weight(V, d, dtype)
    scale = math.sqrt(d)
    out = _ext.embed_sinusoidal(tokens, weight, scale=scale, pos_offset=pos_offset)
    ref = embed_ref(tokens, weight, scale=scale, pos_offset=pos_offset)
    exact = _exact(tokens, weight, scale, pos_offset)
    assert out.shape == (B, L, d) and out.dtype == dtype
    eps = torch.finfo(dtype).eps
    addend = max(1.0, (weight.double() * scale).abs().max().item())

    err_ours = report_diff(f"ours vs exact ({dtype})", out, exact)
    err_ref = report_diff(f"ref  vs exact ({dtype})", ref, exact)
    # One rounding of a float32 value: within half an ulp of the exact result (+ PE and fp32 error).
    bound = 0.5 * eps * exact.abs() + PE_MAX_ERR + 2**-23 * addend
    assert ((out.double() - exact).abs() <= bound).all()
    assert err_ours <= err_ref + PE_MAX_ERR  # never worse than the eager path
    torch.testing.assert_close(out, ref, rtol=2 * eps, atol=2 * eps * addend + PE_MAX_ERR)


@pytest.mark.parametrize("d", [64, 512, 1024])
def test_pe_accuracy_long_positions(d):
    # PE alone (add_sinusoidal on zeros) vs the float64 table at positions up to 100k: where a
    # float32 angle p * w_i would be off by up to p * 2^-24 ~ 6e-3 rad.
    if d == 64:  # every position 0..100_000
        pos_offset, L = 0, 100_001
    else:  # the far end, where the angles are largest
        pos_offset, L = 99_000, 1_001
    pe = _ext.add_sinusoidal(torch.zeros(1, L, d), pos_offset=pos_offset)[0]
    pe64 = sinusoidal_positions(torch.arange(pos_offset, pos_offset + L), d, torch.float64)
    err = report_diff(f"PE d={d} positions {pos_offset}..{pos_offset + L - 1}", pe, pe64)
    assert err <= PE_MAX_ERR_CPU


def test_positions_past_2_29_are_refused():
    """Positions (pos_offset + j) stay below 2^29 (csrc/sinusoid.h kMaxPositions), where the float
    sinusoid is within 1e-7 of the float64 table: past it the error grows (1.2e-7 at 2^30, 6e-5 at
    1e12), and from about 1e16 the values left [-1, 1] without a word (|PE| 5e5 at 1e17; at 2^63 - 2
    pos_offset + j overflowed int64). The last accepted positions are accurate; one more is refused
    by the op, by its fake (meta tensors) and by add_sinusoidal; without positions any offset goes."""
    top = 2**29
    tokens, weight = torch.randint(0, 10, (2, 64)), _weight(10, 64, torch.float32)
    pe = _ext.add_sinusoidal(torch.zeros(1, 64, 64), pos_offset=top - 64)[0]
    pe64 = sinusoidal_positions(torch.arange(top - 64, top), 64, torch.float64)
    assert report_diff("PE at the last positions", pe, pe64) <= PE_MAX_ERR_CPU
    out = _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=top - 64)
    exact = _exact(tokens, weight, 1.0, top - 64)
    assert ((out.double() - exact).abs() <= 2**-24 * exact.abs() + PE_MAX_ERR_CPU).all()
    for pos_offset in (top - 63, 10**17, 2**63 - 2):
        msg = rf"positions must be below 536870912 \(2\^29, .*\), got pos_offset {pos_offset} and L 64"
        for device in ("cpu", "meta"):
            with pytest.raises(RuntimeError, match="embed_sinusoidal: " + msg):
                _ext.embed_sinusoidal(tokens.to(device), weight.to(device), scale=1.0, pos_offset=pos_offset)
            with pytest.raises(RuntimeError, match="add_sinusoidal: " + msg):
                _ext.add_sinusoidal(torch.zeros(2, 64, 8, device=device), pos_offset=pos_offset)
    plain = _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=10**17, pos_encoding=False)
    assert torch.equal(plain, weight[tokens])


def test_fakes_accept_the_last_positions_and_any_offset_without_positions():
    """The fakes (meta tensors, as torch.compile traces) accept what the ops accept: positions up to
    2^29 - 1 exactly (pos_offset + L = 2^29), for embed_sinusoidal and add_sinusoidal, and any
    pos_offset when pos_encoding is off (no positions are computed), with the op's shapes."""
    top = 2**29
    tokens, weight = torch.zeros(2, 64, dtype=torch.long, device="meta"), torch.zeros(10, 8, device="meta")
    assert _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=top - 64).shape == (2, 64, 8)
    assert _ext.add_sinusoidal(torch.zeros(3, 64, 8, device="meta"), pos_offset=top - 64).shape == (3, 64, 8)
    plain = _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=10**17, pos_encoding=False)
    assert plain.shape == (2, 64, 8) and plain.device.type == "meta"


def test_pos_encoding_off_and_offsets_compose():
    tokens = torch.randint(0, 20, (2, 9))
    weight = _weight(20, 16, torch.float32)
    plain = _ext.embed_sinusoidal(tokens, weight, scale=3.0, pos_encoding=False)
    torch.testing.assert_close(plain, weight[tokens] * 3.0, rtol=0, atol=0)
    # Incremental decoding: embedding the tail with pos_offset = its start equals the full pass.
    full = _ext.embed_sinusoidal(tokens, weight, scale=3.0)
    tail = _ext.embed_sinusoidal(tokens[:, 5:], weight, scale=3.0, pos_offset=5)
    torch.testing.assert_close(tail, full[:, 5:], rtol=0, atol=0)


def test_strided_inputs_and_empty():
    weight_big = _weight(40, 48, torch.float32)
    weight = weight_big[::2, :32]  # row stride 96, columns contiguous: used in place
    tokens = torch.randint(0, 20, (6, 4)).t()  # non-contiguous tokens
    out = _ext.embed_sinusoidal(tokens, weight, scale=2.0, pos_offset=3)
    torch.testing.assert_close(out, embed_ref(tokens, weight, scale=2.0, pos_offset=3))
    weight_t = _weight(32, 20, torch.float32).t()  # column stride != 1: copied
    torch.testing.assert_close(
        _ext.embed_sinusoidal(tokens, weight_t, scale=2.0),
        embed_ref(tokens, weight_t, scale=2.0),
    )
    assert _ext.embed_sinusoidal(tokens[:0], weight, scale=2.0).shape == (0, 6, 32)
    assert _ext.embed_sinusoidal(tokens[:, :0], weight, scale=2.0).shape == (4, 0, 32)
    bad = torch.tensor([[1, 20, 2]])  # no columns: the ids are still checked (the CUDA op checks them so too)
    with pytest.raises(RuntimeError, match=r"embed_sinusoidal: token id 20 at tokens\[0, 1\] is out of range"):
        OP.embed_sinusoidal(bad, weight[:, :0], 2.0, 0, True, None)
    with pytest.raises(RuntimeError, match=r"embed_sinusoidal_backward: token id 20 at tokens\[0, 1\] is out of"):
        OP.embed_sinusoidal_backward(torch.zeros(1, 3, 0), bad, 20, 2.0, -1)


def test_weight_grad_of_an_empty_batch_is_zero():
    """No tokens, no gradient: an empty batch (B or L zero) gives grad_weight all zeros of weight's
    shape, and so does an empty vocabulary (V = 0, num_weights 0: a (0, d) gradient), as F.embedding."""
    for B, L in ((0, 5), (3, 0)):
        gw = OP.embed_sinusoidal_backward(torch.zeros(B, L, 8), torch.zeros(B, L, dtype=torch.long), 10, 2.0, -1)
        assert gw.shape == (10, 8) and torch.count_nonzero(gw) == 0
    weight = torch.zeros(0, 8, requires_grad=True)
    out = _ext.embed_sinusoidal(torch.zeros(2, 0, dtype=torch.long), weight, scale=2.0)
    (gw,) = torch.autograd.grad(out, weight, torch.zeros(2, 0, 8))
    assert gw.shape == (0, 8)


@pytest.mark.parametrize("shape", [(7, 16), (2, 7, 16), (2, 3, 5, 8)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])  # transposed: x (..., L, d) with d the outer axis
def test_add_sinusoidal(shape, layout):
    x = torch.randn(shape)
    if layout == "transposed":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, column-major last two axes
    x.requires_grad_()
    out = _ext.add_sinusoidal(x, pos_offset=11)
    L, d = shape[-2], shape[-1]
    pe = sinusoidal_positions(torch.arange(11, 11 + L), d, torch.float32)
    torch.testing.assert_close(out, x + pe)
    g = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, g)
    assert torch.equal(gx, g)


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("B, L, V, d", [(1, 1, 3, 2), (4, 33, 10, 64), (3, 97, 500, 130)])
def test_weight_grad_matches_ref(B, L, V, d, index_dtype, dtype):
    tokens = torch.randint(0, V, (B, L), dtype=index_dtype)  # V = 10: many repeats per row
    weight = _weight(V, d, dtype, requires_grad=True)
    scale = math.sqrt(d)
    out = _ext.embed_sinusoidal(tokens, weight, scale=scale, pos_offset=7)
    g = torch.randn_like(out)
    (gw,) = torch.autograd.grad(out, weight, g)
    (gw_ref,) = torch.autograd.grad(embed_ref(tokens, weight, scale=scale, pos_offset=7), weight, g)
    # Exact: scale * sum of the (dtype-rounded) grads, in float64.
    idx = tokens.reshape(-1).long()
    g64 = g.double().reshape(-1, d)
    exact = torch.zeros(V, d, dtype=torch.float64).index_add_(0, idx, g64) * scale
    abs_sum = torch.zeros(V, d, dtype=torch.float64).index_add_(0, idx, g64.abs()) * scale
    count = torch.bincount(idx, minlength=V).double()
    err_ours = report_diff(f"grad ours vs exact ({dtype})", gw, exact)
    err_ref = report_diff(f"grad ref  vs exact ({dtype})", gw_ref, exact)
    # fp32 accumulation (k terms: k * 2^-24 * sum|g|), then one rounding to dtype.
    eps = torch.finfo(dtype).eps
    bound = 0.5 * eps * exact.abs() + (count[:, None] + 1) * 2**-24 * abs_sum + 1e-30
    assert ((gw.double() - exact).abs() <= bound).all()
    assert err_ours <= err_ref + 1e-6  # never worse than the eager path


@pytest.mark.parametrize("padding_idx", [-2, -12])  # -V: the first row, the last negative F.embedding takes
def test_weight_grad_matches_f_embedding_padding_idx(padding_idx):
    # Independent formulation: F.embedding's own padding_idx handling; negative index as in F.
    V, d, scale = 12, 24, 4.0
    row = padding_idx + V
    tokens = torch.randint(0, V, (4, 50))
    tokens[:, ::3] = row  # plenty of padding
    weight = _weight(V, d, torch.float32, requires_grad=True)
    out = _ext.embed_sinusoidal(tokens, weight, scale=scale, padding_idx=padding_idx)
    g = torch.randn_like(out)
    (gw,) = torch.autograd.grad(out, weight, g)
    (gw_f,) = torch.autograd.grad(F.embedding(tokens, weight, padding_idx=padding_idx) * scale, weight, g)
    report_diff("grad vs F.embedding(padding_idx)", gw, gw_f)
    assert torch.count_nonzero(gw[row]) == 0
    torch.testing.assert_close(gw, gw_f)


def test_weight_grad_of_strided_tokens_and_grads():
    """The backward reads tokens and grad by their strides: transposed tokens (saved from the forward
    as given), a grad that is a transposed view, and the expanded grad of out.sum() (stride 0: every
    element the same 1), whose gradient is scale times the number of times each id occurs (worked by
    hand: weight[v] appears count(v) times in the sum, each time times scale)."""
    V, d, scale = 9, 16, 3.0
    tokens = torch.randint(0, V, (12, 4)).t()  # (4, 12), not contiguous
    weight = _weight(V, d, torch.float32, requires_grad=True)
    out = _ext.embed_sinusoidal(tokens, weight, scale=scale, pos_offset=2)
    g = torch.randn(12, 4, d).transpose(0, 1)  # (4, 12, d), not contiguous
    (gw,) = torch.autograd.grad(out, weight, g, retain_graph=True)
    (gw_f,) = torch.autograd.grad(F.embedding(tokens, weight) * scale, weight, g)
    torch.testing.assert_close(gw, gw_f)
    (gw_sum,) = torch.autograd.grad(out.sum(), weight)
    count = torch.bincount(tokens.reshape(-1), minlength=V).float()
    torch.testing.assert_close(gw_sum, (scale * count)[:, None].expand(V, d), rtol=0, atol=0)


def test_weight_grad_deterministic():
    # 64k tokens over 5 ids: thousands of fp32 adds per element, where any change of order
    # shows. Two runs, and 1 thread vs all threads, must be bit-identical.
    tokens = torch.randint(0, 5, (64, 1024))
    grad = torch.randn(64, 1024, 96)
    runs = [OP.embed_sinusoidal_backward(grad, tokens, 5, 3.0, -1) for _ in range(2)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        runs.append(OP.embed_sinusoidal_backward(grad, tokens, 5, 3.0, -1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


def test_gradcheck_float64():
    # float64 weights run the same kernels (opmath double); gradcheck and gradgradcheck (the
    # backward op's own autograd) on a small case with repeats. No padding_idx: its row's
    # gradient is zeroed on purpose, which a finite difference would (rightly) disagree with.
    tokens = torch.tensor([[0, 2, 2, 1], [3, 0, 2, 2]])
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    fn = lambda w: _ext.embed_sinusoidal(tokens, w, scale=1.7, pos_offset=5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (weight,))
    assert torch.autograd.gradgradcheck(fn, (weight,))


@pytest.mark.parametrize("padding_idx", [0, 2])
def test_double_backward_leaves_out_the_padding_row(padding_idx):
    """The gradient of grad_weight with respect to the output's gradient (the backward op's own
    autograd, `_ext._bwd_backward`): grad_weight ignores the padding row's grads, so their gradient
    is zero. gradgradcheck differentiates the first backward numerically (it never compares the first
    derivative, whose padding row is zeroed on purpose); padding_idx 0 is the first row, a valid index."""
    tokens = torch.tensor([[0, 2, 2, 1], [3, 0, 2, 2]])
    weight = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)

    def embed(w):
        return _ext.embed_sinusoidal(tokens, w, scale=1.7, pos_offset=5, padding_idx=padding_idx)

    assert torch.autograd.gradgradcheck(embed, (weight,))


# ---------------------------------------------------------------------------------------------
# registration: opcheck, torch.compile, the backend switch
# ---------------------------------------------------------------------------------------------


def _opcheck_all(device):
    samples = sample_inputs(device, requires_grad=True) + sample_inputs(device)
    for args in samples:
        torch.library.opcheck(OP.embed_sinusoidal.default, args)
    tokens, weight = samples[2][0], samples[2][1]
    grad = torch.randn(*tokens.shape, weight.shape[1], device=device, requires_grad=True)
    torch.library.opcheck(
        OP.embed_sinusoidal_backward.default, (grad, tokens, weight.shape[0], 5.5, 3)
    )
    x = torch.randn(2, 5, 8, device=device, requires_grad=True)
    torch.library.opcheck(OP.add_sinusoidal.default, (x, 4))
    # a transposed x: the op (and so its fake) returns a contiguous tensor
    xt = torch.randn(2, 8, 5, device=device).transpose(1, 2).requires_grad_()
    torch.library.opcheck(OP.add_sinusoidal.default, (xt, 4))


def test_opcheck_cpu():
    _opcheck_all("cpu")


def test_torch_compile_fullgraph():
    # One small case (compiling costs seconds on 2 cores): forward and backward in one graph.
    tokens = torch.randint(0, 30, (2, 9))
    weight = _weight(30, 16, torch.float32, requires_grad=True)

    def fn(tokens, weight):
        return _ext.embed_sinusoidal(tokens, weight, scale=4.0, pos_offset=3, padding_idx=0) * 2.0

    compiled = torch.compile(fn, fullgraph=True)
    out = compiled(tokens, weight)
    g = torch.randn_like(out)
    (gw,) = torch.autograd.grad(out, weight, g)
    out_e = fn(tokens, weight)
    (gw_e,) = torch.autograd.grad(out_e, weight, g)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(gw, gw_e)


def test_torch_backend_embed_compiles_once_over_lengths():
    """The torch backend's embedding compiled with its length dynamic: one graph for three lengths at
    offset 0 (and at most one more for offset 6), the reference's values. Its table's size from the
    length's bit_length() once specialised every graph on its length."""
    weight = _weight(30, 16, torch.float32, device=DEVICE)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(ops.select("torch", DEVICE).embed, backend="aot_eager", fullgraph=True)
    for L, pos_offset in ((5, 0), (9, 0), (3, 0), (4, 6)):
        tokens = torch.randint(0, 30, (2, L), device=DEVICE)
        torch._dynamo.maybe_mark_dynamic(tokens, 1)
        kw = dict(scale=4.0, pos_offset=pos_offset)
        torch.testing.assert_close(compiled(tokens, weight, **kw), embed_ref(tokens, weight, **kw))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2  # the lengths share one (and the offset 6)


@pytest.mark.parametrize("pos_offset", [0, 7])
def test_ops_embed_triton_equals_eager(pos_offset):
    tokens = torch.randint(0, 50, (3, 21), device=DEVICE)
    weight = _weight(50, 32, torch.float32, device=DEVICE)
    kw = dict(scale=math.sqrt(32), pos_offset=pos_offset, pos_encoding=True)
    ours = ops.select("triton", DEVICE).embed(tokens, weight, **kw)
    eager = ops.select("eager", DEVICE).embed(tokens, weight, **kw)
    report_diff("ops.embed triton vs eager", ours, eager)
    torch.testing.assert_close(ours, eager, rtol=1.3e-6, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bad input: one clear error each
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda t, w: (t.float(), w), "tokens must be int64 or int32, got (Float|torch.float32)"),
        (lambda t, w: (t, w.long()), "weight must be floating point .* got (Long|torch.int64)"),
        (lambda t, w: (t[0], w), r"tokens must be 2-D \(B, L\), got a 1-D tensor"),
        (lambda t, w: (t, w[None]), r"weight must be 2-D \(V, d_model\), got a 3-D tensor"),
        (lambda t, w: (t, w[:, :7]), "d_model must be even for the sinusoidal encoding, got 7"),
        (lambda t, w: (torch.zeros_like(t, device="cpu" if t.is_meta else "meta"), w),
         "tokens are on (meta|cpu) but weight is on"),
    ],
    ids=["float-tokens", "int-weight", "1d-tokens", "3d-weight", "odd-d", "device-mismatch"],
)
@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: the fake (_ext.py) refuses them too, for torch.compile
def test_bad_input(make, match, device):
    tokens, weight = make(torch.randint(0, 10, (2, 5), device=device), _weight(10, 8, torch.float32, device))
    with pytest.raises(RuntimeError, match=match):
        OP.embed_sinusoidal(tokens, weight, 1.0, 0, True, None)


@pytest.mark.parametrize("bad_id", [10, 12345, -1])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_bad_token_id_names_it(bad_id, index_dtype):
    tokens = torch.randint(0, 10, (2, 5), dtype=index_dtype)
    tokens[1, 3] = bad_id
    weight = _weight(10, 8, torch.float32)
    msg = rf"token id {bad_id} at tokens\[1, 3\] is out of range for weight with 10 rows"
    with pytest.raises(RuntimeError, match=msg):
        _ext.embed_sinusoidal(tokens, weight, scale=1.0)
    with pytest.raises(RuntimeError, match=rf"token id {bad_id} at tokens\[1, 3\] is out of range"):
        OP.embed_sinusoidal_backward(torch.randn(2, 5, 8), tokens, 10, 1.0, -1)


def test_bad_scalars():
    tokens, weight = torch.randint(0, 10, (2, 5)), _weight(10, 8, torch.float32)
    with pytest.raises(RuntimeError, match="pos_offset must be >= 0, got -1"):
        _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=-1)
    with pytest.raises(RuntimeError, match=r"padding_idx must be in \[0, 10\) .* got 10"):
        _ext.embed_sinusoidal(tokens, weight, scale=1.0, padding_idx=10)
    # below -V: named as given (the wrapper's mapping turned -11 into -1 and the message said "got -1")
    with pytest.raises(RuntimeError, match=r"padding_idx must be in \[0, 10\) .* got -11$"):
        _ext.embed_sinusoidal(tokens, weight, scale=1.0, padding_idx=-11)
    with pytest.raises(RuntimeError, match=r"grad must be \(B, L, d_model\) for tokens \(B, L\)"):
        OP.embed_sinusoidal_backward(torch.randn(2, 4, 8), tokens, 10, 1.0, -1)
    with pytest.raises(RuntimeError, match=r"padding_idx must be -1 \(none\) or in \[0, 10\), got 11"):
        OP.embed_sinusoidal_backward(torch.randn(2, 5, 8), tokens, 10, 1.0, 11)
    with pytest.raises(RuntimeError, match="add_sinusoidal: d_model must be even"):
        _ext.add_sinusoidal(torch.randn(2, 3, 5))
    # the wrappers cast their arguments (2.9 ran as position 2, "no" added the positions): now the schema names them
    for call, name in ((lambda: _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_offset=2.9), "pos_offset"),
                       (lambda: _ext.embed_sinusoidal(tokens, weight, scale=1.0, pos_encoding="no"), "pos_encoding"),
                       (lambda: _ext.add_sinusoidal(torch.zeros(1, 3, 8), pos_offset=2.9), "pos_offset"),
                       (lambda: _ext.embed_sinusoidal_backward(torch.randn(2, 5, 8), tokens, 10.7, scale=1.0),
                        "num_weights")):
        with pytest.raises(RuntimeError, match=f"Expected a value of type .* for argument '{name}'"):
            call()


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta runs the fake impls (_ext.py), as torch.compile does
def test_fakes_refuse_what_the_ops_refuse(device):
    """Each op's fake refuses with the message of its C++ check: the backward's fake checked only the
    shapes (grad on meta with tokens on the CPU, float tokens, an int grad, num_weights -1 or a
    padding_idx past it came back as a tensor), add_sinusoidal's took an int x; and a float8 weight
    or grad, which is_floating_point() admits, is named (the CPU dispatch said 'not implemented').
    The fakes spell a dtype as Python does (torch.int64 where C++ says Long). The edges too: a
    padding_idx of V (and -2 for the backward, whose only negative is -1), a pos_offset of -1, a grad
    whose B is not the tokens', a 1-D x."""
    tokens, grad = torch.randint(0, 10, (2, 5), device=device), torch.randn(2, 5, 8, device=device)
    elsewhere = torch.zeros(2, 5, dtype=torch.long, device="cpu" if device == "meta" else "meta")
    bwd, e5m2 = OP.embed_sinusoidal_backward, torch.float8_e5m2
    cases = [
        (lambda: bwd(grad, tokens.float(), 10, 1.0, -1), "tokens must be int64 or int32, got (Float|torch.float32)"),
        (lambda: bwd(grad.long(), tokens, 10, 1.0, -1), r"grad must be floating point \(.*\), got (Long|torch.int64)"),
        (lambda: bwd(grad.to(e5m2), tokens, 10, 1.0, -1), "grad must be .* got (Float8_e5m2|torch.float8_e5m2)"),
        (lambda: bwd(grad, elsewhere, 10, 1.0, -1), f"grad is on {device} but tokens are on {elsewhere.device}"),
        (lambda: bwd(grad, tokens, -1, 1.0, -1), "num_weights must be >= 0, got -1"),
        (lambda: bwd(grad, tokens, 10, 1.0, 10), r"padding_idx must be -1 \(none\) or in \[0, 10\), got 10"),
        (lambda: bwd(grad, tokens, 10, 1.0, -2), r"padding_idx must be -1 \(none\) or in \[0, 10\), got -2"),
        (lambda: OP.add_sinusoidal(grad.long(), 0), r"x must be floating point \(.*\), got (Long|torch.int64)"),
        (lambda: OP.embed_sinusoidal(tokens, grad.view(10, 8).to(torch.float8_e4m3fn), 1.0, 0, True, None),
         "weight must be floating point .* got (Float8_e4m3fn|torch.float8_e4m3fn)"),
        # the range checks' edges: one past the last row, one before the first position; a grad for
        # another number of sequences; an x with no position axis
        (lambda: OP.embed_sinusoidal(tokens, grad.view(10, 8), 1.0, 0, True, 10), r"padding_idx must be in \[0, 10\)"),
        (lambda: OP.embed_sinusoidal(tokens, grad.view(10, 8), 1.0, -1, True, None), "pos_offset must be >= 0, got -1"),
        (lambda: bwd(grad[:1], tokens, 10, 1.0, -1), r"grad must be \(B, L, d_model\) for tokens \(B, L\)"),
        (lambda: OP.add_sinusoidal(grad, -1), "add_sinusoidal: pos_offset must be >= 0, got -1"),
        (lambda: OP.add_sinusoidal(grad[0, 0], 0), r"x must be \(\.\.\., L, d_model\), got a 1-D tensor"),
    ]
    for call, match in cases:
        with pytest.raises(RuntimeError, match=match):
            call()


def test_missing_extension_is_a_clear_error(monkeypatch):
    """Each wrapper names the missing build and how to make it, before reaching torch.ops."""
    monkeypatch.setattr(_ext, "_LOAD_ERROR", "importing scratchformer._C failed: (simulated)")
    msg = r"extension is not available .*pip install --no-build-isolation -e \."
    tokens = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match=msg):
        _ext.embed_sinusoidal(tokens, torch.zeros(1, 2), scale=1.0)
    with pytest.raises(RuntimeError, match=msg):
        _ext.embed_sinusoidal_backward(torch.zeros(1, 1, 2), tokens, 1, scale=1.0)
    with pytest.raises(RuntimeError, match=msg):
        _ext.add_sinusoidal(torch.zeros(1, 2))


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("pos_offset", [0, 7, 99_990])
def test_cuda_matches_cpu_and_ref(pos_offset, index_dtype, dtype):
    B, L, V, d = 4, 97, 1000, 256
    tokens = torch.randint(0, V, (B, L), dtype=index_dtype)
    weight = _weight(V, d, dtype)
    out = _ext.embed_sinusoidal(tokens.cuda(), weight.cuda(), scale=16.0, pos_offset=pos_offset)
    out_cpu = _ext.embed_sinusoidal(tokens, weight, scale=16.0, pos_offset=pos_offset)
    exact = _exact(tokens, weight, 16.0, pos_offset)
    eps = torch.finfo(dtype).eps
    addend = max(1.0, (weight.double() * 16.0).abs().max().item())
    report_diff(f"cuda vs cpu ({dtype})", out.cpu(), out_cpu)
    bound = 0.5 * eps * exact.abs() + PE_MAX_ERR + 2**-23 * addend
    assert ((out.cpu().double() - exact).abs() <= bound).all()
    # CPU and CUDA differ only by FMA contraction: at most one ulp of the output.
    torch.testing.assert_close(out.cpu(), out_cpu, rtol=eps, atol=eps * addend)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["d6", "d12", "d256", "row_stride_odd", "base_unaligned"])
def test_cuda_access_widths_match_cpu(layout, dtype):
    """Each access width the forward launcher picks (csrc/cuda/embed_kernels.cu `launch_fwd`):
    16 bytes a thread where d, the weight's row stride and its base allow (d256; d12 in fp32),
    one pair where only pairs fit (d6; d12 in 16-bit), element by element otherwise (an odd row
    stride; a base one element past an aligned one); the CPU op is the reference."""
    V = 50
    d = {"d6": 6, "d12": 12}.get(layout, 256)
    weight = _weight(V, d + 1 if layout == "row_stride_odd" else d, dtype)
    if layout == "row_stride_odd":
        weight = weight[:, :d]
    cuda_weight = weight.cuda()
    if layout == "base_unaligned":
        flat = torch.zeros(V * d + 1, dtype=dtype, device="cuda")
        flat[1:] = cuda_weight.flatten()
        cuda_weight = flat[1:].view(V, d)
    tokens = torch.randint(0, V, (3, 41))
    out = _ext.embed_sinusoidal(tokens.cuda(), cuda_weight, scale=2.0, pos_offset=5)
    want = _ext.embed_sinusoidal(tokens, weight, scale=2.0, pos_offset=5)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.cpu(), want, rtol=eps, atol=eps * 4)  # FMA contraction: one ulp


@requires_cuda
@pytest.mark.parametrize(
    "d, pos_offset, L",
    [
        (64, 0, 100_001),  # every position to 100k
        (512, 99_000, 1_001),  # the far end of 100k, wider rows
        (1024, 99_000, 1_001),
        (64, 2**29 - 100_000, 100_000),  # the last positions the op accepts (csrc/sinusoid.h)
    ],
)
def test_cuda_pe_accuracy(d, pos_offset, L):
    pe = _ext.add_sinusoidal(torch.zeros(1, L, d, device="cuda"), pos_offset=pos_offset)[0].cpu()
    pe64 = sinusoidal_positions(torch.arange(pos_offset, pos_offset + L), d, torch.float64)
    assert report_diff(f"cuda PE d={d}", pe, pe64) <= PE_MAX_ERR


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_grad_deterministic_and_equals_cpu(dtype):
    tokens = torch.randint(0, 7, (32, 512))
    tokens[:, ::5] = 3
    grad = torch.randn(32, 512, 96).to(dtype)
    runs = [
        OP.embed_sinusoidal_backward(grad.cuda(), tokens.cuda(), 7, 3.0, 3).cpu() for _ in range(2)
    ]
    cpu = OP.embed_sinusoidal_backward(grad, tokens, 7, 3.0, 3)
    assert torch.equal(runs[0], runs[1])
    assert torch.count_nonzero(runs[0][3]) == 0
    torch.testing.assert_close(runs[0], cpu, rtol=0, atol=0)  # same order, same roundings


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [6, 96, 130])
def test_cuda_grad_every_row_written_at_each_width(d, dtype):
    """The backward kernel writes every row of grad_weight itself (no zero-fill before it): the rows
    of ids that never occur (most of a 5,000-row vocabulary here) and padding_idx's come out exactly
    zero even where the allocator hands back memory full of NaN; 16 bytes a thread where d allows
    (96), a column a thread otherwise (6, 130); equal to the CPU kernel bit for bit."""
    V, padding_idx = 5000, 11
    tokens = torch.randint(0, 40, (8, 64))
    tokens[:, ::4] = padding_idx
    tokens[0, 0] = V - 1  # the last row, and a run of one
    grad = torch.randn(8, 64, d).to(dtype)
    torch.full((V * d + 4096,), float("nan"), dtype=dtype, device="cuda")  # freed: its block is reused
    got = OP.embed_sinusoidal_backward(grad.cuda(), tokens.cuda(), V, 3.0, padding_idx).cpu()
    want = OP.embed_sinusoidal_backward(grad, tokens, V, 3.0, padding_idx)
    absent = torch.ones(V, dtype=torch.bool)
    absent[tokens.unique()] = False
    absent[padding_idx] = True
    assert not got.isnan().any() and torch.count_nonzero(got[absent]) == 0
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # same order, same roundings


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_base", ["aligned", "offset"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(
    "V, ids",
    [
        (1, "same"),  # one row: 1 key bit
        (2**16, "ends"),  # ids 0 and V - 1 only; a power of two: 16 key bits
        (2**16 + 1, "ends"),  # one row more: 17 key bits, V - 1 = 2^16 needs the top one
        (50, "same"),  # every token V - 1: one run of all N
        (50, "pad"),  # padding_idx everywhere but one token
        (7, "rand"),  # runs of ~143
    ],
)
def test_cuda_grad_sort_and_runs(V, ids, index_dtype, grad_base, dtype):
    """The backward's sort and runs (csrc/cuda/embed_kernels.cu, stages 1-4) at their edges: the key
    bits the vocabulary needs (1, 16, 17), a run of one id over all N = 1,001 tokens (125 steps of
    kBwdRows = 8 and a tail of 1), ids only at 0 and V - 1, padding everywhere; int32 and int64 ids;
    16-byte accesses (d 64) and a grad whose base is one element past 16 bytes (a column a thread).
    Bit for bit the CPU kernel's result (same order, same roundings)."""
    B, L, d = 7, 143, 64
    tokens = {
        "same": torch.full((B, L), V - 1),
        "ends": torch.randint(0, 2, (B, L)) * (V - 1),
        "pad": torch.full((B, L), 3).index_put_((torch.tensor(2), torch.tensor(5)), torch.tensor(4)),
        "rand": torch.randint(0, V, (B, L)),
    }[ids].to(index_dtype)
    padding_idx = 3 if ids == "pad" else -1
    grad = torch.randn(B, L, d).to(dtype)
    grad_cuda = grad.cuda()
    if grad_base == "offset":  # a view one element into its storage: not 16-byte aligned
        flat = torch.empty(B * L * d + 1, dtype=dtype, device="cuda")
        flat[1:] = grad_cuda.flatten()
        grad_cuda = flat[1:].view(B, L, d)
    got = OP.embed_sinusoidal_backward(grad_cuda, tokens.cuda(), V, 3.0, padding_idx).cpu()
    want = OP.embed_sinusoidal_backward(grad, tokens, V, 3.0, padding_idx)
    report_diff(f"cuda grad vs cpu (V {V}, {ids})", got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [2, 8, 130, 520])
@pytest.mark.parametrize("B, L", [(9, 3), (17, 1), (1, 600), (8, 5)])
def test_cuda_forward_grid_edges(B, L, d, dtype):
    """The forward's grid (csrc/cuda/embed_kernels.cu `launch_fwd`) at its edges: sequences past the
    last whole group of kRowsPerThread = 8 (B 9, 17: a block of one sequence), one position (L 1),
    many position blocks (L 600), a row of one pair (d 2), 16-byte accesses (d 8, 520: in fp32 two
    blocks of 128 threads along the row) and pairs (d 130). int32 ids. The CPU op is the reference."""
    V = 40
    tokens = torch.randint(0, V, (B, L), dtype=torch.int32)
    weight = _weight(V, d, dtype)
    out = _ext.embed_sinusoidal(tokens.cuda(), weight.cuda(), scale=2.0, pos_offset=3).cpu()
    want = _ext.embed_sinusoidal(tokens, weight, scale=2.0, pos_offset=3)
    eps = torch.finfo(dtype).eps
    report_diff(f"cuda vs cpu (B {B}, L {L}, d {d}, {dtype})", out, want)
    torch.testing.assert_close(out, want, rtol=eps, atol=eps * 4)  # FMA contraction: one ulp


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_widest_row_runs_and_one_wider_is_refused_naming_d_model(dtype):
    """The forward spreads a row over the grid's y dimension (at most 65535 blocks of 128 threads, 2
    or more columns each; csrc/cuda/embed_limits.h): d_model 16,776,960 runs and equals the CPU op.
    A wider row was CUDA's "invalid configuration argument"; both ops now refuse it naming d_model."""
    d = 65535 * 128 * 2
    tokens, weight = torch.tensor([[1, 0]]), _weight(2, d, dtype)
    out = _ext.embed_sinusoidal(tokens.cuda(), weight.cuda(), scale=2.0).cpu()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, _ext.embed_sinusoidal(tokens, weight, scale=2.0), rtol=eps, atol=eps * 4)
    wide = torch.zeros(2, d + 2, dtype=dtype, device="cuda")
    for op in (lambda: _ext.embed_sinusoidal(tokens.cuda(), wide, scale=2.0), lambda: _ext.add_sinusoidal(wide[None])):
        with pytest.raises(RuntimeError, match=f"on CUDA: d_model .* at most {d}, got {d + 2}"):
            op()


@requires_cuda
def test_cuda_empty_inputs():
    """No tokens, no columns: the shapes (and dtypes) of the CPU op, zeros for the gradient, no launch."""
    weight = _weight(10, 8, torch.bfloat16, "cuda")
    for B, L in ((0, 5), (3, 0)):
        tokens = torch.zeros(B, L, dtype=torch.long, device="cuda")
        out = _ext.embed_sinusoidal(tokens, weight, scale=2.0)
        assert out.shape == (B, L, 8) and out.dtype == torch.bfloat16 and out.is_cuda
        gw = OP.embed_sinusoidal_backward(torch.zeros(B, L, 8, device="cuda"), tokens, 10, 2.0, -1)
        assert gw.shape == (10, 8) and torch.count_nonzero(gw) == 0
    tokens = torch.randint(0, 10, (2, 3), device="cuda")
    assert _ext.embed_sinusoidal(tokens, weight[:, :0], scale=2.0).shape == (2, 3, 0)
    assert OP.embed_sinusoidal_backward(torch.zeros(2, 3, 0, device="cuda"), tokens, 10, 2.0, -1).shape == (10, 0)
    assert _ext.add_sinusoidal(torch.zeros(2, 0, 8, device="cuda")).shape == (2, 0, 8)
    # no columns, no launch: the ids are still checked, as on the CPU (they were returned unread)
    bad = torch.tensor([[1, 10, 2]], device="cuda")
    with pytest.raises(RuntimeError, match=r"embed_sinusoidal: token id 10 at tokens\[0, 1\] is out of range"):
        _ext.embed_sinusoidal(bad, weight[:, :0], scale=2.0)
    with pytest.raises(RuntimeError, match=r"embed_sinusoidal_backward: token id 10 at tokens\[0, 1\] is out of"):
        OP.embed_sinusoidal_backward(torch.zeros(1, 3, 0, device="cuda"), bad, 10, 2.0, -1)


@requires_cuda
@pytest.mark.parametrize("bad", [-3, 10])
def test_cuda_grad_bad_token_id_device_assert(bad):
    """The backward's out-of-range ids: every id is checked, and named with its place, before the sort."""
    code = (
        "import torch; from scratchformer import _ext\n"
        f"t = torch.tensor([[1, {bad}, 2]], device='cuda'); g = torch.randn(1, 3, 8, device='cuda')\n"
        "torch.ops.scratchformer.embed_sinusoidal_backward(g, t, 10, 1.0, -1); torch.cuda.synchronize()\n"
    )
    _fails_with_device_assert(code, f"token id {bad} at tokens[0, 1] is out of range [0, 10)")


@requires_cuda
def test_cuda_grad_rows_beyond_int32_is_a_clear_error():
    """The CUDA backward sorts 32-bit ids: a vocabulary past 2^31 - 1 rows is refused up front."""
    grad, tokens = torch.randn(1, 3, 8, device="cuda"), torch.tensor([[1, 2, 3]], device="cuda")
    with pytest.raises(RuntimeError, match="at most 2147483647 embedding rows, got 2147483648"):
        OP.embed_sinusoidal_backward(grad, tokens, 2**31, 1.0, -1)


@requires_cuda
def test_opcheck_cuda():
    _opcheck_all("cuda")


@requires_cuda
def test_cuda_compile_fullgraph():
    tokens = torch.randint(0, 30, (2, 9), device="cuda")
    weight = _weight(30, 16, torch.float32, device="cuda", requires_grad=True)
    fn = lambda t, w: _ext.embed_sinusoidal(t, w, scale=4.0, pos_offset=3)  # noqa: E731
    out = torch.compile(fn, fullgraph=True)(tokens, weight)
    out.sum().backward()
    torch.testing.assert_close(out, fn(tokens, weight))


@requires_cuda
def test_cuda_bad_token_id_device_assert():
    # A device-side assert poisons the CUDA context, so it runs in a child process.
    code = (
        "import torch; from scratchformer import _ext\n"
        "t = torch.tensor([[1, 70000]], device='cuda'); w = torch.randn(10, 8, device='cuda')\n"
        "_ext.embed_sinusoidal(t, w, scale=1.0); torch.cuda.synchronize()\n"
    )
    _fails_with_device_assert(code, "token id 70000")


def _fails_with_device_assert(code, message):
    """`code` in a child process (a device-side assert poisons the CUDA context) ends in a
    device-side assert whose printed line names `message`."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert message in res.stdout + res.stderr
    assert "device-side assert" in res.stderr


@requires_cuda
def test_cuda_device_mismatch():
    with pytest.raises(RuntimeError, match="tokens are on cpu but weight is on cuda"):
        weight = _weight(4, 8, torch.float32, "cuda")
        _ext.embed_sinusoidal(torch.zeros(1, 2, dtype=torch.long), weight, scale=1.0)
