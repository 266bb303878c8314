"""What each op accepts is decided once, in `scratchformer/op_checks.py`, for every backend: the eager
spec, the torch peer and the triton kernels (Triton's interpreter here) refuse the same calls with
the same message, and agree on the edge cases they accept (attention with no key at all).

A model refuses, when it is built, a backend that cannot run its attention heads' width.
Decoding's public entry (`beam_search`) refuses a length penalty that cannot rank anything.
"""

import re

import numpy as np
import pytest
import torch
from conftest import DEVICE, requires_cuda

from scratchformer import op_checks, ops
from scratchformer.kernels import _common, add_layer_norm, attention, cross_entropy, ffn, matmul
from scratchformer.model import Classifier, Extractor, ModelConfig, Transformer, beam_search, greedy_decode

pytestmark = pytest.mark.usefixtures("on_test_device")


def _esc(value) -> str:
    return re.escape(str(value))


def _qkv(Lq=3, Lk=5, D=16, requires_grad=False):
    return tuple(torch.randn(2, 2, L, D, requires_grad=requires_grad) for L in (Lq, Lk, Lk))


# ---------------------------------------------------------------------------------------------
# add_layer_norm
# ---------------------------------------------------------------------------------------------


def test_add_layer_norm_refuses_integer_inputs(ops_backend):
    """Integers were truncated by the eager spec (its output cast back to int32)."""
    x = torch.arange(32, dtype=torch.int32).view(2, 16)
    with pytest.raises(ValueError, match="add_layer_norm: x must be a floating-point tensor .*, got torch.int32"):
        ops_backend.add_layer_norm(x, None, torch.ones(16), None)
    with pytest.raises(ValueError, match="add_layer_norm: weight must be a floating-point tensor .*, got torch.int64"):
        ops_backend.add_layer_norm(torch.randn(2, 16), None, torch.ones(16, dtype=torch.long), None)


@pytest.mark.parametrize("eps", [-1e-5, 0.0, float("nan"), float("inf")])
def test_add_layer_norm_refuses_bad_eps(ops_backend, eps):
    x, w = torch.randn(2, 16), torch.ones(16)
    with pytest.raises(ValueError, match=rf"add_layer_norm: eps must be a finite number > 0, got {eps}"):
        ops_backend.add_layer_norm(x, None, w, None, eps)
    with pytest.raises(ValueError, match=r"add_layer_norm: eps must be a finite number > 0"):
        ops_backend.add_layer_norm(x, None, w, None, eps=eps)


@pytest.mark.parametrize("p", [-0.1, 1.0, float("nan")])
def test_add_layer_norm_refuses_bad_dropout(ops_backend, p):
    with pytest.raises(ValueError, match=r"add_layer_norm: dropout_p must be in \[0, 1\)"):
        ops_backend.add_layer_norm(torch.randn(2, 16), None, torch.ones(16), None, dropout_p=p)


def test_add_layer_norm_refuses_an_empty_row(ops_backend):
    with pytest.raises(ValueError, match=r"add_layer_norm: x must be \(\.\.\., N\) with N >= 1, got \(2, 0\)"):
        ops_backend.add_layer_norm(torch.randn(2, 0), None, torch.ones(0), None)


def test_add_layer_norm_refuses_a_scalar_a_bias_of_another_width_and_integer_output_dtypes(ops_backend):
    """A 0-dim x has no feature dim (x.shape[-1] was an IndexError); a bias narrower than the row would be
    read past its end by the kernel, which trusts the check; y_dtype / copy_dtype must be floating point
    (an int32 y was a silent truncation in eager and torch)."""
    with pytest.raises(ValueError, match=_esc("add_layer_norm: x must be (..., N) with N >= 1, got ()")):
        ops_backend.add_layer_norm(torch.tensor(1.0), None, torch.ones(1), None)
    x, w = torch.randn(2, 16), torch.ones(16)
    with pytest.raises(ValueError, match=_esc("add_layer_norm: weight/bias must be (16,) for hidden size 16, got "
                                              "(16,) / (8,)")):
        ops_backend.add_layer_norm(x, None, w, torch.zeros(8))
    for name, dtype in (("y_dtype", torch.int32), ("copy_dtype", torch.int64)):
        with pytest.raises(ValueError, match=_esc(f"add_layer_norm: {name} must be None or a floating-point "
                                                  f"torch.dtype, got {dtype!r}")):
            ops_backend.add_layer_norm(x, None, w, None, **{name: dtype})


# ---------------------------------------------------------------------------------------------
# ffn
# ---------------------------------------------------------------------------------------------


def test_add_layer_norm_refuses_mixed_parameter_dtypes_everywhere(ops_backend):
    """weight and bias: one dtype, the stream's (residual's, else x's) or float32 (a half-precision
    activation with fp32 gains); the backends accepted and refused different mixes (eager all, torch
    some, triton none). x and residual: one dtype, or a 16-bit x under an fp32 residual (a sublayer's
    autocast output on the fp32 stream), which every backend takes, y in the stream's dtype."""
    x = torch.randn(2, 16)
    for weight, bias, got in [(torch.ones(16, dtype=torch.float16), None, "torch.float16 / None"),
                              (torch.ones(16), torch.zeros(16, dtype=torch.float16), "torch.float32 / torch.float16")]:
        with pytest.raises(ValueError, match=_esc(f"add_layer_norm: weight and bias must share one dtype, the stream's "
                                                  f"(torch.float32: residual's, else x's) or float32, got {got}")):
            ops_backend.add_layer_norm(x, None, weight, bias)
    with pytest.raises(ValueError, match=_esc("the stream's (torch.float32: residual's, else x's) or float32, got "
                                              "torch.bfloat16 / None")):  # a bf16 x on an fp32 stream: fp32 gains
        ops_backend.add_layer_norm(x.bfloat16(), x, torch.ones(16, dtype=torch.bfloat16), None)
    for low, high in [(torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)]:  # only 16-bit under fp32
        with pytest.raises(ValueError, match=_esc(f"add_layer_norm dtype mismatch: x {low}, residual {high} (x may be "
                                                  f"float16/bfloat16 under a float32 residual")):
            ops_backend.add_layer_norm(x.to(low), x.to(high), torch.ones(16), None)
    got = ops_backend.add_layer_norm(x.bfloat16(), x, torch.ones(16), torch.zeros(16))
    cast_first = ops_backend.add_layer_norm(x.bfloat16().float(), x, torch.ones(16), torch.zeros(16))
    want = ops.select("eager").add_layer_norm(x.bfloat16().float(), x, torch.ones(16), torch.zeros(16))
    assert got.dtype == torch.float32 and torch.equal(got, cast_first) and torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="add_layer_norm: weight must be a tensor, got NoneType"):
        ops_backend.add_layer_norm(x, None, None, None)
    half = x.to(torch.float16)  # fp16 activations, fp32 gains: accepted everywhere, one answer
    got = ops_backend.add_layer_norm(half, half, torch.ones(16), torch.zeros(16))
    want = ops.select("eager").add_layer_norm(half, half, torch.ones(16), torch.zeros(16))
    assert got.dtype == torch.float16 and torch.allclose(got.float(), want.float(), atol=2e-3)


