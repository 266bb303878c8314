"""Attention's TMA path (kernels/attention.py, `SCRATCHFORMER_ATTENTION_TMA`): the forward's and
dQ's key/value blocks and dK/dV's query/dO blocks streamed through tensor descriptors (`_slab`,
`_stream_rows`) instead of pointer loads, against the pointer kernels and the reference, every
mask, dropout, head dims, both layouts the model passes; and when it is taken at all (`_tma`).

Here Triton's interpreter emulates the descriptors (rows past a slab's length read as zeros, as
TMA's padding does); the GPU-only case at the bottom runs them for real on Hopper.
"""

import pytest
import torch
from conftest import DEVICE, requires_cuda
from test_attention import LOWP, _check_lowp, assert_matches_fp32, leaves, make_qkv, run_both

import scratchformer.kernels.attention as A
from scratchformer.kernels.attention import attention
from scratchformer.reference import attention_ref


def _both_paths(monkeypatch, q, k, v, **kw):
    """(out, lse, grads) of the TMA kernels and of the pointer kernels on the same inputs and dO,
    and the reference's."""
    results = []
    for tma in (True, False):
        monkeypatch.setattr(A, "TMA", tma)
        torch.manual_seed(0)  # the same dO for both
        results.append(run_both(q, k, v, **kw))
    (tma_run, ref), (ptr_run, _) = results
    return tma_run, ptr_run, ref


# The TMA and pointer kernels do the same math on differently shaped blocks, so the interpreter's
# dot (numpy's BLAS) may sum them in another order, which depends on the CPU's vector units: a few
# fp32 ulps of the value (seen: 10 ulps of a gradient near 1 on an AVX-512 machine).
SAME_RTOL = 4e-6


def _assert_same(a, b, atol, rtol=SAME_RTOL):
    out, lse, grads = a
    r_out, r_lse, r_grads = b
    torch.testing.assert_close(out, r_out, atol=atol, rtol=rtol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(r_lse))
    torch.testing.assert_close(lse.nan_to_num(neginf=0), r_lse.nan_to_num(neginf=0), atol=atol, rtol=rtol)
    for g, r in zip(grads, r_grads, strict=True):
        torch.testing.assert_close(g, r, atol=atol, rtol=rtol)


CASES = {  # (Lq, Lk, causal, key_lengths, query_lengths)
    "self": (33, 33, False, None, None),
    "causal": (33, 33, True, None, None),
    "cross": (7, 100, False, None, None),
    "decode": (1, 100, True, None, None),
    "more_queries": (100, 7, True, None, None),
    "padded": (33, 33, True, [33, 0], [20, 33]),
    "padded_cross": (7, 33, False, [1, 17], None),
}


@pytest.mark.parametrize("layout", ["contiguous", "fused"])
@pytest.mark.parametrize("case", list(CASES))
def test_tma_matches_pointer_kernels(monkeypatch, case, layout):
    Lq, Lk, causal, klen, qlen = CASES[case]
    q, k, v = make_qkv(2, 2, Lq, Lk, 32, layout=layout)
    kw = dict(causal=causal)
    if klen is not None:
        kw["key_lengths"] = torch.tensor(klen, device=DEVICE)
    if qlen is not None:
        kw["query_lengths"] = torch.tensor(qlen, device=DEVICE)
    assert A._tma(k, v) is False  # the module's default (auto: Hopper at head dim 128 only) until a test sets it
    monkeypatch.setattr(A, "TMA", True)
    assert A._tma(q, k, v)
    tma_run, ptr_run, ref = _both_paths(monkeypatch, q, k, v, **kw)
    _assert_same(tma_run, ptr_run, atol=1e-6)
    _assert_same(tma_run, ref, atol=2e-4)


@pytest.mark.parametrize("D", [16, 64, 128])
def test_tma_head_dims_and_dropout(monkeypatch, D):
    """Dropout on the TMA path: the reference fed its keep mask (forward and backward replay one
    mask), and the pointer kernels' results for the same seed."""
    q, k, v = make_qkv(1, 2, 33, 40, D, layout="fused")
    kw = dict(causal=True, key_lengths=torch.tensor([35], device=DEVICE), dropout_p=0.3)
    monkeypatch.setattr(A, "TMA", True)
    ql, kl, vl = leaves(q, k, v)
    out, lse, mask = attention(ql, kl, vl, seed=7, return_lse=True, return_dropout_mask=True, **kw)
    ref, ref_lse = attention_ref(ql, kl, vl, dropout_mask=mask, return_lse=True, **kw)
    g = torch.randn_like(out)
    assert_matches_fp32((out, lse, torch.autograd.grad(out, (ql, kl, vl), g)),
                        (ref, ref_lse, torch.autograd.grad(ref, (ql, kl, vl), g)))
    tma_run, ptr_run, _ = _both_paths(monkeypatch, q, k, v, seed=7, **kw)
    _assert_same(tma_run, ptr_run, atol=1e-6)


