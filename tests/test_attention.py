"""Triton flash attention (kernels/attention.py) against `scratchformer.reference.attention_ref`.

Runs on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1), where the kernels
use fixed 16×16 tiles, so the ragged lengths 1, 7, 33, 100 exercise partial tiles, skipped key
blocks and empty rows. bf16 runs here too, but with its tiles upcast to fp32 before tl.dot
(`_common.upcast_dot`: Triton 3.9's interpreter gets bf16 dots wrong); native bf16 dots are
covered only by the `requires_cuda` cases at the end (skipped without a GPU).
"""

import math

import pytest
import torch
from conftest import DEVICE, report_diff, requires_cuda

from scratchformer import ops
from scratchformer.kernels import attention as A
from scratchformer.kernels.attention import attention
from scratchformer.reference import attention_mask, attention_ref

LENGTHS = (1, 7, 33, 100)  # a single row, less than a tile, a tile + 1, many tiles + a partial one


def make_qkv(B, H, Lq, Lk, D, dtype=torch.float32, layout="contiguous", device=DEVICE):
    """q (B, H, Lq, D), k, v (B, H, Lk, D) in one of three memory layouts:
    - contiguous: plain (B, H, L, D);
    - fused: the model's views, q/k/v = x[:, :, i].transpose(1, 2) of a fused projection
      x (B, L, 3, H, D) (self-attention), or q from (B, Lq, H, D) and k/v from (B, Lk, 2, H, D);
    - strided_d: head dim not unit-stride ((B, H, D, L) memory, transposed)."""
    if layout == "contiguous":
        q, k, v = (torch.randn(B, H, L, D, dtype=dtype, device=device) for L in (Lq, Lk, Lk))
    elif layout == "fused" and Lq == Lk:
        x = torch.randn(B, Lq, 3, H, D, dtype=dtype, device=device)
        q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    elif layout == "fused":
        xq = torch.randn(B, Lq, H, D, dtype=dtype, device=device)
        xkv = torch.randn(B, Lk, 2, H, D, dtype=dtype, device=device)
        q, k, v = xq.transpose(1, 2), xkv[:, :, 0].transpose(1, 2), xkv[:, :, 1].transpose(1, 2)
    elif layout == "strided_d":
        q, k, v = (torch.randn(B, H, D, L, dtype=dtype, device=device).transpose(2, 3) for L in (Lq, Lk, Lk))
    else:
        raise ValueError(layout)
    return [t.requires_grad_() if t.is_leaf else t for t in (q, k, v)]


def leaves(q, k, v):
    """The tensors to differentiate: q, k, v may be views of a shared leaf (fused layout)."""
    return [t if t.is_leaf else t.detach().requires_grad_() for t in (q, k, v)]


def run_both(q, k, v, **kw):
    """Ours and the reference on the same inputs: (out, lse, grads) each, one shared dO."""
    q, k, v = leaves(q, k, v)
    out, lse = attention(q, k, v, return_lse=True, **kw)
    ref_kw = {k_: v_ for k_, v_ in kw.items() if k_ != "seed"}
    ref, ref_lse = attention_ref(q, k, v, return_lse=True, **ref_kw)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    return (out, lse, grads), (ref, ref_lse, ref_grads)


def assert_lse_equal(lse, ref_lse, atol):
    """-inf exactly where the reference has it (rows with no visible key), close elsewhere."""
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    if finite.any():
        assert report_diff("lse", lse[finite], ref_lse[finite]) <= atol


def assert_matches_fp32(ours, ref, atol_out=1e-4, atol_grad=2e-4):
    (out, lse, grads), (r_out, r_lse, r_grads) = ours, ref
    assert not out.isnan().any() and all(not g.isnan().any() for g in grads)
    torch.testing.assert_close(out, r_out, atol=atol_out, rtol=atol_out)
    report_diff("out", out, r_out)
    assert_lse_equal(lse, r_lse, atol_out)
    for name, g, rg in zip("qkv", grads, r_grads):
        report_diff(f"d{name}", g, rg)
        torch.testing.assert_close(g, rg, atol=atol_grad, rtol=atol_grad)


# ---------------------------------------------------------------------------------------------
# fp32: outputs, lse and gradients over the length grid (D = 32) and a few cases per head dim
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lk", LENGTHS)
@pytest.mark.parametrize("Lq", LENGTHS)  # Lq == Lk self-attention, the rest cross / KV-cache
def test_attention_dense_fp32(Lq, Lk, causal):
    q, k, v = make_qkv(1, 2, Lq, Lk, 32)
    assert_matches_fp32(*run_both(q, k, v, causal=causal))