def _ffn_args(d_model=16, d_ff=32):
    return (torch.randn(3, d_model), torch.randn(d_ff, d_model), torch.randn(d_ff), torch.randn(d_model, d_ff),
            torch.randn(d_model))


@pytest.mark.parametrize("which,shape", [("b1", (1,)), ("b1", (16,)), ("b2", (1,)), ("b2", (32,)), ("b1", (1, 32))])
def test_ffn_refuses_a_bias_of_the_wrong_shape(ops_backend, which, shape):
    """A b1 of shape (1,) used to broadcast silently in the eager and torch backends."""
    x, w1, b1, w2, b2 = _ffn_args()
    b1, b2 = (torch.randn(shape), b2) if which == "b1" else (b1, torch.randn(shape))
    want = "(32,) (d_ff)" if which == "b1" else "(16,) (d_model)"
    with pytest.raises(ValueError, match=rf"ffn: {which} must have shape {_esc(want)}, got {_esc(shape)}"):
        ops_backend.ffn(x, w1, b1, w2, b2)


def test_ffn_refuses_a_w2_whose_width_is_not_d_ff(ops_backend):
    """w2 must be (d_model, d_ff) for w1's d_ff: a w2 of the right height and another width went past the
    check (eager's matmul then raised torch's RuntimeError; the triton GEMM trusts the check)."""
    x, w1, b1, _, b2 = _ffn_args()  # d_model 16, d_ff 32
    with pytest.raises(ValueError, match=_esc("ffn shape mismatch: x (..., 16), w1 (32, 16) (want (d_ff, 16)), "
                                              "w2 (16, 24) (want (16, d_ff))")):
        ops_backend.ffn(x, w1, b1, torch.randn(16, 24), b2)


def test_ffn_refuses_integer_weights_and_bad_dropout(ops_backend):
    x, w1, b1, w2, b2 = _ffn_args()
    with pytest.raises(ValueError, match="ffn: w1 must be a floating-point tensor .*, got torch.int64"):
        ops_backend.ffn(x, w1.long(), b1, w2, b2)
    with pytest.raises(ValueError, match=r"ffn: dropout_p must be in \[0, 1\), got nan"):
        ops_backend.ffn(x, w1, b1, w2, b2, dropout_p=float("nan"))


def test_ffn_refuses_mixed_dtypes_everywhere(ops_backend):
    """One dtype for x, the weights and the biases (after autocast's casts): a half b1 with fp32
    weights was accepted by eager, refused deep in F.linear by torch and by name by triton."""
    x, w1, b1, w2, b2 = _ffn_args()
    with pytest.raises(ValueError, match=_esc("ffn: dtype mismatch: x float32, w1 float32, b1 float16, w2 float32")):
        ops_backend.ffn(x, w1, b1.half(), w2, b2)


def test_relu_has_no_gradient_at_zero_in_any_backend(ops_backend):
    """A pre-activation of exactly 0 (zero-initialised weights, or a half value that is 0): the eager
    spec's clamp_min passed the gradient there, F.relu and the kernels pass none."""
    x, w1, b1, w2, b2 = (t.requires_grad_() for t in _ffn_args())
    with torch.no_grad():
        w1.zero_(), b1.zero_()
    y = ops_backend.ffn(x, w1, b1, w2, b2)
    dw1, db1 = torch.autograd.grad(y, (w1, b1), torch.randn_like(y))
    assert torch.equal(dw1, torch.zeros_like(w1)) and torch.equal(db1, torch.zeros_like(b1))