# the forward's row max over the NaN rows past query_lengths (zeroed after): Triton 3.6's interpreter
# takes it with numpy, which warns
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_tma_reads_no_query_row_past_query_lengths(monkeypatch):
    """dK/dV's query slab ends at query_lengths, not at Lq, so its descriptor reads the rows past it as
    zeros, as the pointer loads' mask does: NaN queries there reach no gradient. Ours on the poisoned
    q equals the reference on q with those rows zeroed (the reference's own dK takes in 0 · NaN)."""
    B, H, Lq, Lk, D = 2, 2, 21, 26, 32
    q, k, v = (t.detach() for t in make_qkv(B, H, Lq, Lk, D))
    q_clean = q.clone()
    q_clean[1, :, 12:] = 0.0
    q[1, :, 12:] = float("nan")
    monkeypatch.setattr(A, "TMA", True)
    assert A._tma(q, k, v)
    q, q_clean, k, v = (t.requires_grad_() for t in (q, q_clean, k, v))
    kw = dict(causal=True, query_lengths=torch.tensor([Lq, 12], device=DEVICE),
              key_lengths=torch.tensor([19, Lk], device=DEVICE))
    out, lse = attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attention_ref(q_clean, k, v, return_lse=True, **kw)
    g = torch.randn_like(ref)
    assert_matches_fp32((out, lse, torch.autograd.grad(out, (q, k, v), g)),
                        (ref, ref_lse, torch.autograd.grad(ref, (q_clean, k, v), g)))


def test_tma_bf16_matches_ref_and_pointer_kernels(monkeypatch):
    """bf16 on the TMA path: within the low-precision yardstick of the fp32 reference (as the
    pointer kernels are held in test_attention.py), and equal to the pointer kernels."""
    q, k, v = leaves(*make_qkv(2, 2, 33, 33, 64, dtype=torch.bfloat16, layout="fused"))
    monkeypatch.setattr(A, "TMA", True)
    _check_lowp(q, k, v, torch.randn(2, 2, 33, 64, dtype=torch.bfloat16, device=DEVICE), LOWP[1][1], causal=True)
    tma_run, ptr_run, _ = _both_paths(monkeypatch, q, k, v, causal=True)
    _assert_same(tma_run, ptr_run, atol=1e-2)


def test_tma_is_taken_only_where_tma_can_address_the_rows(monkeypatch):
    monkeypatch.setattr(A, "TMA", True)
    q, k, v = make_qkv(2, 2, 8, 8, 16, layout="fused")
    assert A._tma(q, k, v)
    assert not A._tma(*make_qkv(2, 2, 8, 8, 16, layout="strided_d"))  # head dim not unit-stride
    flat = torch.randn(2 * 2 * 8 * 16 + 1, device=DEVICE)
    assert not A._tma(flat[1:].view(2, 2, 8, 16))  # base 4 bytes past a 16-byte boundary
    rows = torch.randn(2, 2, 8, 17, device=DEVICE)[..., :16]
    assert not A._tma(rows)  # rows 68 bytes apart
    assert not A._tma(torch.randn(2, 2, 1, 16, device=DEVICE).expand(2, 2, 8, 16))  # rows overlap: stride 0
    windows = torch.randn(2 * 2 * 8 * 8 + 8, device=DEVICE).unfold(0, 16, 8).view(2, 2, 8, 16)[..., :16]
    assert windows.stride(2) == 8 and not A._tma(windows)  # rows 8 apart, 16 wide: overlapping (it was taken)
    assert A._tma(torch.randn(1, 1, 8, 16, device=DEVICE).expand(2, 2, 8, 16))  # (batch, head) stride 0: a base
    monkeypatch.setattr(A, "TMA", None)  # auto: GPUs of Hopper and later, at head dim 128 only
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert not A._tma(q, k, v)  # head dim 16: the pointer kernels won there
    q128, k128, v128 = make_qkv(2, 2, 8, 8, A.TMA_MIN_HEAD_DIM, layout="fused")
    assert A._tma(q128, k128, v128) == hopper
    with monkeypatch.context() as m:  # the head-dim rule itself, on any machine: as if on Hopper
        m.setattr(A, "tma_enabled", lambda setting, device: setting is not False)
        assert A._tma(q128, k128, v128) and not A._tma(q, k, v)
    monkeypatch.setattr(A, "TMA", False)
    assert not A._tma(q, k, v)
    assert not A._tma(q128, k128, v128)


@requires_cuda
@pytest.mark.parametrize("causal", [False, True])
def test_tma_large_cuda(monkeypatch, causal):
    """bf16 at the benchmarks' sizes, padded keys: the TMA kernels against the pointer kernels."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs Hopper or later")
    q, k, v = make_qkv(2, 4, 1000, 1000, 128, dtype=torch.bfloat16, layout="fused")
    kw = dict(causal=causal, key_lengths=torch.tensor([1000, 517], device="cuda"))
    outs = []
    for tma in (True, False):
        monkeypatch.setattr(A, "TMA", tma)
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = attention(qq, kk, vv, **kw)
        torch.manual_seed(0)
        outs.append((out, *torch.autograd.grad(out, (qq, kk, vv), torch.randn_like(out))))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
