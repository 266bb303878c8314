"""Fused FFN (kernels/ffn.py) and its GEMM (kernels/matmul.py) against the eager reference
`ffn_ref` and, independently, `F.linear` + `F.relu` / `F.gelu`.

On CPU every case runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1) with one fixed
32x32x32 tile, so shapes stay small; GPU-only cases are marked requires_cuda and skipped here.
bf16 note: Triton 3.9's interpreter returns garbage from tl.dot on bf16 operands, so the kernels
upcast them to fp32 there (`_common.upcast_dot`); bf16 cases here therefore test the bf16 loads,
stores and epilogues, not a native bf16 dot (that needs the GPU cases).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, report_diff, requires_cuda

import scratchformer.kernels.ffn as ffn_mod
from scratchformer import ops
from scratchformer.kernels import _common
from scratchformer.kernels import matmul as MM
from scratchformer.kernels.ffn import ffn
from scratchformer.kernels.matmul import matmul, matmul_dact
from scratchformer.reference import ffn_ref

# fp32: both sides accumulate in fp32 (TF32 off, conftest), only summation order differs.
# fp16/bf16: flash-attention's rule. Our error against the fp32 reference (same rounded inputs,
# upcast) must be at most twice the error of the eager path run in the low dtype, plus a small
# atol (relative to the largest reference value: about one ulp there) because the max errors of
# both paths are only one or two ulps, so their ratio is noisy. The eager path rounds h, act(h)
# and y to the low dtype; ours rounds a and y once from fp32 accumulators: no worse in principle.
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
LOW_DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)]


def _params(d_model, d_ff, dtype, *, bias=True):
    # nn.Linear-like scale keeps activations O(1) so tolerances mean the same at every size.
    w1 = (torch.randn(d_ff, d_model, device=DEVICE) / math.sqrt(d_model)).to(dtype).requires_grad_()
    w2 = (torch.randn(d_model, d_ff, device=DEVICE) / math.sqrt(d_ff)).to(dtype).requires_grad_()
    b1 = (0.1 * torch.randn(d_ff, device=DEVICE)).to(dtype).requires_grad_() if bias else None
    b2 = (0.1 * torch.randn(d_model, device=DEVICE)).to(dtype).requires_grad_() if bias else None
    return w1, b1, w2, b2


def _leaves(*ts):
    return [t for t in ts if t is not None]


def _fwd_bwd(fn, x, w1, b1, w2, b2, g):
    y = fn(x, w1, b1, w2, b2)
    return [y] + list(torch.autograd.grad(y, _leaves(x, w1, b1, w2, b2), g))


def _torch_ffn(activation):
    def fn(x, w1, b1, w2, b2):
        h = F.linear(x, w1, b1)
        return F.linear(F.relu(h) if activation == "relu" else F.gelu(h), w2, b2)
    return fn


def _check_fp32(ours_fn, ref_fn, inputs, tol=FP32_TOL):
    x = inputs[0]
    g = torch.randn(*x.shape[:-1], inputs[3].shape[0], device=DEVICE, dtype=x.dtype)
    ours, ref = _fwd_bwd(ours_fn, *inputs, g), _fwd_bwd(ref_fn, *inputs, g)
    for name, a, b in zip(["y", "dx", "dw1", "db1", "dw2", "db2"], ours, ref):
        report_diff(name, a, b)
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


def _check_low(ours_fn, ref_fn, inputs, atol):
    """Error of ours vs the fp32 reference <= 2x the eager low-dtype error + atol, per tensor."""
    x = inputs[0]
    g = torch.randn(*x.shape[:-1], inputs[3].shape[0], device=DEVICE, dtype=x.dtype)
    up = [t.detach().float().requires_grad_() if t is not None else None for t in inputs]
    ref32 = _fwd_bwd(ref_fn, *up, g.float())
    eager = _fwd_bwd(ref_fn, *inputs, g)
    ours = _fwd_bwd(ours_fn, *inputs, g)
    for name, a, e, r in zip(["y", "dx", "dw1", "db1", "dw2", "db2"], ours, eager, ref32):
        assert a.dtype == x.dtype and a.shape == r.shape
        err = report_diff(f"{name} ours", a, r)
        err_eager = report_diff(f"{name} eager", e, r)
        assert err <= 2 * err_eager + atol * max(1.0, r.abs().max().item()), name


# Rows 1, 7, 33, 100: none a multiple of the 32-row tile except by accident of 1 tile.
# (d_model, d_ff): 16 (smallest claimed, half a tile), 48/100 (ragged K and N), 256 (several tiles).
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("d_model,d_ff", [(16, 48), (48, 100), (100, 256), (256, 100)])
@pytest.mark.parametrize("rows", [1, 7, 33, 100])
def test_ffn_matches_ref_fp32(rows, d_model, d_ff, activation):
    x = torch.randn(rows, d_model, device=DEVICE, requires_grad=True)
    inputs = (x, *_params(d_model, d_ff, torch.float32))
    _check_fp32(
        lambda *a: ffn(*a, activation=activation),
        lambda *a: ffn_ref(*a, activation=activation),
        inputs,
    )


@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_matches_torch_linear(activation, has_bias):
    """Independent formulation: F.linear + F.relu/F.gelu, 3-D input, with and without biases (the
    biases strided views: the GEMM's epilogue read them at unit stride, a silent wrong sum)."""
    x = torch.randn(2, 17, 48, device=DEVICE, requires_grad=True)
    w1, b1, w2, b2 = _params(48, 100, torch.float32, bias=has_bias)
    if has_bias:
        b1, b2 = (torch.stack([b, torch.randn_like(b)], 1)[:, 0].detach().requires_grad_() for b in (b1, b2))
    inputs = (x, w1, b1, w2, b2)
    _check_fp32(lambda *a: ffn(*a, activation=activation), _torch_ffn(activation), inputs)


@pytest.mark.parametrize("dtype,atol", LOW_DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("rows,d_model,d_ff", [(33, 100, 256), (100, 256, 100)])
def test_ffn_low_precision(rows, d_model, d_ff, activation, dtype, atol):
    x = torch.randn(rows, d_model, device=DEVICE).to(dtype).requires_grad_()
    inputs = (x, *_params(d_model, d_ff, dtype))
    _check_low(lambda *a: ffn(*a, activation=activation), lambda *a: ffn_ref(*a, activation=activation), inputs, atol)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ffn_weight_grads_on_triton_gemm(monkeypatch, dtype, activation):
    """WGRAD_KERNEL = "triton": the weight gradients go through our GEMM too (transposed, strided A)."""
    monkeypatch.setattr(ffn_mod, "WGRAD_KERNEL", "triton")
    x = torch.randn(33, 48, device=DEVICE).to(dtype).requires_grad_()
    inputs = (x, *_params(48, 100, dtype))
    ours = lambda *a: ffn(*a, activation=activation)  # noqa: E731
    ref = lambda *a: ffn_ref(*a, activation=activation)  # noqa: E731
    if dtype == torch.float32:
        _check_fp32(ours, ref, inputs)
    else:
        _check_low(ours, ref, inputs, 1e-2)


def test_ffn_strided_input():
    """x as a strided view (every other row of a buffer, a column slice): no copy, same numbers."""
    base = torch.randn(14, 96, device=DEVICE)
    x = base[::2, 8:56].requires_grad_(False)  # (7, 48), strides (192, 1)
    w1, b1, w2, b2 = _params(48, 100, torch.float32)
    torch.testing.assert_close(ffn(x, w1, b1, w2, b2), ffn_ref(x, w1, b1, w2, b2), **FP32_TOL)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_dropout_matches_ref_with_replayed_mask(activation):
    """Forward with the kernel's mask replayed in the reference; the backward regenerates the
    mask (gelu: Philox replay; relu: from the saved output) and must give the same gradients."""
    x = torch.randn(33, 48, device=DEVICE, requires_grad=True)
    inputs = (x, *_params(48, 100, torch.float32))
    p = 0.3
    _, mask = ffn(*inputs, activation=activation, dropout_p=p, seed=5, return_dropout_mask=True)
    assert mask.dtype == torch.bool and mask.shape == (33, 100)
    _check_fp32(
        lambda *a: ffn(*a, activation=activation, dropout_p=p, seed=5),
        lambda *a: ffn_ref(*a, activation=activation, dropout_p=p, dropout_mask=mask),
        inputs,
    )


def test_ffn_dropout_reproducible():
    x = torch.randn(7, 48, device=DEVICE)
    params = _params(48, 100, torch.float32)
    y1 = ffn(x, *params, dropout_p=0.5, seed=1)
    assert torch.equal(y1, ffn(x, *params, dropout_p=0.5, seed=1))
    assert not torch.equal(y1, ffn(x, *params, dropout_p=0.5, seed=2))
    torch.manual_seed(3)
    z1 = ffn(x, *params, dropout_p=0.5)
    z2 = ffn(x, *params, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(z1, ffn(x, *params, dropout_p=0.5)) and not torch.equal(z1, z2)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_ffn_dropout_keep_rate(p):
    """Kept fraction within 4 sigma of 1 - p (binomial) over 100 x 256 = 25600 units."""
    x = torch.randn(100, 16, device=DEVICE)
    params = _params(16, 256, torch.float32)
    _, mask = ffn(x, *params, dropout_p=p, seed=0, return_dropout_mask=True)
    sigma = math.sqrt(p * (1 - p) / mask.numel())
    kept = mask.float().mean().item()
    print(f"kept {kept:.4f}, expected {1 - p:.4f} +- {4 * sigma:.4f}")
    assert abs(kept - (1 - p)) < 4 * sigma


# ---------------------------------------------------------------------------------------------
# the GEMM alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (33, 70, 48), (100, 64, 96)])  # EVEN_K and ragged K
def test_matmul_epilogues_match_torch(M, N, K, activation):
    a = torch.randn(K, M, device=DEVICE).t()  # column-major A: strides handled, no copy
    b = torch.randn(N, K, device=DEVICE).t()
    bias = torch.randn(N, 2, device=DEVICE)[:, 1]  # a strided view: the epilogue read it at unit stride
    c, pre = matmul(a, b, bias=bias, activation=activation, store_pre=True)
    h = F.linear(a, b.t(), bias)
    act = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}[activation]
    torch.testing.assert_close(pre, h, **FP32_TOL)
    torch.testing.assert_close(c, act(h), **FP32_TOL)
    torch.testing.assert_close(matmul(a, b), torch.matmul(a, b), **FP32_TOL)


def test_matmul_copies_an_operand_whose_k_stride_would_pass_int32(monkeypatch):
    """The kernels step along K by BLOCK_K * stride in int32: an operand whose K stride times the
    widest BLOCK_K reaches 2^31 (a column-major A of 33.5M rows) reaches them at unit K stride, a
    copy. Too large to allocate here, so the widest BLOCK_K is raised until these strides pass it:
    what the kernels get, forward and dact, and the products, against torch."""
    M, N, K = 40, 24, 48
    a = torch.randn(K, M, device=DEVICE).t()  # K stride M
    b = torch.randn(K, N, device=DEVICE)  # K stride N
    seen, launch = [], MM.launch_tuned
    monkeypatch.setattr(MM, "launch_tuned", lambda kernel, grid, key, *args, **kw: (
        seen.append((args[0].stride(), args[1].stride())), launch(kernel, grid, key, *args, **kw))[1])
    monkeypatch.setattr(MM, "_MAX_BLOCK_K", -(-(2**31) // min(M, N)))  # both pass
    torch.testing.assert_close(matmul(a, b), a @ b, **FP32_TOL)
    h = torch.randn(M, N, device=DEVICE)
    dh, _ = matmul_dact(a, b, h, activation="relu")
    torch.testing.assert_close(dh, (a @ b) * (h > 0), **FP32_TOL)
    assert seen == [((K, 1), (1, K))] * 2
    monkeypatch.setattr(MM, "_MAX_BLOCK_K", 2**31 // max(M, N) - 1)  # both fit: no copy
    matmul(a, b)
    assert seen[-1] == ((1, M), (N, 1))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matmul_dact_matches_autograd(activation):
    g = torch.randn(33, 48, device=DEVICE)
    w = torch.randn(48, 70, device=DEVICE)
    h = torch.randn(33, 70, device=DEVICE, requires_grad=True)
    a = F.relu(h) if activation == "relu" else F.gelu(h)
    (dh_ref,) = torch.autograd.grad(a, h, g @ w)
    saved = a.detach() if activation == "relu" else h.detach()
    dh, db = matmul_dact(g, w, saved, activation=activation, bias_grad=True)
    torch.testing.assert_close(dh, dh_ref, **FP32_TOL)
    torch.testing.assert_close(db, dh_ref.sum(0), **FP32_TOL)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_matmul_dact_reads_a_strided_aux_by_its_values(activation):
    """The epilogue reads aux (the forward's output for relu, its pre-activation for gelu) as a
    contiguous (M, N) tensor: a transposed or sliced aux reaches it as a copy, and dH and its column
    sums are autograd's for aux's values, not for its memory order."""
    M, N, K = 37, 70, 48  # test_matmul_dact_matches_autograd's N and K: no new autotune key
    g = torch.randn(M, K, device=DEVICE)
    w = torch.randn(K, N, device=DEVICE)
    h = torch.randn(N, M, device=DEVICE).t().requires_grad_()  # column-major
    a = F.relu(h) if activation == "relu" else F.gelu(h)
    (dh_ref,) = torch.autograd.grad(a, h, g @ w)
    saved = a.detach() if activation == "relu" else h.detach()
    assert not saved.is_contiguous()
    dh, db = matmul_dact(g, w, saved, activation=activation, bias_grad=True)
    torch.testing.assert_close(dh, dh_ref, **FP32_TOL)
    torch.testing.assert_close(db, dh_ref.sum(0), **FP32_TOL)


def test_matmul_reads_nothing_past_k():
    """A (M, K) and B (K, N) are views into larger buffers whose elements past K are NaN: the K loop's
    partial last tile (K 48, 32-wide tiles here) masks both operands' loads (a masked-in NaN times the
    other's zero is still NaN), in the forward (bias, gelu, pre-activation) and the activation-gradient
    GEMM (relu, bias gradient)."""
    M, N, K = 37, 70, 48
    a_buf = torch.full((M, K + 16), float("nan"), device=DEVICE)
    b_buf = torch.full((K + 16, N), float("nan"), device=DEVICE)
    a_buf[:, :K] = torch.randn(M, K, device=DEVICE)
    b_buf[:K] = torch.randn(K, N, device=DEVICE)
    a, b = a_buf[:, :K], b_buf[:K]
    bias = torch.randn(N, device=DEVICE)
    h = torch.addmm(bias, a, b)
    c, pre = matmul(a, b, bias=bias, activation="gelu", store_pre=True)
    torch.testing.assert_close(pre, h, **FP32_TOL)
    torch.testing.assert_close(c, F.gelu(h), **FP32_TOL)
    dh, db = matmul_dact(a, b, F.relu(h), activation="relu", bias_grad=True)
    torch.testing.assert_close(dh, (a @ b) * (h > 0), **FP32_TOL)
    torch.testing.assert_close(db, ((a @ b) * (h > 0)).sum(0), **FP32_TOL)


def test_matmul_dropout_seed_and_replay():
    """The GEMM's own entry points: a given seed fixes the mask (matmul with the same seed draws it
    again, matmul_dact with it replays it, gelu), seed=None draws a fresh one per call from torch's
    generator. The launches are those the FFN's dropout tests make (x W1ᵀ + b1 at d_model 48,
    d_ff 100, fp32): no new compile for tests/test_compile_budget.py to count."""
    p = 0.3
    x = torch.randn(33, 48, device=DEVICE)
    w1, b1, w2, _ = (t.detach() if t is not None else None for t in _params(48, 100, torch.float32))
    c, h = matmul(x, w1.t(), bias=b1, activation="gelu", dropout_p=p, seed=5, store_pre=True)
    _, mask = matmul(x, w1.t(), bias=b1, activation="gelu", dropout_p=p, seed=5, store_mask=True)
    torch.testing.assert_close(c, F.gelu(h) * mask / (1 - p), **FP32_TOL)
    g = torch.randn(33, 48, device=DEVICE)
    hh = h.detach().requires_grad_()
    (dh_ref,) = torch.autograd.grad(F.gelu(hh), hh, (g @ w2) * mask / (1 - p))
    dh, db = matmul_dact(g, w2, h, activation="gelu", dropout_p=p, seed=5, bias_grad=True)
    torch.testing.assert_close(dh, dh_ref, **FP32_TOL)
    torch.manual_seed(1)
    m1, m2 = (matmul(x, w1.t(), bias=b1, activation="gelu", dropout_p=p, store_mask=True)[1] for _ in range(2))
    torch.manual_seed(1)
    assert not torch.equal(m1, m2)
    assert torch.equal(m1, matmul(x, w1.t(), bias=b1, activation="gelu", dropout_p=p, store_mask=True)[1])


# ---------------------------------------------------------------------------------------------
# through the backend switch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ops_triton_matches_eager(activation):
    x = torch.randn(2, 7, 48, device=DEVICE, requires_grad=True)
    inputs = (x, *_params(48, 100, torch.float32))
    _check_fp32(
        lambda *a: ops.select("triton", DEVICE).ffn(*a, activation=activation),
        lambda *a: ops.select("eager", DEVICE).ffn(*a, activation=activation),
        inputs,
    )


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_every_backend_drops_the_activation_and_scales_what_it_keeps(kernel):
    """With identity weights, zero biases and a positive x, relu(x W1ᵀ) = x and y = dropout(x): each
    element of y is 0 (dropped) or x / (1 - p) (kept, scaled), and both occur at p = 0.5 over 20 x 16
    draws; an invariant that needs no mask, so it holds every backend to the same dropout."""
    eye, zero = torch.eye(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    x = torch.rand(20, 16, device=DEVICE) + 0.5
    p = 0.5
    y = ops.select(kernel, DEVICE).ffn(x, eye, zero, eye, zero, dropout_p=p)
    kept = torch.isclose(y, x / (1 - p), rtol=1e-6, atol=0)
    dropped = y == 0
    assert (kept | dropped).all() and kept.any() and dropped.any()


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


def test_ffn_bad_inputs():
    x = torch.randn(4, 48, device=DEVICE)
    w1, b1, w2, b2 = (t.detach() for t in _params(48, 100, torch.float32))
    with pytest.raises(ValueError, match=r"w1 must be \(d_ff, 32\) for x's d_model 32"):
        ffn(torch.randn(4, 32, device=DEVICE), w1, b1, w2, b2)
    with pytest.raises(ValueError, match=r"w2 must be \(48, 100\)"):
        ffn(x, w1, b1, w2.t(), b2)
    with pytest.raises(ValueError, match=r"b1 must be \(100,\)"):
        ffn(x, w1, b2, w2, b2)
    with pytest.raises(ValueError, match=r"b2 must be \(48,\), got \(100,\)"):
        ffn(x, w1, b1, w2, b1)
    with pytest.raises(ValueError, match=r"w2 must be \(48, 100\) \(d_model, d_ff\), got \(48, 101\)"):  # right height
        ffn(x, w1, b1, torch.randn(48, 101, device=DEVICE), b2)
    with pytest.raises(ValueError, match="dtype mismatch"):
        ffn(x.half(), w1, b1, w2, b2)
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16, got torch.float64"):
        ffn(x.double(), w1.double(), b1.double(), w2.double(), b2.double())
    with pytest.raises(ValueError, match="different devices"):
        ffn(x, w1.to("meta"), b1, w2, b2)
    with pytest.raises(ValueError, match=r"d_model must be in \[16, 16384\], got 8"):
        x8, w1_8, w2_8 = (torch.randn(*s, device=DEVICE) for s in ((4, 8), (100, 8), (8, 100)))
        ffn(x8, w1_8, b1, w2_8, None)
    with pytest.raises(ValueError, match="activation must be 'relu' or 'gelu', got 'tanh'"):
        ffn(x, w1, b1, w2, b2, activation="tanh")
    # the widths' bounds are inclusive: 16 and 16384 taken, one past either refused (checked without a launch)
    for d_model, d_ff in ((16, 16384), (16384, 16)):
        ffn_mod.check_limits(torch.empty(1, d_model, device=DEVICE), torch.empty(d_ff, d_model, device=DEVICE), None,
                             torch.empty(d_model, d_ff, device=DEVICE), None)
    for d_model, d_ff, name, got in ((15, 64, "d_model", 15), (16, 16385, "d_ff", 16385)):
        with pytest.raises(ValueError, match=rf"ffn: {name} must be in \[16, 16384\], got {got}"):
            ffn_mod.check_limits(torch.empty(1, d_model, device=DEVICE), torch.empty(d_ff, d_model, device=DEVICE),
                                 None, torch.empty(d_model, d_ff, device=DEVICE), None)
    with pytest.raises(ValueError, match=r"matmul: inner dims differ"):
        matmul(torch.randn(4, 8, device=DEVICE), torch.randn(7, 8, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# GPU only (skipped on CPU): realistic sizes, native bf16 dots, autotuned tiles
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4)] + LOW_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("rows,d_model,d_ff", [(4097, 512, 2048), (1000, 1024, 4096), (257, 64, 8192), (129, 8192, 64)])
def test_ffn_gpu_sizes(rows, d_model, d_ff, activation, dtype, atol):
    x = torch.randn(rows, d_model, device=DEVICE).to(dtype).requires_grad_()
    inputs = (x, *_params(d_model, d_ff, dtype))
    ours = lambda *a: ffn(*a, activation=activation, dropout_p=0.0)  # noqa: E731
    ref = lambda *a: ffn_ref(*a, activation=activation)  # noqa: E731
    if dtype == torch.float32:
        _check_fp32(ours, ref, inputs, tol=dict(atol=1e-3, rtol=1e-3))  # K up to 8192 terms
    else:
        _check_low(ours, ref, inputs, atol)


@pytest.mark.parametrize("tma", [False, True], ids=["pointer", "tma"])
def test_a_tuned_kernel_launches_its_chosen_config_directly(monkeypatch, tma):
    """kernels/_common.launch_tuned: the Autotuner chooses once per key; later launches of the key
    skip its per-call lookup and compute the same; a new key (another M bucket) asks it again. Both
    GEMM families (the TMA kernels are Hopper's default, so each is pinned here)."""
    monkeypatch.setattr(MM, "TMA", tma)
    if tma and not MM.tma_enabled(True, torch.device(DEVICE)):
        pytest.skip("the TMA kernels need Hopper or later (or the interpreter)")
    monkeypatch.setattr(_common, "_CHOSEN", {})
    monkeypatch.setattr(_common, "_LAUNCHED", {})
    kernel = MM._matmul_fwd_tma_kernel if tma else MM._matmul_fwd_kernel
    calls, run = [], kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    a, b = torch.randn(8, 32, device=DEVICE), torch.randn(32, 16, device=DEVICE)
    first, second = matmul(a, b), matmul(a, b)
    assert len(calls) == 1 and torch.equal(first, second)
    torch.testing.assert_close(second, a @ b, rtol=1e-5, atol=1e-5)
    taller = torch.randn(300, 32, device=DEVICE)
    torch.testing.assert_close(matmul(taller, b), taller @ b, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2
    # what a benchmark case records: the config the kernel ran last (the taller key's), then nothing
    fn, chosen = list(_common._CHOSEN.values())[-1]  # the taller key's: chosen last
    assert _common.tuned_launches(clear=True) == {fn.__name__: chosen}
    assert _common.tuned_launches() == {}


def test_a_tuned_launch_keeps_its_heuristics_per_key(monkeypatch):
    """launch_tuned keeps matmul's EVEN_K (a `triton.heuristics` of K and BLOCK_K) with the chosen
    config of each key: a K that is not a multiple of BLOCK_K (the masked K loop) and one that is,
    each launched twice (the second time on the kept values), both equal a @ b. The pointer
    kernels' (pinned: Hopper's default GEMMs are the TMA kernels, whose K loop is unmasked)."""
    monkeypatch.setattr(MM, "TMA", False)
    monkeypatch.setattr(_common, "_CHOSEN", {})
    for K in (40, 64, 40):
        a, b = torch.randn(8, K, device=DEVICE), torch.randn(K, 16, device=DEVICE)
        for _ in range(2):
            torch.testing.assert_close(matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
    kept = {meta["EVEN_K"] for _, meta in _common._CHOSEN.values()}
    assert kept == {True, False}, _common._CHOSEN