def test_ffn_accepts_missing_biases_everywhere(ops_backend):
    x, w1, _, w2, _ = _ffn_args()
    ref = ops.select("eager").ffn(x, w1, None, w2, None)
    torch.testing.assert_close(ops_backend.ffn(x, w1, None, w2, None), ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# embed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 10, 12345])
def test_embed_refuses_an_out_of_range_token_id_naming_it(ops_backend, bad, monkeypatch):
    """-1 used to return the last row (Python indexing) in eager, >= V a raw IndexError. On a GPU
    the ids are read only with SCRATCHFORMER_DEBUG=1 (a host sync), so the test turns it on there:
    without it the kernel's own bound check asserts on the device, which poisons the process."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    tokens = torch.tensor([[1, 2, 3], [4, bad, 5]])
    with pytest.raises(ValueError, match=rf"embed: token id {bad} at \(1, 1\) is out of range \[0, 10\)"):
        ops_backend.embed(tokens, torch.randn(10, 16), scale=1.0)


def test_embed_checks_a_single_token_too(ops_backend, monkeypatch):
    """A (1, 1) batch (a decoding step of one sentence) is read like any other: its one id out of range
    is named (SCRATCHFORMER_DEBUG on, as above, for a GPU)."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    with pytest.raises(ValueError, match=_esc("embed: token id 10 at (0, 0) is out of range [0, 10)")):
        ops_backend.embed(torch.tensor([[10]]), torch.randn(10, 16), scale=1.0)


def test_embed_names_the_first_out_of_range_id_in_reading_order(ops_backend, monkeypatch):
    """Of several bad ids the message names the first in row-major order (the one a user finds first
    reading the batch): here 12 at (0, 1), not -1 at (1, 0) nor 10 at (1, 2)."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    tokens = torch.tensor([[1, 12, 3], [-1, 2, 10]])
    with pytest.raises(ValueError, match=_esc("embed: token id 12 at (0, 1) is out of range [0, 10)")):
        ops_backend.embed(tokens, torch.randn(10, 16), scale=1.0)


def test_embed_refuses_a_bool_offset_and_a_weight_that_is_not_a_matrix(ops_backend):
    """pos_offset=True is a bool, not a position (Python would read it as 1); a 1-D weight has no d_model."""
    tokens = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=_esc("embed: pos_offset must be an integer, got True")):
        ops_backend.embed(tokens, torch.randn(10, 16), scale=1.0, pos_offset=True)
    with pytest.raises(ValueError, match=_esc("embed: tokens must be (B, L) and weight (V, d_model), got (1, 2) and "
                                              "(16,)")):
        ops_backend.embed(tokens, torch.randn(16), scale=1.0)


def test_embed_takes_an_int_offset_and_refuses_a_tensor_in_every_backend(ops_backend):
    """A 0-dim tensor pos_offset worked in eager and triton and was an AttributeError in torch. The ops take a
    Python (or numpy) int: a device tensor would be a host sync per call, and the model's CUDA-graph decoding
    keeps its device position out of the ops (`Embedding.forward` adds those positions itself)."""
    import numpy as np

    tokens, weight = torch.tensor([[1, 2, 3]]), torch.randn(8, 16)
    want = ops.select("eager", DEVICE).embed(tokens, weight, scale=2.0, pos_offset=3)
    torch.testing.assert_close(ops_backend.embed(tokens, weight, scale=2.0, pos_offset=np.int64(3)), want)
    for offset in (torch.tensor(3), torch.tensor([3])):
        with pytest.raises(ValueError, match=_esc(f"embed: pos_offset must be a Python int, not a tensor (got "
                                                  f"{offset!r}); pass int(...) of it")):
            ops_backend.embed(tokens, weight, scale=2.0, pos_offset=offset)


def test_embed_value_check_follows_the_value_checks_gate(monkeypatch):
    """Reading ids is a host sync on a GPU: it runs where `op_checks.value_checks` allows (CPU, or
    SCRATCHFORMER_DEBUG=1), never inside torch.compile. A meta tensor cannot be read: it shows
    whether the check tried."""
    eager = ops.select("eager")
    tokens, weight = torch.full((2, 3), -1, device="meta"), torch.empty(10, 16, device="meta")
    monkeypatch.setattr(op_checks, "DEBUG", False)
    assert eager.embed(tokens, weight, scale=1.0, pos_encoding=False).shape == (2, 3, 16)
    monkeypatch.setattr(op_checks, "DEBUG", True)
    with pytest.raises((RuntimeError, NotImplementedError)):
        eager.embed(tokens, weight, scale=1.0, pos_encoding=False)


def test_embed_refuses_bad_shapes_and_scales(ops_backend):
    w = torch.randn(10, 16)
    with pytest.raises(ValueError, match="embed: pos_offset must be an integer, got 1.5"):  # fractional positions
        ops_backend.embed(torch.tensor([[1, 2]]), w, scale=1.0, pos_offset=1.5)
    with pytest.raises(ValueError, match=r"embed: tokens must be \(B, L\) and weight \(V, d_model\), got \(3,\)"):
        ops_backend.embed(torch.tensor([1, 2, 3]), w, scale=1.0)
    with pytest.raises(ValueError, match="embed: weight must be a floating-point tensor .*, got torch.int64"):
        ops_backend.embed(torch.tensor([[1, 2]]), w.long(), scale=1.0)
    with pytest.raises(ValueError, match="embed: scale must be a finite number, got nan"):
        ops_backend.embed(torch.tensor([[1, 2]]), w, scale=float("nan"))
    # an odd width: refused with positions (triton's C++ op raised a RuntimeError), fine without them
    with pytest.raises(ValueError, match="embed: d_model must be even for the sinusoidal positions, got 15"):
        ops_backend.embed(torch.tensor([[1, 2]]), w[:, :15], scale=1.0)
    assert ops_backend.embed(torch.tensor([[1, 2]]), w[:, :15], scale=1.0, pos_encoding=False).shape == (1, 2, 15)
    # positions past 2^29 (the last here 2^29): the C++ op's sinusoid loses its accuracy there, then leaves [-1, 1]
    msg = r"embed: positions must be below 536870912 \(2\^29.*got pos_offset 536870911 and L 2"
    with pytest.raises(ValueError, match=msg):
        ops_backend.embed(torch.tensor([[1, 2]]), w, scale=1.0, pos_offset=2**29 - 1)


def test_embed_without_positions_takes_any_offset(ops_backend):
    """The 2^29 bound is the sinusoid's: with pos_encoding off no position is computed, so every backend
    takes any pos_offset (here 2^40) and returns weight[tokens] * scale, as F.embedding does."""
    w, tokens = torch.randn(10, 16), torch.tensor([[1, 2, 9], [0, 2, 2]])
    got = ops_backend.embed(tokens, w, scale=2.0, pos_offset=2**40, pos_encoding=False)
    torch.testing.assert_close(got, torch.nn.functional.embedding(tokens, w) * 2.0, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def test_attention_refuses_a_head_dim_of_zero_and_lengths_that_are_not_a_tensor(ops_backend):
    """D = 0 was a ZeroDivisionError in eager and an empty output in torch; lengths given as a list
    an AttributeError everywhere."""
    q, k, v = _qkv(D=0)
    with pytest.raises(ValueError, match=_esc("attention: the head dim (q.shape[-1]) must be >= 1, got q (2, 2, 3, 0")):
        ops_backend.attention(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=_esc("key_lengths must be an int32/int64 tensor of shape (2,), got list")):
        ops_backend.attention(q, k, v, key_lengths=[1, 3])


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), -0.5])
def test_attention_refuses_a_non_finite_or_negative_scale(ops_backend, scale):
    """Every backend alike (a negative scale went through eager and torch, the triton kernel refused it)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"attention: scale must be a finite number >= 0, got {scale}"):
        ops_backend.attention(q, k, v, scale=scale)


