"""The backend switch and the eager reference ops: independent formulations, gradcheck, errors."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, report_diff

from scratchformer import _ext, op_checks, ops, reference
from scratchformer.kernels import add_layer_norm, attention, cross_entropy, ffn
from scratchformer.kernels._common import cdiv, check_interpreter_versions, next_pow2

EAGER, TORCH = ops.select("eager"), ops.select("torch")


def _einsum_attention(q, k, v, key_lengths=None, causal=False, scale=None):
    """Independent formulation: explicit loops over the batch, -inf masking, einsum products."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    scale = scale or 1 / math.sqrt(D)
    out = torch.zeros_like(q, dtype=torch.float64)
    for b in range(B):
        n = Lk if key_lengths is None else int(key_lengths[b])
        s = torch.einsum("hqd,hkd->hqk", q[b].double(), k[b].double()) * scale
        allowed = torch.zeros(Lq, Lk, dtype=torch.bool)
        allowed[:, :n] = True
        if causal:
            allowed &= torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
        s = s.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        out[b] = torch.einsum("hqk,hkd->hqd", p, v[b].double())
    return out


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (7, 7), (5, 13), (13, 5)])  # self, cross both ways
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_eager_attention_matches_einsum(Lq, Lk, causal, padded):
    B, H, D = 3, 2, 8
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for L in (Lq, Lk, Lk))
    lengths = torch.tensor([Lk, max(Lk // 2, 1), 0]) if padded else None  # 0: a fully padded row
    ours = reference.attention_ref(q, k, v, key_lengths=lengths, causal=causal)
    ref = _einsum_attention(q, k, v, lengths, causal)
    assert report_diff("attention", ours, ref) < 1e-10
    assert torch.isfinite(ours).all()


def test_attention_lse_and_query_lengths():
    q, k, v = (torch.randn(2, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    ql = torch.tensor([6, 2])
    out, lse = reference.attention_ref(q, k, v, query_lengths=ql, return_lse=True)
    assert (out[1, :, 2:] == 0).all() and torch.isinf(lse[1, :, 2:]).all()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    torch.testing.assert_close(lse[0], torch.logsumexp(s[0], -1))


@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_attention_matches_eager(causal):
    q = torch.randn(3, 2, 7, 16)
    k, v = torch.randn(3, 2, 11, 16), torch.randn(3, 2, 11, 16)
    kl, ql = torch.tensor([11, 4, 0]), torch.tensor([7, 3, 7])
    for kw in (dict(), dict(key_lengths=kl), dict(key_lengths=kl, query_lengths=ql)):
        a = EAGER.attention(q, k, v, causal=causal, **kw)
        b = TORCH.attention(q, k, v, causal=causal, **kw)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_whose_every_score_is_far_below_zero_is_still_the_softmax_of_its_keys(causal):
    """Kept keys scoring -1000, -1001, -1002 (q = -e_0, k_j = (1000 + j) e_0, scale 1), a fourth key
    padded: the output is softmax((0, -1, -2)) v = (1, e^-1, e^-2) / (1 + e^-1 + e^-2) v, the max
    taken over the kept keys only (a masked score filled with 0 would be the max, and every
    exp(-1000) underflow to 0: a zero output)."""
    q = torch.zeros(1, 1, 1, 2, dtype=torch.float64)
    q[..., 0] = -1.0
    k = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    k[0, 0, :, 0] = torch.tensor([1000.0, 1001.0, 1002.0, -5.0])  # the padded key would score +5
    v = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    w = torch.tensor([1.0, math.exp(-1), math.exp(-2)], dtype=torch.float64)
    want = (w / w.sum()) @ v[0, 0, :3]
    for Lq in (1, 3):  # causal: the last query, at the last position, sees every key
        qq = q.expand(1, 1, Lq, 2)
        out = reference.attention_ref(qq, k, v, key_lengths=torch.tensor([3]), causal=causal, scale=1.0)
        torch.testing.assert_close(out[0, 0, -1], want, rtol=1e-12, atol=1e-12)


def test_key_padding_mask_is_converted_or_refused():
    q = k = v = torch.randn(2, 1, 4, 8)
    mask = torch.tensor([[False, False, True, True], [False, False, False, False]])
    assert torch.equal(ops.key_padding_mask_to_lengths(mask), torch.tensor([2, 4]))
    a = EAGER.attention(q, k, v, key_lengths=ops.key_padding_mask_to_lengths(mask))
    b = EAGER.attention(q, k, v, key_lengths=torch.tensor([2, 4]))
    torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="not right-padded"):
        ops.key_padding_mask_to_lengths(torch.tensor([[True, False, False, False]] * 2))


def test_add_layer_norm_matches_f_layer_norm():
    x, r = torch.randn(5, 7, 48), torch.randn(5, 7, 48)
    w, b = torch.randn(48), torch.randn(48)
    y, s = EAGER.add_layer_norm(x, r, w, b, 1e-5, return_residual=True)
    torch.testing.assert_close(y, F.layer_norm(x + r, (48,), w, b, 1e-5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(TORCH.add_layer_norm(x, r, w, b), y, atol=1e-5, rtol=1e-5)


def test_add_layer_norm_of_a_float64_stream_with_fp32_gains_matches_eager():
    """fp32 weight and bias under a float64 stream, which the checks let (docs/numerics.md): the torch
    backend gave F.layer_norm mixed dtypes, a RuntimeError from inside; now eager's y, s and gradients."""
    x, r = (torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = torch.randn(24, requires_grad=True), torch.randn(24, requires_grad=True)
    runs = []
    for backend in (EAGER, TORCH):
        y, s = backend.add_layer_norm(x, r, w, b, return_residual=True)
        runs.append((y, s, *torch.autograd.grad((y * y).sum() + s.sum(), (x, r, w, b))))
    for name, want, got in zip(("y", "s", "dx", "dr", "dw", "db"), *runs):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ffn_matches_f_linear(activation):
    x = torch.randn(4, 3, 16)
    w1, b1, w2, b2 = torch.randn(40, 16), torch.randn(40), torch.randn(16, 40), torch.randn(16)
    act = F.relu if activation == "relu" else F.gelu
    ref = F.linear(act(F.linear(x, w1, b1)), w2, b2)
    for backend in (EAGER, TORCH):
        torch.testing.assert_close(backend.ffn(x, w1, b1, w2, b2, activation=activation), ref, atol=1e-4, rtol=1e-4)


def test_add_layer_norm_normalises_with_the_eps_it_is_given():
    """eps enters as 1 / sqrt(var + eps): with eps = 1 on rows of variance about 0.01 it dominates,
    as in F.layer_norm with that eps, and differs from the default's result."""
    x, r = 0.1 * torch.randn(4, 16, dtype=torch.float64), 0.1 * torch.randn(4, 16, dtype=torch.float64)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    y = reference.add_layer_norm_ref(x, r, w, b, 1.0)
    torch.testing.assert_close(y, F.layer_norm(x + r, (16,), w, b, 1.0), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y, F.layer_norm(x + r, (16,), w, b, 1e-5))


def test_a_replayed_dropout_mask_scales_what_it_keeps_by_one_over_keep_probability():
    """Inverted dropout (the kernels' masks replayed through the reference): with keep mask m and
    rate p, attention's probabilities P become P m / (1 - p), the FFN's hidden activations
    act(x W1^T + b1) m / (1 - p), add + LayerNorm's sublayer output x m / (1 - p) before the add;
    each against the formula written with F.* ops and softmax in float64."""
    torch.manual_seed(0)
    f64, p = dict(dtype=torch.float64), 0.25
    q, k, v = torch.randn(2, 2, 3, 4, **f64), torch.randn(2, 2, 5, 4, **f64), torch.randn(2, 2, 5, 4, **f64)
    keep = torch.rand(2, 2, 3, 5) > p
    probs = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)  # scale 1/sqrt(4)
    torch.testing.assert_close(reference.attention_ref(q, k, v, dropout_p=p, dropout_mask=keep),
                               (probs * keep / (1 - p)) @ v, rtol=1e-12, atol=1e-12)
    x, w1, b1, w2, b2 = (torch.randn(*s, **f64) for s in ((3, 8), (16, 8), (16,), (8, 16), (8,)))
    keep = torch.rand(3, 16) > p
    torch.testing.assert_close(reference.ffn_ref(x, w1, b1, w2, b2, dropout_p=p, dropout_mask=keep),
                               F.linear(F.relu(F.linear(x, w1, b1)) * keep / (1 - p), w2, b2), rtol=1e-12, atol=1e-12)
    x, r, w, b = torch.randn(3, 8, **f64), torch.randn(3, 8, **f64), torch.randn(8, **f64), torch.randn(8, **f64)
    keep = torch.rand(3, 8) > p
    y, s = reference.add_layer_norm_ref(x, r, w, b, dropout_p=p, dropout_mask=keep, return_residual=True)
    torch.testing.assert_close(s, x * keep / (1 - p) + r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, F.layer_norm(x * keep / (1 - p) + r, (8,), w, b), rtol=1e-12, atol=1e-12)


def test_embed_eager_and_torch_agree():
    tokens = torch.randint(0, 30, (2, 9))
    w = torch.randn(30, 16)
    a = EAGER.embed(tokens, w, scale=4.0, pos_offset=3)
    b = TORCH.embed(tokens, w, scale=4.0, pos_offset=3)
    torch.testing.assert_close(a, b)
    pe = reference.sinusoidal_positions(torch.tensor([3]), 16)[0]
    torch.testing.assert_close(a[0, 0], w[tokens[0, 0]] * 4.0 + pe)
    assert pe[0] == pytest.approx(math.sin(3.0)) and pe[1] == pytest.approx(math.cos(3.0))


@pytest.mark.parametrize("pos_offset", [ops.PE_TABLE_ROWS - 4, ops.PE_TABLE_ROWS - 3, 2**21, 2**29 - 4])
def test_torch_embed_at_a_large_offset_computes_only_its_rows(pos_offset):
    """The torch backend's embedding at pos_offset 2^21 built and cached the whole table from position 0
    (4.7 s, +5.2 GiB; 2^29, which the checks accept, more than the machine has). Past its bounded table it
    computes the call's rows alone: eager's values, and no table is built (within the bound: one, as before)."""
    tokens, w = torch.randint(0, 30, (2, 4)), torch.randn(30, 64)
    ops._pe_table.cache_clear()
    got = TORCH.embed(tokens, w, scale=4.0, pos_offset=pos_offset)
    torch.testing.assert_close(got, EAGER.embed(tokens, w, scale=4.0, pos_offset=pos_offset), rtol=0, atol=0)
    assert ops._pe_table.cache_info().currsize == (pos_offset + 4 <= ops.PE_TABLE_ROWS)


@pytest.mark.parametrize("pos_offset,L", [(1020, 9), (1023, 2), (2040, 20), (4095, 1)])
def test_torch_embed_across_a_power_of_two_reads_whole_rows_of_its_table(pos_offset, L):
    """The cached table has a power of two of rows covering pos_offset + L - 1, the last position: calls
    whose positions cross 1024, 2048 or 4096 get all L rows (eager's values), not a short slice."""
    tokens, w = torch.randint(0, 30, (2, L)), torch.randn(30, 16)
    got = TORCH.embed(tokens, w, scale=2.0, pos_offset=pos_offset)
    torch.testing.assert_close(got, EAGER.embed(tokens, w, scale=2.0, pos_offset=pos_offset))


def test_torch_embed_decoding_steps_share_one_cached_table():
    """The common path stays cached: offset 0, then one position a step (decoding), all from one table."""
    tokens, w = torch.randint(0, 30, (2, 9)), torch.randn(30, 16)
    ops._pe_table.cache_clear()
    TORCH.embed(tokens, w, scale=4.0)
    for step in range(5):
        got = TORCH.embed(tokens[:, step : step + 1], w, scale=4.0, pos_offset=step)
        torch.testing.assert_close(got, EAGER.embed(tokens[:, step : step + 1], w, scale=4.0, pos_offset=step))
    assert ops._pe_table.cache_info().currsize == 1 and ops._pe_table.cache_info().hits == 5


def test_gradcheck_eager_ops_float64():
    d = dict(dtype=torch.float64, requires_grad=True)
    q, k, v = torch.randn(2, 2, 3, 4, **d), torch.randn(2, 2, 5, 4, **d), torch.randn(2, 2, 5, 4, **d)
    kl = torch.tensor([5, 2])
    assert torch.autograd.gradcheck(
        lambda q, k, v: reference.attention_ref(q, k, v, key_lengths=kl, causal=True), (q, k, v))
    x, r, w, b = torch.randn(3, 6, **d), torch.randn(3, 6, **d), torch.randn(6, **d), torch.randn(6, **d)
    assert torch.autograd.gradcheck(lambda *a: reference.add_layer_norm_ref(*a, 1e-5), (x, r, w, b))
    w1, b1, w2, b2 = torch.randn(7, 6, **d), torch.randn(7, **d), torch.randn(6, 7, **d), torch.randn(6, **d)
    for act in ("relu", "gelu"):
        assert torch.autograd.gradcheck(lambda *a, act=act: reference.ffn_ref(*a, activation=act), (x, w1, b1, w2, b2))
    emb = torch.randn(10, 6, **d)
    assert torch.autograd.gradcheck(lambda e: reference.embed_ref(torch.tensor([[1, 3, 3]]), e, scale=2.0), (emb,))


@pytest.mark.parametrize("backend", [EAGER, TORCH], ids=["eager", "torch"])
def test_bad_inputs_name_the_problem(backend):
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-magic'"):
        ops.resolve("cuda-magic")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-magic'"):
        ops.select("cuda-magic")
    with pytest.raises(ValueError, match="dtype mismatch"):
        backend.attention(q, q.double(), q.double())
    with pytest.raises(ValueError, match="shape mismatch"):
        backend.attention(q, torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8))
    with pytest.raises(ValueError, match=r"key_lengths must lie in \[0, 4\]"):
        backend.attention(q, q, q, key_lengths=torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="key_lengths must be an int32/int64 tensor"):
        backend.attention(q, q, q, key_lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="expects q, k, v of shape"):
        backend.attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        backend.attention(q, q, q, dropout_p=1.0)
    for bad in ("0.1", None, True, torch.tensor(0.1)):  # named, not a TypeError from a comparison inside
        with pytest.raises(ValueError, match=r"attention: dropout_p must be a (Python )?number"):
            backend.attention(q, q, q, dropout_p=bad)
        with pytest.raises(ValueError, match=r"linear_cross_entropy: label_smoothing must be a (Python )?number"):
            backend.linear_cross_entropy(q[0, 0], torch.randn(5, 8), None, torch.ones(4, dtype=torch.long),
                                         label_smoothing=bad)
    with pytest.raises(ValueError, match="weight/bias must be"):
        backend.add_layer_norm(q, None, torch.ones(7), None)
    with pytest.raises(ValueError, match="ffn shape mismatch"):
        backend.ffn(q, torch.randn(16, 7), None, torch.randn(8, 16), None)
    with pytest.raises(ValueError, match="activation must be"):
        backend.ffn(q, torch.randn(16, 8), None, torch.randn(8, 16), None, activation="swish")
    with pytest.raises(ValueError, match="tokens must be int32 or int64"):
        backend.embed(torch.zeros(2, 3), torch.randn(5, 4), scale=1.0)


def test_auto_resolves_by_device():
    assert ops.resolve("auto", "cpu") == "eager"
    assert ops.resolve("auto", "cuda") == "triton"
    assert ops.resolve("auto", "meta") == "eager"  # triton on CUDA only: every other device is eager's
    assert ops.resolve("torch", "cpu") == "torch"


def test_autocast_dtype_names_a_cast_only_where_autocast_would_make_one():
    """`autocast_dtype`: autocast's dtype for a float32/16 or bfloat16 tensor in another dtype; None for
    one already in it (no cast to make), for float64 and integer tensors, and with autocast off."""
    f32 = torch.ones(2)
    bf16, f64, i64 = f32.bfloat16(), f32.double(), f32.long()
    assert all(ops.autocast_dtype(t) is None for t in (f32, bf16, f64, i64))  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.autocast_dtype(f32) == torch.bfloat16 and ops.autocast_dtype(f32.half()) == torch.bfloat16
        assert ops.autocast_dtype(bf16) is None and ops.autocast_dtype(f64) is None and ops.autocast_dtype(i64) is None


@pytest.mark.parametrize("kernel,device,name", [
    ("auto", "cpu", "eager"), ("eager", "cpu", "eager"), ("torch", "cpu", "torch"), ("triton", DEVICE, "triton"),
    ("auto", None, "eager"), ("eager", "meta", "eager"), ("torch", "meta", "torch"),
])
def test_select_returns_the_bundle_of_the_backend(kernel, device, name):
    """One bundle per backend: the eager ops wrap the reference, the torch ops PyTorch's fused
    ops, the triton ops our kernels and the C++ embedding; the same bundle each time."""
    chosen = ops.select(kernel, device)
    assert isinstance(chosen, ops.Ops) and chosen.name == name
    assert ops.select(kernel, device) is chosen  # chosen once, not rebuilt per call
    if name == "eager":
        assert chosen.attention.__wrapped__ is reference.attention_ref
        assert chosen.add_layer_norm.__wrapped__ is reference.add_layer_norm_ref
        assert chosen.ffn.__wrapped__ is reference.ffn_ref and chosen.embed.__wrapped__ is reference.embed_ref
    elif name == "torch":
        assert chosen.attention.__wrapped__ is ops._attention_sdpa and chosen.embed.__wrapped__ is ops._embed_torch
    else:
        # the entry points without their checks, which the bundle runs (tests/test_op_checks.py)
        assert chosen.attention.__wrapped__ is attention.attention_trusted
        assert chosen.ffn.__wrapped__ is ffn.ffn_trusted
        assert chosen.add_layer_norm.__wrapped__ is add_layer_norm.add_layer_norm_trusted
        assert chosen.linear_cross_entropy.__wrapped__ is cross_entropy.linear_cross_entropy_trusted
        assert chosen.embed.__wrapped__ is _ext.embed_sinusoidal  # every op behind its ops.py check
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.name = "other"


def test_select_refuses_unknown_backends_and_devices():
    with pytest.raises(ValueError, match=r"unknown kernel backend 'cuda'; choose one of"):
        ops.select("cuda", "cpu")
    with pytest.raises(ValueError, match="the triton backend runs on cuda .* not meta"):
        ops.select("triton", "meta")


def test_select_names_a_missing_extension(monkeypatch):
    """No silent fallback: a triton bundle whose C++ op is not built is refused when selected."""
    monkeypatch.setattr(_ext, "_LOAD_ERROR", "importing scratchformer._C failed: test")
    monkeypatch.setattr(ops, "_triton_ops", ops._triton_ops.__wrapped__)  # bypass the cache
    with pytest.raises(RuntimeError, match=r"extension is not available \(importing scratchformer._C failed: test\)"):
        ops.select("triton", DEVICE)


def test_value_checks_run_on_cpu_and_elsewhere_only_in_debug(monkeypatch):
    """Reading a CUDA tensor's values is a host sync: the lengths' range is checked on CPU, and on
    other devices only under SCRATCHFORMER_DEBUG=1 (a meta tensor cannot be read at all, so it
    shows whether a check tried)."""
    q = torch.empty(2, 2, 4, 8, device="meta")
    bad = torch.tensor([5, 1], device="meta")
    monkeypatch.setattr(op_checks, "DEBUG", False)
    assert op_checks.value_checks(torch.zeros(1)) and not op_checks.value_checks(bad)
    assert EAGER.attention(q, q, q, key_lengths=bad).shape == (2, 2, 4, 8)  # no read, no error
    monkeypatch.setattr(op_checks, "DEBUG", True)
    assert op_checks.value_checks(bad)
    with pytest.raises((RuntimeError, NotImplementedError)):  # the check now tries to read
        EAGER.attention(q, q, q, key_lengths=bad)


def test_interpreter_version_guard_names_the_fix():
    """Triton < 3.7's interpreter breaks on numpy >= 2.3 deep inside a kernel launch; the guard
    turns that into an error naming both versions and the fix, and lets good pairs through."""
    with pytest.raises(RuntimeError, match=r"triton 3\.6\.0 needs numpy < 2\.3 \(found numpy 2\.4\.6\)"):
        check_interpreter_versions("3.6.0", "2.4.6")
    with pytest.raises(RuntimeError, match="numpy < 2.3"):
        check_interpreter_versions("3.5.1+git1234", "2.3.0rc1")
    good = [("3.6.0", "2.2.6"), ("3.7.0", "2.4.6"), ("3.9.0", "2.3.0"), ("3.10.1", "3.0.0")]
    for triton_version, numpy_version in good:
        check_interpreter_versions(triton_version, numpy_version)


def test_the_launch_helpers_are_ceiling_division_and_the_next_power_of_two():
    """`_common.cdiv` and `next_pow2`, which size every grid and tile, at exact multiples and one past
    them (by hand: 6 / 3 = 2 exactly, 7 / 3 rounds up to 3; 2^4 = 16 is its own next power, 17 needs 32)."""
    assert [cdiv(a, 3) for a in (0, 1, 3, 6, 7)] == [0, 1, 1, 2, 3]
    assert [next_pow2(n) for n in (0, 1, 2, 3, 16, 17, 16384)] == [1, 1, 2, 4, 16, 32, 16384]


def test_triton_on_cpu_on_a_gpu_machine_is_refused_not_interpreted():
    """On a machine with a GPU, the triton backend asked for on CPU (a model built on the CPU, then
    to be moved) must not turn Triton's interpreter on for the whole process, or every kernel, on
    cuda too, would run in it (seen on an H100, 2026-11-26: the interpreter came up in a GPU test
    run): it is refused, naming the fix. A fresh process, so that no kernel is imported yet; the GPU
    is faked."""
    code = ("import os, torch\ntorch.cuda.is_available = lambda: True\nfrom scratchformer import ops\n"
            "try:\n    ops.select('triton', 'cpu')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
            "print('interpreter:', os.environ.get('TRITON_INTERPRET'))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "refused: the triton backend was asked for on CPU on a machine with a GPU" in p.stdout, p.stderr
    assert "Transformer(cfg, device='cuda')" in p.stdout and "interpreter: None" in p.stdout
