"""The GEMM's TMA kernels (kernels/matmul.py, `SCRATCHFORMER_TMA`: persistent programs, operands
loaded through tensor descriptors) against torch and against the pointer kernels, every epilogue,
both layouts of B, ragged M, N and K; and when they are taken at all (`_tma_layout`).

Here Triton's interpreter emulates the descriptors (blocks past an edge read as zeros, as TMA's
padding does); on a GPU before Hopper the launcher never takes them; on an H100 these tests run
them for real (GPU-only cases at the bottom at the FFN's shapes).
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, requires_cuda

import scratchformer.kernels.matmul as MM
from scratchformer.kernels._common import tma_setting
from scratchformer.kernels.ffn import ffn
from scratchformer.kernels.matmul import launch_matmul, launch_matmul_dact, matmul
from scratchformer.reference import ffn_ref

FP32_TOL = dict(atol=1e-4, rtol=1e-4)
ACT = {"none": lambda t: t, "relu": F.relu, "gelu": F.gelu}


@pytest.fixture
def tma(monkeypatch):
    monkeypatch.setattr(MM, "TMA", True)


def _layouts(N, K, dtype=torch.float32):
    """B (K, N) as the FFN passes it: the transpose of a row-major weight (N, K), and row-major."""
    w = torch.randn(N, K, device=DEVICE, dtype=dtype)
    return {"kmajor": w.t(), "rowmajor": w.t().contiguous()}


def test_tma_is_taken_only_where_tma_can_address_the_operands(tma, monkeypatch):
    a = torch.randn(64, 32, device=DEVICE)
    w = torch.randn(48, 32, device=DEVICE)
    assert MM._tma_layout(a, w.t()) is True and MM._tma_layout(a, w.t().contiguous()) is False
    assert MM._tma_layout(a.t().contiguous().t(), w.t()) is None  # A's rows not contiguous
    assert MM._tma_layout(torch.randn(64, 33, device=DEVICE)[:, :32], w.t()) is None  # row stride 132 bytes
    assert MM._tma_layout(a, torch.randn(48, 33, device=DEVICE)[:, 1:].t()) is None  # base, row stride unaligned
    assert MM._tma_layout(torch.randn(1, 32, device=DEVICE).expand(64, 32), w.t()) is None  # rows overlap: stride 0
    windows = torch.randn(64 * 8 + 24, device=DEVICE).unfold(0, 32, 8)  # (65, 32), rows 8 apart: overlapping
    assert windows.stride() == (8, 1) and MM._tma_layout(windows, w.t()) is None  # (it was taken)
    monkeypatch.setattr(MM, "TMA", False)
    assert MM._tma_layout(a, w.t()) is None


def test_tma_by_default_on_hopper_gpus_only(monkeypatch):
    """SCRATCHFORMER_TMA unset ("auto"): the TMA kernels where the device is a GPU of Hopper or
    later, never in the interpreter (there only with "1", as these tests set it); "0" never; any
    other value is refused by name."""
    for value, setting in (("auto", None), ("1", True), ("0", False)):
        monkeypatch.setenv("SCRATCHFORMER_TMA", value)
        assert tma_setting("SCRATCHFORMER_TMA", "auto") is setting
    monkeypatch.setenv("SCRATCHFORMER_TMA", "yes")
    with pytest.raises(ValueError, match="SCRATCHFORMER_TMA='yes'"):
        tma_setting("SCRATCHFORMER_TMA", "auto")
    monkeypatch.delenv("SCRATCHFORMER_TMA")
    assert tma_setting("SCRATCHFORMER_TMA", "auto") is None
    assert MM.TMA is None or "SCRATCHFORMER_TMA" in os.environ
    monkeypatch.setattr(MM, "TMA", None)
    a = torch.randn(64, 32, device=DEVICE)
    w = torch.randn(48, 32, device=DEVICE)
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert (MM._tma_layout(a, w.t()) is not None) == hopper


@pytest.mark.parametrize("layout", ["kmajor", "rowmajor"])
@pytest.mark.parametrize("activation", ["none", "relu", "gelu"])
@pytest.mark.parametrize("M,N,K", [(1, 16, 16), (33, 72, 48), (100, 64, 96)])  # ragged M, N and K
def test_tma_epilogues_match_torch(tma, M, N, K, activation, layout):
    a = torch.randn(M, K, device=DEVICE)
    b = _layouts(N, K)[layout]
    bias = torch.randn(N, device=DEVICE)
    assert MM._tma_layout(a, b) is not None
    c, pre = matmul(a, b, bias=bias, activation=activation, store_pre=True)
    h = F.linear(a, b.t(), bias)
    torch.testing.assert_close(pre, h, **FP32_TOL)
    torch.testing.assert_close(c, ACT[activation](h), **FP32_TOL)
    torch.testing.assert_close(matmul(a, b), a @ b, **FP32_TOL)


@pytest.mark.parametrize("layout", ["kmajor", "rowmajor"])
def test_tma_dropout_mask_is_the_pointer_kernels(tma, monkeypatch, layout):
    """Same seed, same Philox counters: the TMA kernels draw (and matmul_dact replays) the mask the
    pointer kernels do, so switching kernels changes no training run's randomness."""
    a = torch.randn(70, 48, device=DEVICE)
    b = _layouts(40, 48)[layout]
    bias = torch.randn(40, device=DEVICE)
    out_tma = launch_matmul(a, b, bias, "gelu", 0.3, MM.dropout_rng(0.3, 7, a.device), True, True)
    monkeypatch.setattr(MM, "TMA", False)
    out_ptr = launch_matmul(a, b, bias, "gelu", 0.3, MM.dropout_rng(0.3, 7, a.device), True, True)
    assert torch.equal(out_tma[2], out_ptr[2])
    c, pre, mask = out_tma
    torch.testing.assert_close(pre, F.linear(a, b.t(), bias), **FP32_TOL)
    torch.testing.assert_close(c, F.gelu(pre) * mask / 0.7, **FP32_TOL)