def test_attention_accepts_a_finite_scale_everywhere(ops_backend):
    q, k, v = _qkv()
    ref = ops.select("eager").attention(q, k, v, scale=0.5)
    torch.testing.assert_close(ops_backend.attention(q, k, v, scale=0.5), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("flag", ["yes", 1, None, torch.tensor(True)])
def test_every_backend_refuses_a_flag_that_is_not_a_bool(ops_backend, flag):
    """causal="yes" was True to eager and triton and a TypeError in torch's SDPA: every op's flags are bools."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=_esc(f"attention: causal must be a bool, got {flag!r}")):
        ops_backend.attention(q, k, v, causal=flag)
    with pytest.raises(ValueError, match=_esc(f"add_layer_norm: return_residual must be a bool, got {flag!r}")):
        ops_backend.add_layer_norm(torch.randn(2, 16), None, torch.ones(16), None, return_residual=flag)
    with pytest.raises(ValueError, match=_esc(f"embed: pos_encoding must be a bool, got {flag!r}")):
        ops_backend.embed(torch.tensor([[1, 2]]), torch.randn(8, 16), scale=1.0, pos_encoding=flag)


def _tensor_args():
    """op -> (the bundle's call of it, its tensor arguments by name), for every op of a bundle."""
    q, k, v = _qkv()
    x, w1, b1, w2, b2 = _ffn_args()
    return {
        "attention": (lambda m, a: m.attention(a["q"], a["k"], a["v"]), dict(q=q, k=k, v=v)),
        "add_layer_norm": (lambda m, a: m.add_layer_norm(a["x"], a["residual"], a["weight"], a["bias"]),
                           dict(x=x, residual=x, weight=torch.ones(16), bias=torch.zeros(16))),
        "ffn": (lambda m, a: m.ffn(a["x"], a["w1"], a["b1"], a["w2"], a["b2"]), dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2)),
        "embed": (lambda m, a: m.embed(a["tokens"], a["weight"], scale=1.0),
                  dict(tokens=torch.tensor([[1, 2]]), weight=torch.randn(8, 16))),
        "linear_cross_entropy": (lambda m, a: m.linear_cross_entropy(a["x"], a["weight"], a["bias"],
                                                                     torch.tensor([1, 2, 3])),
                                 dict(x=x, weight=torch.randn(9, 16), bias=torch.zeros(9))),
    }


@pytest.mark.parametrize("op", ["attention", "add_layer_norm", "ffn", "embed", "linear_cross_entropy"])
def test_every_backend_names_an_input_that_is_not_a_tensor(ops_backend, op):
    """A nested list where a tensor goes is refused naming the argument, in every backend (was an
    AttributeError such as "'list' object has no attribute 'dim'" from inside the check); each
    tensor argument in turn, the call with all of them a tensor accepted."""
    call, args = _tensor_args()[op]
    call(ops_backend, args)
    for name, t in args.items():
        with pytest.raises(ValueError, match=_esc(f"{op}: {name} must be a tensor, got list")):
            call(ops_backend, {**args, name: t.tolist()})


@pytest.mark.parametrize("op", ["attention", "add_layer_norm", "ffn", "embed", "linear_cross_entropy"])
def test_every_backend_names_a_float8_input(ops_backend, op):
    """A float8 tensor is floating point to torch, and no backend runs it: eager and torch failed deep
    inside a mul or matmul, triton in its own check (or the C++ op's), three errors. An op's floating
    inputs in float8 are refused naming the first, the same in every backend."""
    call, args = _tensor_args()[op]
    float8 = {n: t.to(torch.float8_e4m3fn) if t.is_floating_point() else t for n, t in args.items()}
    name = next(n for n, t in args.items() if t.is_floating_point())
    with pytest.raises(ValueError, match=_esc(f"{op}: {name} must be a floating-point tensor (float16, bfloat16, "
                                              "float32, float64), got torch.float8_e4m3fn")):
        call(ops_backend, float8)


@pytest.mark.parametrize("scale", [torch.tensor(2.0), None, "2.0", True])
def test_every_backend_names_a_scale_that_is_not_a_number(ops_backend, scale):
    """A tensor scale passed the check (math.isfinite reads a 1-element tensor): eager and torch
    differentiated through it and triton's embedding dropped its gradient (float() of it), a host
    sync on a GPU. It, None, a string and a bool are refused by name (None and "2.0" were a
    TypeError that named nothing); a numpy float is a number."""
    tokens, w = torch.tensor([[1, 2]]), torch.randn(8, 16)
    want = (_esc(f"embed: scale must be a Python number, not a tensor (got {scale!r})")
            if isinstance(scale, torch.Tensor) else _esc(f"embed: scale must be a number, got {scale!r}"))
    with pytest.raises(ValueError, match=want):
        ops_backend.embed(tokens, w, scale=scale)
    if scale is not None:  # attention's default, the head dim's 1/sqrt
        with pytest.raises(ValueError, match=want.replace("embed", "attention")):
            ops_backend.attention(*_qkv(), scale=scale)
    torch.testing.assert_close(ops_backend.embed(tokens, w, scale=np.float32(2.0)),
                               ops_backend.embed(tokens, w, scale=2.0))


@pytest.mark.parametrize("case", ["dense", "key-lengths", "causal"])
def test_attention_with_no_key_is_zeros_in_every_backend(ops_backend, case):
    """Lk = 0: every query row sees no key, so it is zeros (the rule for an empty row), with zero
    gradients; the eager spec used to crash in amax."""
    q, k, v = _qkv(Lk=0, requires_grad=True)
    kw = {"key-lengths": dict(key_lengths=torch.tensor([0, 0])), "causal": dict(causal=True)}.get(case, {})
    out = ops_backend.attention(q, k, v, **kw)
    assert out.shape == q.shape and torch.equal(out, torch.zeros_like(q))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), allow_unused=True)
    assert dq is None or torch.equal(dq, torch.zeros_like(q))
    assert all(g is None or g.shape == k.shape for g in (dk, dv))