@pytest.mark.parametrize("shift", range(-17, 18))
def test_attention_causal_diagonal_offsets(shift):
    """Every offset of the causal diagonal (Lk - Lq) modulo the 16-wide interpreter tiles, so the
    split between unmasked and masked blocks is checked at each boundary in all three kernels."""
    Lq = 24
    q, k, v = make_qkv(1, 1, Lq, Lq + shift, 16)
    assert_matches_fp32(*run_both(q, k, v, causal=True))


# key length 0 and 1 (a sequence of one token), a fully padded query sequence, lengths that end
# mid-tile (17 of 33) and lengths equal to L (no padding for that batch element).
PADDING = {
    "keys": lambda Lq, Lk: dict(key_lengths=torch.tensor([Lk, 1, 0])),
    "queries": lambda Lq, Lk: dict(query_lengths=torch.tensor([Lq, 1, 0])),
    "both": lambda Lq, Lk: dict(
        key_lengths=torch.tensor([(Lk + 1) // 2, Lk, 1], dtype=torch.int32),
        query_lengths=torch.tensor([(Lq + 1) // 2, 0, Lq], dtype=torch.int32),
    ),
}


@pytest.mark.parametrize("padding", list(PADDING))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq, Lk", [(1, 1), (7, 33), (33, 7), (33, 33), (100, 100), (1, 100)])
def test_attention_padded_fp32(Lq, Lk, causal, padding):
    q, k, v = make_qkv(3, 2, Lq, Lk, 32)
    lengths = {n: t.to(DEVICE) for n, t in PADDING[padding](Lq, Lk).items()}
    assert_matches_fp32(*run_both(q, k, v, causal=causal, **lengths))


@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize(
    "Lq, Lk, causal, padded",
    [(33, 33, True, False), (7, 100, False, True), (100, 7, True, True)],  # self, cross, Lq > Lk
)
def test_attention_head_dims_fp32(D, Lq, Lk, causal, padded):
    q, k, v = make_qkv(2, 1, Lq, Lk, D)
    kw = dict(key_lengths=torch.tensor([Lk, Lk // 2 + 1], device=DEVICE)) if padded else {}
    assert_matches_fp32(*run_both(q, k, v, causal=causal, **kw))


@pytest.mark.parametrize("layout", ["fused", "strided_d"])
@pytest.mark.parametrize("Lq, Lk", [(33, 33), (7, 33)])
def test_attention_noncontiguous(Lq, Lk, layout):
    """The model's fused-QKV views (no copies) and a non-unit head-dim stride; an explicit scale."""
    q, k, v = make_qkv(2, 3, Lq, Lk, 32, layout=layout)
    assert not q.is_contiguous() and not k.is_contiguous()
    ours, ref = run_both(q, k, v, causal=True, scale=0.3, key_lengths=torch.tensor([Lk, 5], device=DEVICE))
    assert_matches_fp32(ours, ref)


def test_q_k_and_v_each_in_their_own_layout():
    """Each of q, k, v is read through its own strides: k with a non-unit head-dim stride, v a view
    into a fused (B, Lk, 2, H, D) tensor, q plain; the model's q, k, v always share one layout, so a
    kernel reading v with k's strides (or the reverse) went unnoticed there."""
    B, H, Lq, Lk, D = 2, 3, 19, 37, 32
    q = torch.randn(B, H, Lq, D, device=DEVICE)
    k = torch.randn(B, H, D, Lk, device=DEVICE).transpose(2, 3)
    v = torch.randn(B, Lk, 2, H, D, device=DEVICE)[:, :, 1].transpose(1, 2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert len({q.stride(), k.stride(), v.stride()}) == 3
    ours, ref = run_both(q, k, v, causal=True, key_lengths=torch.tensor([Lk, 23], device=DEVICE))
    assert_matches_fp32(ours, ref)


@pytest.mark.parametrize("scale", [0.0, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_scale_edges(scale, causal):
    """The forward's unmasked blocks take each row's maximum before scaling (one FMA an element):
    a scale of 0 (uniform weights over the visible keys) and a sharp one match the reference, in
    the unmasked blocks (Lk 48 = three full 16-key tiles) and the masked ones (causal, a short key)."""
    q, k, v = make_qkv(2, 2, 40, 48, 16)
    assert_matches_fp32(*run_both(q, k, v, causal=causal, scale=scale,
                                  key_lengths=torch.tensor([48, 21], device=DEVICE)))


def test_large_scores_give_the_reference_softmax():
    """Scores far from 0 (raw row maxima ~450, ~80 at the default scale): the online softmax
    offsets each block by the row's running maximum of the *scaled* scores, which in the unmasked
    blocks is taken on the raw scores and scaled once. Offset by anything else (the raw maximum:
    every exp2 underflows, l = 0) a row came out 0 and its lse -inf, not the reference's sharp softmax."""
    B, H, Lq, Lk, D = 1, 2, 20, 41, 32  # Lk: two full 16-key tiles (unmasked) and a partial one
    q, k, v = make_qkv(B, H, Lq, Lk, D)
    with torch.no_grad():
        q *= 6.0
        k *= 6.0  # raw scores ~ 36·N(0, 32): row maxima ~ 450, scaled by 1/sqrt(32) ~ 80
    (out, lse, grads), (ref, ref_lse, ref_grads) = run_both(q, k, v)
    assert ref_lse.min() > 20  # every row's scores are far from 0: the case tests something
    assert not out.isnan().any() and all(not g.isnan().any() for g in grads)
    assert report_diff("out", out, ref) < 1e-3
    assert report_diff("lse", lse, ref_lse) < 1e-3


def test_attention_output_layout():
    """out is (B, H, Lq, D) over (B, Lq, H, D) memory: the model's transpose + reshape is free."""
    B, H, Lq, Lk, D = 2, 3, 7, 33, 16
    q, k, v = make_qkv(B, H, Lq, Lk, D, layout="fused")
    out = attention(q, k, v)
    assert out.shape == (B, H, Lq, D) and out.dtype == q.dtype
    assert out.transpose(1, 2).is_contiguous()
    q, k, v = leaves(q, k, v)
    grads = torch.autograd.grad(attention(q, k, v), (q, k, v), torch.randn(B, H, Lq, D, device=q.device))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def _einsum_attention(q, k, v, key_lengths, query_lengths, causal, scale):
    """Independent formulation in float64: per-batch loops, explicit allowed matrix, -inf fill."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    out = torch.zeros(B, H, Lq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        allowed = torch.zeros(Lq, Lk, dtype=torch.bool, device=q.device)
        allowed[: int(query_lengths[b]), : int(key_lengths[b])] = True
        if causal:
            pos_k, pos_q = torch.arange(Lk, device=q.device), torch.arange(Lq, device=q.device)
            allowed &= pos_k[None, :] <= pos_q[:, None] + (Lk - Lq)
        s = torch.einsum("hqd,hkd->hqk", q[b].double(), k[b].double()) * scale
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
        out[b] = torch.einsum("hqk,hkd->hqd", p, v[b].double())
    return out


def test_attention_matches_einsum():
    """attention_ref alone would check the kernel against the eager backend's own formulation."""
    q, k, v = make_qkv(3, 2, 33, 40, 32)
    kl, ql = torch.tensor([40, 17, 0], device=DEVICE), torch.tensor([33, 20, 5], device=DEVICE)
    q, k, v = leaves(q, k, v)
    out = attention(q, k, v, key_lengths=kl, query_lengths=ql, causal=True, scale=0.2)
    ref = _einsum_attention(q.detach(), k.detach(), v.detach(), kl, ql, True, 0.2)
    assert report_diff("out vs einsum", out, ref) < 1e-5
    # gradients of the same float64 formulation, through autograd on a double copy
    g = torch.randn_like(out)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(_einsum_attention(qd, kd, vd, kl, ql, True, 0.2), (qd, kd, vd), g.double())
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), g), ref_grads):
        assert report_diff(f"d{name} vs einsum", a, b) < 1e-5


# ---------------------------------------------------------------------------------------------
# padding semantics
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_padded_rows_and_keys_are_zero(causal):
    """Query rows at/after query_lengths: exact zeros, zero dQ; keys at/after key_lengths: zero
    dK, dV; rows with no visible key (length 0, or causal rows before the first key): 0, no NaN."""
    B, H, Lq, Lk = 3, 2, 40, 20  # Lq > Lk: with causal, rows 0..19 see no key
    q, k, v = leaves(*make_qkv(B, H, Lq, Lk, 16))
    kl = torch.tensor([20, 3, 0], device=DEVICE)
    ql = torch.tensor([40, 33, 17], device=DEVICE)
    out, lse = attention(q, k, v, key_lengths=kl, query_lengths=ql, causal=causal, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for t in (out, lse.nan_to_num(neginf=0.0), dq, dk, dv):
        assert not t.isnan().any()
    for b in range(B):
        assert torch.all(out[b, :, ql[b]:] == 0) and torch.all(dq[b, :, ql[b]:] == 0)
        assert torch.all(torch.isneginf(lse[b, :, ql[b]:]))
        assert torch.all(dk[b, :, kl[b]:] == 0) and torch.all(dv[b, :, kl[b]:] == 0)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))  # key length 0
    if causal:
        assert torch.all(out[:, :, : Lq - Lk] == 0)


def test_padded_keys_are_never_read():
    """Keys/values past key_lengths hold NaN: blocks past the length are outside the loop bounds
    and the straddling block loads with a mask, so nothing of them reaches out or dQ, dK, dV."""
    q, k, v = leaves(*make_qkv(2, 2, 33, 40, 16))
    kl = torch.tensor([17, 33], device=DEVICE)
    k_nan, v_nan = k.detach().clone(), v.detach().clone()
    for b in range(2):
        k_nan[b, :, kl[b]:] = float("nan")
        v_nan[b, :, kl[b]:] = float("nan")
    k_nan.requires_grad_()
    v_nan.requires_grad_()
    out = attention(q, k_nan, v_nan, key_lengths=kl, causal=True)
    ref = attention_ref(q, k, v, key_lengths=kl, causal=True)
    g = torch.randn_like(out)
    assert report_diff("out", out, ref) < 1e-5
    for a, b in zip(torch.autograd.grad(out, (q, k_nan, v_nan), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert not a.isnan().any() and report_diff("grad", a, b) < 1e-5


def test_the_reference_never_reads_padding_either():
    """eager, the spec, reads no row past the lengths either: NaN in q past query_lengths and in k, v
    past key_lengths reach none of out, lse, dq, dk, dv, which equal those of finite padding (a masked
    score's zero gradient times the NaN q, and a zero probability times a NaN v, were NaN)."""
    q, k, v = (t.detach() for t in make_qkv(2, 2, 20, 24, 16))
    ql, kl = torch.tensor([13, 20], device=DEVICE), torch.tensor([17, 24], device=DEVICE)
    poisoned = [t.clone() for t in (q, k, v)]
    for b in range(2):
        poisoned[0][b, :, ql[b]:] = float("nan")
        poisoned[1][b, :, kl[b]:] = float("nan")
        poisoned[2][b, :, kl[b]:] = float("inf")
    runs = []
    for inputs in ((q, k, v), poisoned):
        inputs = [t.clone().requires_grad_() for t in inputs]
        out, lse = attention_ref(*inputs, key_lengths=kl, query_lengths=ql, causal=True, return_lse=True)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out)
        runs.append([out, lse, *torch.autograd.grad(out, inputs, g)])
    for name, clean, got in zip(("out", "lse", "dq", "dk", "dv"), *runs):
        torch.testing.assert_close(got, clean, rtol=0, atol=0, equal_nan=True, msg=name)
        assert not got.isnan().any(), name


@pytest.mark.parametrize("poison", ["nan query", "inf key", "inf key, mixed-sign query"])
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")  # the interpreter's inf · 0
def test_a_non_finite_score_makes_its_row_nan_as_in_the_reference_never_zero(poison):
    """A NaN score (a NaN in q; an infinite key: the row's max is inf, and inf - inf is NaN) makes its
    row NaN in out and lse exactly where the reference's softmax does (the epilogue used to test
    l > 0, which a NaN l fails, so such a row came out a quiet 0 and hid the NaN from the next layer).
    In the gradients the NaN reaches at least that row's dq and the dk, dv of the keys it sees; dq and
    dv nothing the reference keeps finite (dk may be NaN at a hidden key of the row's tile: its dS is
    0 · the row's NaN δ; the reference spreads the NaN further, to the dv of every key). A NaN in a
    row past query_lengths is never read: that row's out and dq are 0, no gradient takes it in."""
    B, H, L = 2, 2, 24
    q, k, v = (t.detach().clone() for t in make_qkv(B, H, L, L, 16))  # leaves: poisoned in place
    if poison == "nan query":
        q[0, 1, 5, 3] = float("nan")
        q[1, 0, 20, 0] = float("nan")  # past query_lengths[1]
    else:
        k[0, 0, 7] = float("inf")
        if poison == "inf key, mixed-sign query":
            q[0, 0, :, 0] = -q[0, 0, :, 1].abs()  # some scores -inf + inf = NaN, others -inf
    lengths = dict(key_lengths=torch.tensor([L, 11], device=DEVICE), query_lengths=torch.tensor([L, 19], device=DEVICE))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    (out, lse, grads), (ref, ref_lse, ref_grads) = run_both(q, k, v, causal=True, **lengths)
    nan_rows = ref.isnan().any(-1)  # (B, H, L)
    assert nan_rows.any()  # the poison reaches the reference: the case tests something
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan())
    seen = (nan_rows[..., None] & attention_mask(B, L, L, causal=True, **lengths, device=DEVICE)).any(-2)
    for name, ours, theirs, least in (("out", out, ref, nan_rows),
                                      *zip(("dq", "dk", "dv"), grads, ref_grads, (nan_rows, seen, seen))):
        nan = ours.isnan()
        assert nan.any(-1)[least].all() and (name == "dk" or not (nan & ~theirs.isnan()).any())
        finite = ~nan & ~theirs.isnan() & ~theirs.isinf()
        assert report_diff("finite", ours[finite], theirs[finite]) < 1e-4
    assert torch.all(out[1, :, 19:] == 0) and torch.all(grads[0][1, :, 19:] == 0)


# ---------------------------------------------------------------------------------------------
# fp16 / bf16: flash-attention's rule
# ---------------------------------------------------------------------------------------------


def _lowp_eager(q, k, v, *, key_lengths=None, query_lengths=None, causal=False, scale=None):
    """The eager path a PyTorch user writes in the low dtype: matmuls in q's dtype, softmax in
    fp32 cast back. Its error vs the fp32 reference is the yardstick for ours."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    mask = attention_mask(
        B, Lq, Lk, key_lengths=key_lengths, query_lengths=query_lengths, causal=causal, device=q.device
    )
    s = s.float()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0).to(q.dtype)
    return torch.matmul(p, v)


def _check_lowp(q, k, v, g, atol, **kw):
    """Ours in q's dtype (out, dq, dk, dv for the upstream gradient g): each error vs an fp32
    reference <= 2x the low-precision eager path's error (`_lowp_eager`) + atol."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q32, k32, v32, **kw)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    base = _lowp_eager(q, k, v, **kw)
    base_grads = torch.autograd.grad(base, (q, k, v), g)
    out = attention(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), g)
    assert out.dtype == q.dtype and all(t.dtype == q.dtype for t in grads)
    rows = [("out", out, base, ref), *zip(["dq", "dk", "dv"], grads, base_grads, ref_grads, strict=True)]
    for name, ours, lowp, r in rows:
        err = report_diff(f"{name} ours", ours, r)
        base_err = report_diff(f"{name} eager {q.dtype}", lowp, r)
        assert err <= 2 * base_err + atol, f"{name}: {err} > 2 * {base_err} + {atol}"


# Why these atols: the rule compares max errors, which can both be ~0 for tiny cases (Lk = 1
# returns v exactly) while ours still rounds once on store; atol is one rounding of an O(1)
# value: 2^-10 for fp16, 2^-7 for bf16 (output and gradients are O(1) with randn inputs).
def test_launch_grids_fit_cuda_with_many_batch_rows_and_heads(monkeypatch):
    """B·H = 65,536 (1,024 sentences x beam 4 x 16 heads): every attention launch's grid puts it on
    CUDA's first axis (limit 2³¹ - 1), never on the others (65,535), where the launch failed with
    CUDA's "invalid argument". The launches are recorded, not run: the interpreter has no such limit.
    Each grid is one program a (row block, batch x head) pair, as `_program` reads it."""
    grids = []

    def record(kernel, grid, key, *args, **kwargs):
        grids.append(grid({"BLOCK_M": 16, "BLOCK_N": 16}))

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(A, "launch_tuned", record)
    monkeypatch.setattr(A, "_attention_bwd_preprocess_kernel", Recorder())
    monkeypatch.setattr(A, "_dropout_mask_kernel", Recorder())
    B, H, L = 4096, 16, 20
    q = torch.zeros(B, H, L, 16, requires_grad=True)
    out, lse = A.attention_fwd(q, q, q)
    A.attention_bwd(torch.zeros_like(out), q, q, q, out, lse)
    A.dropout_mask(B, H, L, L, 0.1, torch.zeros(2, dtype=torch.int64), "cpu")
    assert len(grids) == 5
    assert all(g[0] < 2**31 and all(n <= 65535 for n in g[1:]) for g in grids), grids
    tiles, rows64 = math.ceil(L / 16) * B * H, math.ceil(L / 64) * B * H  # the configs' 16 rows; 64 rows
    # forward, δ and lse2, dK/dV, dQ, and the debug path's mask (key blocks on axis 1)
    assert grids == [(tiles,), (rows64,), (tiles,), (tiles,), (rows64, 1)], grids


LOWP = [(torch.float16, 2**-10), (torch.bfloat16, 2**-7)]


@pytest.mark.parametrize("dtype, atol", LOWP, ids=["fp16", "bf16_upcast"])
@pytest.mark.parametrize(
    "Lq, Lk, causal, padded, D",
    [(33, 33, True, False, 32), (7, 100, False, True, 64), (100, 33, True, True, 16), (33, 33, False, True, 128)],
)
def test_attention_low_precision(dtype, atol, Lq, Lk, causal, padded, D):
    """Our error vs an fp32 reference <= 2x the low-precision eager path's error + atol (under
    the interpreter bf16 runs with the UPCAST flag, see the module docstring)."""
    q, k, v = leaves(*make_qkv(2, 2, Lq, Lk, D, dtype=dtype))
    kw = dict(causal=causal)
    if padded:
        kw.update(key_lengths=torch.tensor([Lk, 3], device=DEVICE),
                  query_lengths=torch.tensor([Lq - 2, Lq], device=DEVICE))
    _check_lowp(q, k, v, torch.randn(2, 2, Lq, D, dtype=dtype, device=DEVICE), atol, **kw)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------


def test_dropout_reproducible():
    q, k, v = make_qkv(2, 2, 33, 33, 16)
    out1, m1 = attention(q, k, v, dropout_p=0.3, seed=123, return_dropout_mask=True)
    out2, m2 = attention(q, k, v, dropout_p=0.3, seed=123, return_dropout_mask=True)
    out3, m3 = attention(q, k, v, dropout_p=0.3, seed=124, return_dropout_mask=True)
    assert m1.shape == (2, 2, 33, 33) and m1.dtype == torch.bool
    assert torch.equal(out1, out2) and torch.equal(m1, m2)
    assert not torch.equal(m1, m3) and not torch.equal(out1, out3)
    torch.manual_seed(7)  # no seed: drawn from torch's generator
    out4 = attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    assert torch.equal(out4, attention(q, k, v, dropout_p=0.3))


def test_dropout_keep_rate():
    """Keep rate within 4 sigma of 1 - p over 4·100·100 Bernoulli draws; masks of different
    heads differ (the counter includes b and h)."""
    p = 0.3
    _, mask = attention(*make_qkv(2, 2, 100, 100, 16), dropout_p=p, seed=5, return_dropout_mask=True)
    n = mask.numel()
    rate = mask.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    print(f"keep rate {rate:.4f}, expected {1 - p}, sigma {sigma:.4f}")
    assert abs(rate - (1 - p)) < 4 * sigma
    assert not torch.equal(mask[0, 0], mask[0, 1]) and not torch.equal(mask[0, 0], mask[1, 0])


@pytest.mark.parametrize(
    "Lq, Lk, causal, padded", [(33, 33, False, False), (7, 40, True, True), (40, 17, True, True)]
)
def test_dropout_matches_ref_with_mask(Lq, Lk, causal, padded):
    """Forward and backward regenerate one mask: both equal attention_ref fed that mask."""
    p = 0.2
    q, k, v = leaves(*make_qkv(2, 2, Lq, Lk, 32))
    kw = dict(causal=causal, dropout_p=p)
    if padded:
        kw.update(key_lengths=torch.tensor([Lk, 5], device=DEVICE),
                  query_lengths=torch.tensor([Lq - 1, 3], device=DEVICE))
    out, lse, mask = attention(q, k, v, seed=11, return_lse=True, return_dropout_mask=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, dropout_mask=mask, return_lse=True, **kw)
    g = torch.randn_like(out)
    assert_matches_fp32(
        (out, lse, torch.autograd.grad(out, (q, k, v), g)),
        (ref, ref_lse, torch.autograd.grad(ref, (q, k, v), g)),
    )


def test_dropout_with_a_drawn_stream_matches_ref_with_its_mask():
    """Without a seed the stream's counter offset is drawn (a given seed has offset 0): forward and
    both backward kernels must add it to their counters, as the debug mask does, or their masks
    disagree with each other."""
    B, H, Lq, Lk, D = 2, 3, 18, 35, 32
    q, k, v = leaves(*make_qkv(B, H, Lq, Lk, D))
    kw = dict(causal=True, dropout_p=0.25, key_lengths=torch.tensor([Lk, 20], device=DEVICE),
              query_lengths=torch.tensor([Lq, 11], device=DEVICE))
    torch.manual_seed(3)
    out, lse, mask = attention(q, k, v, return_lse=True, return_dropout_mask=True, **kw)
    ref, ref_lse = attention_ref(q, k, v, dropout_mask=mask, return_lse=True, **kw)
    g = torch.randn_like(out)
    assert_matches_fp32(
        (out, lse, torch.autograd.grad(out, (q, k, v), g)),
        (ref, ref_lse, torch.autograd.grad(ref, (q, k, v), g)),
    )


# ---------------------------------------------------------------------------------------------
# bad input: clear ValueErrors from the launcher
# ---------------------------------------------------------------------------------------------


def _bad(**changes):
    q, k, v = (torch.randn(2, 2, 8, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16))
    kw = {}
    for name, value in changes.items():
        if name in ("q", "k", "v"):
            q, k, v = [value if n == name else t for n, t in zip("qkv", (q, k, v))]
        else:
            kw[name] = value
    return (q, k, v), kw


BAD = {
    "k shape": (_bad(k=torch.randn(2, 2, 9, 32)), r"shape mismatch"),
    "v shape": (_bad(v=torch.randn(2, 2, 8, 16)), r"shape mismatch"),
    "batch": (_bad(q=torch.randn(3, 2, 8, 16)), r"shape mismatch"),
    "ndim": (_bad(q=torch.randn(2, 8, 16)), r"q must be \(B, H, L, D\), got shape \(2, 8, 16\)"),
    "dtype mix": (_bad(v=torch.randn(2, 2, 9, 16, dtype=torch.float16)), r"dtype mismatch"),
    "dtype": (
        _bad(q=torch.randn(2, 2, 8, 16).double(), k=torch.randn(2, 2, 9, 16).double(),
             v=torch.randn(2, 2, 9, 16).double()),
        r"float64",
    ),
    "device": (_bad(v=torch.empty(2, 2, 9, 16, device="meta")), r"different devices"),
    "head dim": (
        _bad(q=torch.randn(2, 2, 8, 80), k=torch.randn(2, 2, 9, 80), v=torch.randn(2, 2, 9, 80)),
        r"head_dim must be 16, 32, 64 or 128, got 80",
    ),
    "key len high": (_bad(key_lengths=torch.tensor([9, 10])), r"key_lengths must lie in \[0, 9\], got min 9 max 10"),
    "key len negative": (_bad(key_lengths=torch.tensor([-1, 3])), r"key_lengths must lie in \[0, 9\], got min -1"),
    "query len high": (_bad(query_lengths=torch.tensor([9, 1])), r"query_lengths must lie in \[0, 8\]"),
    "lengths dtype": (
        _bad(key_lengths=torch.tensor([9.0, 1.0])), r"key_lengths must be int32 or int64, got torch.float32"
    ),
    "lengths shape": (_bad(key_lengths=torch.tensor([9, 1, 2])), r"key_lengths must have shape \(2,\), got \(3,\)"),
    # the device check read .device of every argument first: AttributeError 'list' object has no attribute 'device'
    "lengths list": (_bad(key_lengths=[9, 1]), r"attention: key_lengths must be a tensor, got list"),
    "query lengths int": (_bad(query_lengths=8), r"attention: query_lengths must be a tensor, got int"),
    "dropout": (_bad(dropout_p=1.0), r"dropout_p must be in \[0, 1\), got 1.0"),
    "scale negative": (_bad(scale=-0.5), r"scale must be a finite number >= 0, got -0.5"),
    "scale nan": (_bad(scale=float("nan")), r"scale must be a finite number >= 0, got nan"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises(case, monkeypatch):
    """Each bad input on the test device (the meta tensor of "device" stays), with the length checks
    on: a GPU reads lengths back only with SCRATCHFORMER_DEBUG=1 (the next test)."""
    monkeypatch.setattr(A, "_DEBUG", True)
    ((q, k, v), kw), match = BAD[case]

    def on_device(t):
        return t.to(DEVICE) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t

    q, k, v = map(on_device, (q, k, v))
    kw = {name: on_device(value) for name, value in kw.items()}
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kw)


def test_out_of_range_lengths_are_clamped_by_the_kernels_on_every_device(monkeypatch):
    """Where the lengths are not read back (a GPU without SCRATCHFORMER_DEBUG, emulated here by
    turning the value check off), the kernels clamp them to [0, L]: a key or query length past L
    reads no row past L (here NaN rows of the larger buffers q, k and v are views of), a negative
    one masks everything. Forward and gradients as the reference's, where that is what such
    lengths mean."""
    monkeypatch.setattr(A, "value_checks", lambda t: False)
    B, H, Lq, Lk, D = 3, 2, 21, 26, 16
    bufs = [torch.randn(B, H, L + 40, D, device=DEVICE) for L in (Lq, Lk, Lk)]
    for buf, L in zip(bufs, (Lq, Lk, Lk)):
        buf[:, :, L:] = float("nan")
    q, k, v = (buf[:, :, :L].detach().requires_grad_() for buf, L in zip(bufs, (Lq, Lk, Lk)))
    kl, ql = torch.tensor([Lk + 30, -4, 9], device=DEVICE), torch.tensor([Lq + 30, 7, -1], device=DEVICE)
    for causal in (False, True):
        ours, ref = run_both(q, k, v, causal=causal, key_lengths=kl, query_lengths=ql)
        assert_matches_fp32(ours, ref)


def test_strided_lengths_are_read_by_their_values():
    """Lengths given as a strided view (every other element of a longer tensor) mean their values: the
    kernels read lengths at unit stride, so they get a contiguous copy."""
    B, H, Lq, Lk, D = 3, 2, 21, 26, 16
    q, k, v = make_qkv(B, H, Lq, Lk, D)
    kl = torch.tensor([Lk, 0, 9, 0, 17, 0], device=DEVICE)[::2]
    ql = torch.tensor([5, 0, Lq, 0, 12, 0], device=DEVICE)[::2]
    assert not kl.is_contiguous() and not ql.is_contiguous()
    assert_matches_fp32(*run_both(q, k, v, causal=True, key_lengths=kl, query_lengths=ql))


@requires_cuda
def test_cuda_lengths_are_clamped_without_a_sync_unless_debugging(monkeypatch):
    """On a GPU the lengths' range is not read back (a host sync per call) unless
    SCRATCHFORMER_DEBUG=1: out-of-range lengths are clamped to [0, L], which is eager's meaning
    (lengths past L mask nothing, negative ones everything) and keeps the kernels in bounds."""
    q, k, v = (torch.randn(2, 2, 8, 16, device="cuda") for _ in range(3))
    monkeypatch.setattr(A, "_DEBUG", False)
    out = attention(q, k, v, key_lengths=torch.tensor([12, -3], device="cuda"))
    ref = attention_ref(q, k, v, key_lengths=torch.tensor([8, 0], device="cuda"))
    assert report_diff("clamped lengths", out, ref) < 1e-5
    monkeypatch.setattr(A, "_DEBUG", True)
    with pytest.raises(ValueError, match=r"key_lengths must lie in \[0, 8\], got min -3 max 12"):
        attention(q, k, v, key_lengths=torch.tensor([12, -3], device="cuda"))


# ---------------------------------------------------------------------------------------------
# through the backend switch
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_ops_triton_matches_eager(causal):
    q, k, v = leaves(*make_qkv(2, 2, 7, 33, 32, layout="fused"))
    pad = torch.arange(33, device=DEVICE)[None, :] >= torch.tensor([33, 12], device=DEVICE)[:, None]
    kw = dict(key_lengths=ops.key_padding_mask_to_lengths(pad), causal=causal)
    ours = ops.select("triton", DEVICE).attention(q, k, v, **kw)
    ref = ops.select("eager", DEVICE).attention(q, k, v, **kw)
    g = torch.randn_like(ref)
    assert report_diff("ops out", ours, ref) < 1e-4
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert report_diff("ops grad", a, b) < 2e-4


# ---------------------------------------------------------------------------------------------
# GPU only (skipped here): native bf16 dots, autotuned tiles, realistic sizes
# ---------------------------------------------------------------------------------------------


@requires_cuda
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq, Lk, D", [(1024, 1024, 64), (1000, 1000, 128), (127, 2049, 64), (513, 255, 128)])
def test_attention_large_cuda(Lq, Lk, D, causal, dtype, atol):
    q, k, v = leaves(*make_qkv(2, 4, Lq, Lk, D, dtype=dtype, layout="fused", device="cuda"))
    kw = dict(causal=causal, key_lengths=torch.tensor([Lk, Lk // 3 + 1], device="cuda"))
    _check_lowp(q, k, v, torch.randn(2, 4, Lq, D, dtype=dtype, device="cuda"), atol, **kw)


@requires_cuda
def test_dropout_large_cuda():
    q, k, v = leaves(*make_qkv(2, 4, 1024, 1024, 64, dtype=torch.bfloat16, device="cuda"))
    out, mask = attention(q, k, v, causal=True, dropout_p=0.1, seed=3, return_dropout_mask=True)
    ref = attention_ref(q, k, v, causal=True, dropout_p=0.1, dropout_mask=mask)
    assert report_diff("dropout out", out, ref) < 2e-2


# The configs ptxas spilled hundreds of bytes for (sm_90, Triton 3.6, bf16; `tools/compile_check.py`'s
# report), as (BLOCK_M, BLOCK_N, warps), each at 2 and 3 stages; every other candidate at these head
# dims spilled at most 168 bytes.
SPILLED = {
    64: {"dkdv": {(64, 128, 4)}},
    128: {"fwd": {(128, 128, 4)}, "dkdv": {(32, 128, 4), (64, 128, 4)}, "dq": {(128, 64, 4)}},
}


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tuning_candidates_leave_out_the_spilling_configs(head_dim, dtype, monkeypatch):
    """What the GPU's tuner is offered (`_pruner`): every candidate but the ones ptxas spilled
    hundreds of bytes for (SPILLED: over MAX_LIVE_VALUES live values a thread), and for fp32 inputs
    only those whose shared memory fits A100's; never none."""
    monkeypatch.setattr(A, "INTERPRET", False)
    monkeypatch.setattr(A, "AUTOTUNE", True)
    for name in A.TUNING:
        cands = A._configs(name)
        kept = A._pruner(name)(cands, {"q_ptr": torch.empty(0, dtype=dtype)}, HEAD_DIM=head_dim)
        tiles = lambda cs: {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in cs}  # noqa: E731
        assert kept, name
        if dtype == torch.bfloat16:
            assert tiles(cands) - tiles(kept) == SPILLED.get(head_dim, {}).get(name, set()), name
        else:
            assert tiles(kept) <= tiles(cands) - SPILLED.get(head_dim, {}).get(name, set()), name