@pytest.mark.parametrize("layout", ["kmajor", "rowmajor"])
@pytest.mark.parametrize("activation,p", [("relu", 0.0), ("relu", 0.3), ("gelu", 0.0), ("gelu", 0.3)])
def test_tma_dact_matches_autograd(tma, activation, p, layout):
    """dH = (g B) act'(h) keep / (1 - p) against autograd through torch's activation, under the
    forward's mask (matmul's, from the same rng: the counters depend on (row, col) only)."""
    g = torch.randn(33, 48, device=DEVICE)
    b = _layouts(72, 48)[layout]  # (48, 72)
    h = torch.randn(33, 72, device=DEVICE, requires_grad=True)
    rng = MM.dropout_rng(p, 3, g.device)
    keep = torch.ones(33, 72, device=DEVICE)
    if p > 0:
        keep = launch_matmul(torch.zeros(33, 16, device=DEVICE), torch.zeros(16, 72, device=DEVICE), None, "none",
                             p, rng, False, True)[1].float()
    a = ACT[activation](h) * keep / (1 - p)
    (dh_ref,) = torch.autograd.grad(a, h, g @ b)
    aux = a.detach() if activation == "relu" else h.detach()  # relu's saved output, gelu's pre-activation
    dh, db = launch_matmul_dact(g, b, aux, activation, p, rng, bias_grad=True)
    torch.testing.assert_close(dh, dh_ref, **FP32_TOL)
    torch.testing.assert_close(db, dh_ref.sum(0), **FP32_TOL)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_tma_ffn_forward_and_backward_match_ref(tma, activation, dtype, tol):
    """The whole FFN with every GEMM it launches on the TMA kernels (its weight gradients are cuBLAS's)."""
    x = torch.randn(33, 64, device=DEVICE, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(96, 64, device=DEVICE) / 8).to(dtype).requires_grad_()
    b1 = torch.randn(96, device=DEVICE, dtype=dtype, requires_grad=True)
    w2 = (torch.randn(64, 96, device=DEVICE) / 10).to(dtype).requires_grad_()
    b2 = torch.randn(64, device=DEVICE, dtype=dtype, requires_grad=True)
    leaves = (x, w1, b1, w2, b2)
    y = ffn(*leaves, activation=activation)
    y_ref = ffn_ref(*(t.float() for t in leaves), activation=activation)
    torch.testing.assert_close(y.float(), y_ref, atol=tol, rtol=tol)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, g)
    grads_ref = torch.autograd.grad(y_ref, leaves, g.float())
    for ours, ref in zip(grads, grads_ref):
        torch.testing.assert_close(ours.float(), ref.float(), atol=tol * 4, rtol=tol * 4)


@requires_cuda
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("rows,d_model,d_ff", [(4097, 512, 2048), (1000, 1024, 4096)])
def test_tma_ffn_gpu_sizes(tma, rows, d_model, d_ff, activation):
    """The base preset's shapes and a larger one, bf16 with dropout, on the TMA kernels against the
    pointer kernels under the same mask (the Philox counters are the tiling's invariant)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    x = torch.randn(rows, d_model, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(d_ff, d_model, device="cuda") / d_model**0.5).bfloat16()
    b1 = torch.randn(d_ff, device="cuda").bfloat16()
    for b in (w1.t(), w1.t().contiguous()):
        rng = MM.dropout_rng(0.1, 11, x.device)
        c, pre, mask = launch_matmul(x, b, b1, activation, 0.1, rng, True, True)
        ref_pre = (x.float() @ b.float() + b1.float())
        torch.testing.assert_close(pre.float(), ref_pre, atol=6e-2, rtol=2e-2)
        torch.testing.assert_close(c.float(), ACT[activation](pre.float()) * mask / 0.9, atol=6e-2, rtol=2e-2)