def test_attention_and_ffn_take_their_tensors_by_name_too(ops_backend):
    """The adapters cast and check q, k, v (the FFN's x and weights) given by name as positionally;
    a call by name raised a bare StopIteration, a mixed one under autocast cast only some."""
    q, k, v = _qkv()
    ref = ops_backend.attention(q, k, v)
    torch.testing.assert_close(ops_backend.attention(q=q, k=k, v=v), ref)
    torch.testing.assert_close(ops_backend.attention(q, k, v=v), ref)
    x, w1, b1, w2, b2 = _ffn_args()
    torch.testing.assert_close(ops_backend.ffn(x=x, w1=w1, b1=b1, w2=w2, b2=b2), ops_backend.ffn(x, w1, b1, w2, b2))
    if DEVICE == "cpu" and ops_backend.name == "triton":
        return  # the interpreter's bf16 tl.dot is wrong (conftest): no bf16 run of our kernels on a CPU
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        assert ops_backend.attention(q, k, v=v).dtype == torch.bfloat16
        # the FFN's output in the autocast dtype on every backend (the eager spec's fp32 biases promoted it to fp32)
        assert ops_backend.ffn(x, w1, b1, w2, b2).dtype == torch.bfloat16


def test_ffn_under_autocast_takes_low_precision_activations_with_fp32_weights(ops_backend):
    """A bf16 x with fp32 weights under autocast is one dtype after autocast's casts: eager and
    triton cast the five tensors first, the torch backend checked them uncast and refused it
    ("ffn: dtype mismatch: x bfloat16, w1 float32, ...") although F.linear would cast them too."""
    if DEVICE == "cpu" and ops_backend.name == "triton":
        return  # no bf16 run of our kernels on a CPU (as above)
    x, w1, b1, w2, b2 = _ffn_args()
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        got = ops_backend.ffn(x.bfloat16(), w1, b1, w2, b2)
        want = ops.select("eager", DEVICE).ffn(x.bfloat16(), w1, b1, w2, b2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.05)


def test_autocast_casts_only_what_autocast_would(ops_backend):
    """Under autocast the adapters cast float32/16 inputs only, as autocast does for a matmul: integer
    q, k, v are still refused by name (they were cast to bf16 and accepted), and float64 ones are
    not lowered (eager and torch keep them; the triton kernels refuse them by name)."""
    q, k, v = (t.to(torch.int64) for t in _qkv())
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"attention: q must be a floating-point tensor \(float16, bfloat16, "
                                             r"float32, float64\), got torch.int64"):
            ops_backend.attention(q, k, v)
        q, k, v = (t.double() for t in _qkv())
        if ops_backend.name == "triton":
            with pytest.raises((ValueError, TypeError), match="float64"):
                ops_backend.attention(q, k, v)
        else:
            assert ops_backend.attention(q, k, v).dtype == torch.float64


def test_attention_refuses_bad_dropout_with_the_op_named(ops_backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"attention: dropout_p must be in \[0, 1\), got nan"):
        ops_backend.attention(q, k, v, dropout_p=float("nan"))


@pytest.mark.parametrize("change,message", [
    # k and v one head dim, q another: eager's q @ kᵀ raised torch's RuntimeError, not ours
    (dict(k=torch.randn(2, 2, 5, 8), v=torch.randn(2, 2, 5, 8)),
     "attention shape mismatch: q (2, 2, 3, 16), k (2, 2, 5, 8), v (2, 2, 5, 8) (need matching B, H, D"),
    # a negative length: eager's mask read it as 0 (every key hidden) and went on
    (dict(key_lengths=torch.tensor([-1, 3])), "key_lengths must lie in [0, 5] (the sequence length), got min -1 max 3"),
    (dict(query_lengths=torch.tensor([0, -2])), "query_lengths must lie in [0, 3] (the sequence length), got min -2"),
    # one length per batch row, not one more: (3,) is 1-D like (B,) but not B long
    (dict(key_lengths=torch.tensor([5, 2, 1])), "key_lengths must be an int32/int64 tensor of shape (2,), got "
                                                "torch.int64 (3,)"),
])
def test_attention_refuses_bad_shapes_and_lengths_everywhere(ops_backend, change, message, monkeypatch):
    """Each backend refuses, by op_checks' message, a head dim that q and k do not share, lengths outside
    [0, L] (below as well as above) and lengths that are not one per batch row (the lengths read on a GPU
    too: SCRATCHFORMER_DEBUG on)."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v) | {name: t.to(DEVICE) for name, t in change.items()}
    with pytest.raises(ValueError, match=_esc(message)):
        ops_backend.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


# ---------------------------------------------------------------------------------------------
# the backend, chosen once where a model is built
# ---------------------------------------------------------------------------------------------


def _cfg(d_model, n_heads, kernel, **kw):
    kw = dict(n_encoder_layers=1, n_decoder_layers=1, d_ff=32, dropout=0.0) | kw
    return ModelConfig(src_vocab_size=12, d_model=d_model, n_heads=n_heads, kernel=kernel, **kw)


@pytest.mark.parametrize("model", [Transformer, Classifier])
def test_a_triton_model_refuses_a_head_dim_its_attention_does_not_run(model):
    """At build, naming the head dims it runs: it was the first forward's error, mid-training."""
    kw = dict(num_classes=2, n_decoder_layers=0) if model is Classifier else {}
    with pytest.raises(ValueError, match=r"triton backend's attention runs head dim 16, 32, 64, 128, not 12 "
                                         r"\(d_model / heads\): .*--kernel torch or eager"):
        model(_cfg(24, 2, "triton", **kw), device=DEVICE)
    assert model(_cfg(32, 2, "triton", **kw), device=DEVICE).ops.name == "triton"


@requires_cuda
def test_auto_runs_a_head_dim_triton_cannot_on_torch():
    assert Transformer(_cfg(16, 2, "auto"), device="cuda").ops.name == "torch"
    assert Transformer(_cfg(32, 2, "auto"), device="cuda").ops.name == "triton"


# ---------------------------------------------------------------------------------------------
# the triton bundle: each input checked once
# ---------------------------------------------------------------------------------------------


def _triton_calls():
    """{op: (kernel module, call(bundle or module), leaves)} on small valid inputs that take gradients."""
    q, k, v = _qkv(requires_grad=True)
    lengths = torch.tensor([5, 2])
    x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((2, 3, 16), (16,), (16,)))
    f = tuple(t.requires_grad_() for t in _ffn_args())
    h, g, gb = (torch.randn(*shape, requires_grad=True) for shape in ((6, 16), (11, 16), (11,)))
    target = torch.tensor([3, 0, 10, 1, 0, 7])

    def loss(m):  # the loss, not the NLL (which takes no gradient)
        return m.linear_cross_entropy(h, g, gb, target, label_smoothing=0.1, ignore_index=0)[0]

    return {
        "attention": (attention, lambda m: m.attention(q, k, v, key_lengths=lengths, causal=True), (q, k, v)),
        "add_layer_norm": (add_layer_norm, lambda m: m.add_layer_norm(x, x, w, b, 1e-5), (x, w, b)),
        "ffn": (ffn, lambda m: m.ffn(*f, activation="gelu"), f),
        "linear_cross_entropy": (cross_entropy, loss, (h, g, gb)),
    }


@pytest.mark.parametrize("name", ["attention", "add_layer_norm", "ffn", "linear_cross_entropy"])
def test_the_triton_bundle_checks_each_input_once(name, monkeypatch):
    """The triton bundle runs the backends' check and the kernel's `check_limits`, then the entry
    point without its own checks (which would check every input again: 1.5-4 us a call, and read
    the lengths' range twice on the CPU); it gives what the entry point gives, gradients too."""
    module, call, leaves = _triton_calls()[name]
    want = call(module)
    want_grads = torch.autograd.grad(want.sum(), leaves)

    def checked_again(*args, **kwargs):
        raise AssertionError(f"{name}'s inputs checked a second time")

    monkeypatch.setattr(module, "_check_inputs", checked_again)
    with pytest.raises(AssertionError, match="a second time"):
        call(module)  # the entry point checks: the patch is where it looks
    got = call(ops.select("triton", DEVICE))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(torch.autograd.grad(got.sum(), leaves), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("case,message", [
    ("attention float64", "attention: dtype must be float32, float16 or bfloat16, got torch.float64"),
    ("attention head dim", "head_dim must be 16, 32, 64 or 128, got 80"),
    ("attention on cpu", "attention: the Triton kernel needs CUDA tensors"),
    ("add_layer_norm float64", "add_layer_norm: dtype must be float32, float16 or bfloat16, got torch.float64"),
    ("add_layer_norm width", "add_layer_norm: hidden size N must be <= 16384 (a whole row per tile), got 16400"),
    ("add_layer_norm on cpu", "add_layer_norm: the Triton kernel needs CUDA tensors"),
    ("ffn float64", "ffn: dtype must be float32, float16 or bfloat16, got torch.float64"),
    ("ffn width", "ffn: d_model must be in [16, 16384], got 8"),
    ("ffn on cpu", "ffn: the Triton kernel needs CUDA tensors"),
    ("linear_cross_entropy float64", "linear_cross_entropy: dtype must be float32, float16 or bfloat16, got "
                                     "torch.float64"),
    ("linear_cross_entropy on cpu", "linear_cross_entropy: the Triton kernel needs CUDA tensors"),
])
def test_the_triton_bundle_refuses_what_only_the_kernels_refuse(case, message, monkeypatch):
    """What the backends' check passes and only a kernel refuses (its dtypes, widths, head dims, and
    CPU tensors without the interpreter) is refused by the triton bundle with the kernel's message,
    the entry point's own (`check_limits`, in the order of the entry point's checks)."""
    bundle = ops.select("triton", DEVICE)
    op, what = case.split(" ", 1)
    if what == "on cpu":
        if DEVICE != "cpu":
            pytest.skip("the interpreter's CPU tensors")
        monkeypatch.setattr(_common, "INTERPRET", False)
    dtype = torch.float64 if what == "float64" else torch.float32
    if op == "attention":
        q, k, v = (t.to(dtype) for t in _qkv(D=80 if what == "head dim" else 16))
        call = lambda: bundle.attention(q, k, v)  # noqa: E731
    elif op == "add_layer_norm":
        N = 16400 if what == "width" else 16
        x, w = torch.randn(2, N, dtype=dtype), torch.ones(N, dtype=dtype)
        call = lambda: bundle.add_layer_norm(x, None, w, None)  # noqa: E731
    elif op == "ffn":
        args = tuple(t.to(dtype) for t in _ffn_args(d_model=8 if what == "width" else 16))
        call = lambda: bundle.ffn(*args)  # noqa: E731
    else:
        x, w, target = torch.randn(4, 16, dtype=dtype), torch.randn(9, 16, dtype=dtype), torch.tensor([1, 2, 3, 4])
        call = lambda: bundle.linear_cross_entropy(x, w, torch.zeros(9, dtype=dtype), target)  # noqa: E731
    with pytest.raises(ValueError, match=_esc(message)):
        call()


def test_the_kernels_entry_points_name_an_input_that_is_not_a_tensor_and_a_flag_that_is_not_a_bool():
    """The Triton entry points, called on their own, refuse what the bundle's check refuses: a list
    for a tensor (was an AttributeError on its .device from the device check) and a truthy string
    for a flag (causal="False" ran causal attention; return_residual="no" returned s)."""
    q, k, v = _qkv()
    x, w1, b1, w2, b2 = _ffn_args()
    w, b, target = torch.randn(9, 16), torch.zeros(9), torch.tensor([1, 2, 3])
    calls = {
        "attention": (lambda a: attention.attention(**a), dict(q=q, k=k, v=v)),
        "add_layer_norm": (lambda a: add_layer_norm.add_layer_norm(**a),
                           dict(x=x, residual=x, weight=torch.ones(16), bias=torch.zeros(16))),
        "ffn": (lambda a: ffn.ffn(**a), dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2)),
        "linear_cross_entropy": (lambda a: cross_entropy.linear_cross_entropy(**a, target=target),
                                 dict(x=x, weight=w, bias=b)),
        "matmul": (lambda a: matmul.matmul(**a), dict(a=x, b=w1.T.contiguous(), bias=b1)),
        "matmul_dact": (lambda a: matmul.matmul_dact(**a, activation="relu"), dict(a=x, b=w2, aux=torch.randn(3, 32))),
    }
    for op, (call, args) in calls.items():
        call(args)
        for name, t in args.items():
            with pytest.raises(ValueError, match=_esc(f"{op}: {name} must be a tensor, got list")):
                call({**args, name: t.tolist()})
    want = attention.attention(q, k, v, causal=False)
    for flag in ("False", 0, None):
        with pytest.raises(ValueError, match=_esc(f"attention: causal must be a bool, got {flag!r}")):
            attention.attention(q, k, v, causal=flag)
        with pytest.raises(ValueError, match=_esc(f"add_layer_norm: return_residual must be a bool, got {flag!r}")):
            add_layer_norm.add_layer_norm(x, x, torch.ones(16), None, return_residual=flag)
    torch.testing.assert_close(ops.select("triton", DEVICE).attention(q, k, v, causal=False), want, rtol=0, atol=0)
    # every other flag, the seed, dropout_p, scale and eps: named, not taken as true, as 1, or a TypeError inside
    for op, (call, args) in calls.items():
        flags = {"attention": ("return_lse", "return_dropout_mask"), "add_layer_norm": ("return_dropout_mask",),
                 "ffn": ("return_dropout_mask",), "matmul": ("store_pre", "store_mask"),
                 "matmul_dact": ("bias_grad",)}.get(op, ())
        for flag in flags:
            with pytest.raises(ValueError, match=_esc(f"{op}: {flag} must be a bool, got 'no'")):
                call({**args, flag: "no"})
        if op == "linear_cross_entropy":
            with pytest.raises(ValueError, match=_esc(f"{op}: label_smoothing must be a number, got '0.1'")):
                call({**args, "label_smoothing": "0.1"})
            continue
        for bad in ("0.1", None, True, torch.tensor(0.1)):
            with pytest.raises(ValueError, match=_esc(f"{op}: dropout_p must be a number, got {bad!r}")):
                call({**args, "dropout_p": bad})
        with pytest.raises(ValueError, match=_esc(f"{op}: seed must be an int or None (drawn), got 1.5")):
            call({**args, "dropout_p": 0.1, "seed": 1.5})
        for big in (2**63, -(2**63) - 1):  # an OverflowError of torch.tensor's, naming no seed
            message = f"{op}: seed must fit in 64 bits, in [-2**63, 2**63), got {big}"
            with pytest.raises(ValueError, match=_esc(message)):
                call({**args, "dropout_p": 0.1, "seed": big})
    for bad in ("1", True):
        with pytest.raises(ValueError, match=_esc(f"attention: scale must be a number, got {bad!r}")):
            attention.attention(q, k, v, scale=bad)
    for bad, message in ((None, "eps must be a number, got None"), (float("inf"), "eps must be > 0 and finite")):
        with pytest.raises(ValueError, match=_esc(f"add_layer_norm: {message}")):
            add_layer_norm.add_layer_norm(x, x, torch.ones(16), None, eps=bad)


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", [Classifier, Extractor])
@pytest.mark.parametrize("decode", [greedy_decode, beam_search])
def test_decoding_an_encoder_only_model_is_refused_by_name(model, decode):
    """An AttributeError ('Classifier' object has no attribute 'static_caches') from inside the search."""
    kw = dict(num_classes=2) if model is Classifier else dict(extractive=True)
    m = model(_cfg(16, 2, "auto", n_decoder_layers=0, **kw), device=DEVICE).eval()
    with pytest.raises(ValueError, match=rf"decoding needs an encoder-decoder model \(a Transformer, or an ensemble of "
                                         rf"them\); {model.__name__} has no decoder"):
        decode(m, torch.randint(4, 12, (2, 5)), torch.tensor([5, 3]), max_len=4)


@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), -float("inf"), 400.0, -1e308])
def test_beam_search_refuses_a_length_penalty_len_to_whose_power_leaves_the_float_range(penalty):
    """NaN ranks nothing and inf makes every score 0 or NaN; 400 raised an OverflowError at 7 tokens."""
    model = Transformer(_cfg(16, 2, "auto"), device=DEVICE).eval()
    src, lengths = torch.randint(4, 12, (2, 5)), torch.tensor([5, 3])
    expected = r"length_penalty must be a number in \[-50, 50\], got " + re.escape(str(penalty))
    with pytest.raises(ValueError, match=expected):
        beam_search(model, src, lengths, beam_size=2, max_len=4, length_penalty=penalty)
    assert beam_search(model, src, lengths, beam_size=2, max_len=4, length_penalty=0.6).shape[0] == 2


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,message", [
    (dict(target=torch.zeros(6, dtype=torch.int32)), "target must be int64 of shape (6,), got torch.int32"),
    (dict(target=torch.zeros(5, dtype=torch.int64)), "target must be int64 of shape (6,), got torch.int64 (5,)"),
    (dict(weight=torch.randn(11, 8)), "x must be (N, d) and weight (V, d), got (6, 16) and (11, 8)"),
    (dict(bias=torch.randn(10)), "bias must be (11,) (V), got (10,)"),
    (dict(x=torch.zeros(6, 16, dtype=torch.int64)),
     "x must be a floating-point tensor (float16, bfloat16, float32, float64), got torch.int64"),
    (dict(label_smoothing=1.0), "label_smoothing must be in [0, 1)"),
    (dict(ignore_index=11), "ignore_index 11 is not a class of [0, 11)"),
    (dict(ignore_index=1.5), "ignore_index must be an integer, got 1.5"),  # triton read it as 1, eager as 1.5
    (dict(bias=torch.randn(11, dtype=torch.float16)), "dtype mismatch: x float32, weight float32, bias float16"),
    (dict(target=torch.tensor([0, 1, 2, 3, 4, 11])), "target ids must lie in [0, 11), got min 0 max 11"),
    (dict(target=torch.tensor([0, 1, 2, 3, 4, -1])), "target ids must lie in [0, 11), got min -1 max 4"),
    (dict(ignore_index=-1), "ignore_index -1 is not a class of [0, 11)"),
    # smoothing spreads ε over the V - 2 classes that are neither gold nor ignored: none when V = 2
    (dict(weight=torch.randn(2, 16), bias=torch.randn(2), target=torch.tensor([0, 1, 1, 0, 1, 1])),
     "label_smoothing must be in [0, 1) (and needs V >= 3 when > 0), got 0.1 with V = 2"),
])
def test_linear_cross_entropy_refuses_bad_inputs_everywhere(ops_backend, change, message, monkeypatch):
    """Each backend refuses, by name, what the fused kernel would read out of bounds or misread (the
    parameters' tensors, made at import on the CPU, moved to the test device; target ids read on a GPU
    too: SCRATCHFORMER_DEBUG on)."""
    monkeypatch.setattr(op_checks, "DEBUG", True)
    args = dict(x=torch.randn(6, 16), weight=torch.randn(11, 16), bias=torch.randn(11),
                target=torch.randint(0, 11, (6,)), label_smoothing=0.1, ignore_index=0)
    args.update({name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in change.items()})
    with pytest.raises(ValueError, match=_esc("linear_cross_entropy: " + message)):
        ops_backend.linear_cross_entropy(args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("target"),
                                         **args)


# ---------------------------------------------------------------------------------------------
# inputs that do not go together: every backend names them, before any kernel or aten op runs
# ---------------------------------------------------------------------------------------------


def _meta(t):
    return t.to("meta")  # another device the CPU machine has (no data: nothing may read it)


@pytest.mark.parametrize("case", ["attention v", "attention key_lengths", "add_layer_norm residual shape",
                                  "add_layer_norm residual dtype", "add_layer_norm weight device",
                                  "add_layer_norm residual device", "ffn w2 device", "ffn x device", "embed tokens",
                                  "embed pos_offset", "linear_cross_entropy target", "linear_cross_entropy bias"])
def test_each_op_names_inputs_that_do_not_go_together(ops_backend, case):
    """Where an op's inputs disagree (devices, shapes, dtypes) or a position is negative, each backend
    raises op_checks' ValueError naming them, not whatever its first aten op or kernel would say."""
    q, k, v = _qkv()
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    here = q.device
    call, message = {
        "attention v": (lambda: ops_backend.attention(q, k, _meta(v)),
                        f"attention device mismatch: q {here}, k {here}, v meta"),
        "attention key_lengths": (lambda: ops_backend.attention(q, k, v, key_lengths=_meta(torch.tensor([5, 2]))),
                                  f"key_lengths is on meta but q is on {here}"),
        "add_layer_norm residual shape": (lambda: ops_backend.add_layer_norm(x, x[..., :4], w, None),
                                          "add_layer_norm: residual (2, 3, 4) != x (2, 3, 8)"),
        "add_layer_norm residual dtype": (lambda: ops_backend.add_layer_norm(x, x.half(), w, None),
                                          "add_layer_norm dtype mismatch: x torch.float32, residual torch.float16"),
        # weights on another device: torch's internal RuntimeError in eager and torch, the kernel's in triton
        "add_layer_norm weight device": (lambda: ops_backend.add_layer_norm(x, x, _meta(w), _meta(torch.zeros(8))),
                                         f"add_layer_norm: device mismatch: x {here}, residual {here}, weight meta, "
                                         "bias meta"),
        "add_layer_norm residual device": (lambda: ops_backend.add_layer_norm(x, _meta(x), w, None),
                                           f"add_layer_norm: device mismatch: x {here}, residual meta, weight {here}"),
        "ffn w2 device": (lambda: ops_backend.ffn(*_ffn_args()[:3], _meta(_ffn_args()[3]), None),
                          f"ffn: device mismatch: x {here}, w1 {here}, b1 {here}, w2 meta"),
        "ffn x device": (lambda: ops_backend.ffn(_meta(_ffn_args()[0]), *_ffn_args()[1:]),
                         f"ffn: device mismatch: x meta, w1 {here}, b1 {here}, w2 {here}, b2 {here}"),
        "embed tokens": (lambda: ops_backend.embed(_meta(torch.tensor([[1, 2]])), torch.randn(10, 16), scale=1.0),
                         f"embed: tokens on meta but weight on {here}"),
        "embed pos_offset": (lambda: ops_backend.embed(torch.tensor([[1, 2]]), torch.randn(10, 16), scale=1.0,
                                                       pos_offset=-1),
                             "embed: pos_offset must be >= 0, got -1"),
        "linear_cross_entropy target": (
            lambda: ops_backend.linear_cross_entropy(torch.randn(6, 16), torch.randn(11, 16), None,
                                                     _meta(torch.randint(0, 11, (6,)))),
            f"linear_cross_entropy: device mismatch: x {here}, weight {here}, target meta"),
        # a bias on another device: torch's internal RuntimeError in eager and torch, the kernel's in triton
        "linear_cross_entropy bias": (
            lambda: ops_backend.linear_cross_entropy(torch.randn(6, 16), torch.randn(11, 16), _meta(torch.zeros(11)),
                                                     torch.randint(0, 11, (6,))),
            f"linear_cross_entropy: device mismatch: x {here}, weight {here}, bias meta, target {here}"),
    }[case]
    with pytest.raises(ValueError, match=_esc(message)):
        call()
