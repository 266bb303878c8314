"""Our Triton ops as torch ops (`scratchformer::*`, kernels/_common.py's `define_op`), and the model
under torch.compile.

- `torch.library.opcheck` on every op and its backward op over small ragged shapes: schema,
  fake impl (shapes, dtypes, strides equal the real outputs'), autograd registration, and
  AOTAutograd with dynamic shapes (outputs equal eager);
- the autograd: an op called through the dispatcher has its entry point's gradients (one
  `setup_context` + `backward` for both, `_common.op_autograd`); a second derivative through any
  of our ops is refused by name;
- torch.export of the triton model keeps the ops as nodes, with dynamic batch and lengths;
- the whole model compiles with `torch.compile(fullgraph=True, backend="aot_eager")` for the
  eager, torch and triton backends: zero graph breaks, outputs and gradients equal the
  uncompiled model's (train mode with dropout too, on triton: each op's Philox (seed, offset)
  tensor is drawn in the graph from the same generator, and a second call draws afresh);
- dropout's RNG state: each dropout op call gets a fresh (2,) int64 [seed, offset] tensor drawn
  on its device (kernels/_common.py's `dropout_rng`), which its backward op reuses; a compiled op
  draws afresh per call with no dynamo flag; on a GPU, a CUDA graph of forward + backward draws
  fresh masks on every replay, consistent between forward and backward;
- `compile_model` (dynamic shapes): a short training run over varied batch shapes compiles a
  handful of graphs, not one per shape.

On the CPU the kernels run in Triton's interpreter (slow): shapes and models are tiny.
"""

import types
import warnings

import pytest
import torch
from conftest import DEVICE, INTERPRET, requires_cuda
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

from scratchformer import reference as R
from scratchformer.compile import check_backend, compile_decoding, compile_model
from scratchformer.kernels import _common
from scratchformer.kernels import add_layer_norm as LN
from scratchformer.kernels import attention as A
from scratchformer.kernels import cross_entropy as CE
from scratchformer.kernels import ffn as F
from scratchformer.kernels._common import dropout_rng
from scratchformer.model import ModelConfig, beam_search, build_model, greedy_decode

OPS = torch.ops.scratchformer
V = 20


def _opcheck(op, args):
    result = torch.library.opcheck(op, args)
    assert set(result.values()) == {"SUCCESS"}, result


def _grad(*tensors):
    return [t.detach().requires_grad_() if t is not None else None for t in tensors]


def _rng(p, seed, offset, device):
    """The ops' `Tensor? rng` argument: [seed, offset] int64 on device with dropout, else None."""
    return torch.tensor([seed, offset], dtype=torch.int64, device=device) if p > 0.0 else None


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------

ATTN_CASES = {
    # name: (B, H, Lq, Lk, key lengths, query lengths, causal, dropout_p)
    "dense": (2, 2, 7, 7, None, None, False, 0.0),
    "ragged-causal": (2, 2, 7, 7, [7, 3], [7, 3], True, 0.0),
    "cross-ragged-dropout": (2, 1, 5, 9, [9, 4], [5, 2], False, 0.3),
    "decode-causal-dropout": (2, 2, 1, 6, [6, 2], None, True, 0.2),
}  # two rows make a case ragged: the interpreter runs a program per row and head, opcheck the op a dozen times


def _attn_inputs(case, device):
    B, H, Lq, Lk, kl, ql, causal, p = ATTN_CASES[case]
    q, k, v = _grad(torch.randn(B, H, Lq, 16, device=device), torch.randn(B, H, Lk, 16, device=device),
                    torch.randn(B, H, Lk, 16, device=device))
    kl = None if kl is None else torch.tensor(kl, device=device)
    ql = None if ql is None else torch.tensor(ql, dtype=torch.int32, device=device)
    return (q, k, v, kl, ql, causal, p, None, _rng(p, 1234, 77, device))


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_opcheck_attention(case, device):
    args = _attn_inputs(case, device)
    _opcheck(OPS.attention.default, args)
    out, lse = OPS.attention(*args)
    # BLHD memory viewed as BHLD, as the fake impl promises
    B, H, Lq, D = args[0].shape
    assert out.stride() == (Lq * H * D, D, H * D, 1) and lse.is_contiguous() and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    bargs = (dout, *(t.detach() for t in args[:3]), out.detach(), lse, *args[3:])
    _opcheck(OPS.attention_backward.default, bargs)


BF16 = torch.bfloat16
LN_CASES = {
    # name: (shape, residual, bias, dropout_p, x's dtype: a bf16 x on the fp32 residual stream,
    #        y's dtype (None: the stream's), y's copy's dtype (None: no copy))
    "residual-bias": ((2, 5, 32), True, True, 0.0, torch.float32, None, None),
    "no-residual-no-bias-dropout": ((3, 24), False, False, 0.3, torch.float32, None, None),
    "residual-dropout-ragged-N": ((2, 3, 40), True, True, 0.2, torch.float32, None, None),
    "bf16-x-fp32-residual-dropout": ((2, 5, 32), True, True, 0.2, BF16, None, None),
    "bf16-x-fp32-residual-bf16-y": ((2, 5, 32), True, True, 0.0, BF16, BF16, None),  # Pre-LN's sublayer input
    "bf16-x-fp32-residual-bf16-copy-dropout": ((2, 5, 32), True, True, 0.2, BF16, None, BF16),  # Post-LN's
}


@pytest.mark.parametrize("case", list(LN_CASES))
def test_opcheck_add_layer_norm(case, device):
    shape, has_res, has_bias, p, x_dtype, y_dtype, copy_dtype = LN_CASES[case]
    N = shape[-1]
    x, r, w, b = _grad(torch.randn(shape, device=device, dtype=x_dtype),
                       torch.randn(shape, device=device) if has_res else None,
                       torch.randn(N, device=device), torch.randn(N, device=device) if has_bias else None)
    rng = _rng(p, 99, 5, device)
    _opcheck(OPS.add_layer_norm.default, (x, r, w, b, 1e-5, p, rng, True, y_dtype, copy_dtype))
    with torch.no_grad():  # store_s=False: inference, s is an empty placeholder
        _opcheck(OPS.add_layer_norm.default, (x.detach(), r, w.detach(), b, 1e-5, p, rng, False, y_dtype, copy_dtype))
    y, s, mean, rstd, copy = OPS.add_layer_norm(x, r, w, b, 1e-5, p, rng, True, y_dtype, copy_dtype)
    assert y.dtype == (y_dtype or s.dtype) and (copy_dtype is None) == (copy.numel() == 0)
    dy, ds, dcopy = torch.randn_like(y), torch.randn_like(s), torch.randn_like(copy) if copy.numel() else None
    saved = (s.detach(), w.detach(), mean, rstd)
    for ds_arg, store_dres in ((None, False), (ds, True)):
        _opcheck(OPS.add_layer_norm_backward.default,
                 (dy, dcopy, ds_arg, *saved, has_bias, p, rng, store_dres, x_dtype))


FFN_CASES = {
    # name: (leading shape, d_model, d_ff, activation, b1, b2, dropout_p)
    "relu-bias": ((2, 5), 32, 48, "relu", True, True, 0.0),
    "gelu-dropout-no-b1": ((7,), 16, 32, "gelu", False, True, 0.3),
    "relu-dropout-no-b2": ((3, 3), 32, 16, "relu", True, False, 0.2),
}


@pytest.mark.parametrize("case", list(FFN_CASES))
def test_opcheck_ffn(case, device):
    lead, d, f, act, has_b1, has_b2, p = FFN_CASES[case]
    x, w1, b1, w2, b2 = _grad(
        torch.randn(*lead, d, device=device), torch.randn(f, d, device=device) / d**0.5,
        torch.randn(f, device=device) if has_b1 else None, torch.randn(d, f, device=device) / f**0.5,
        torch.randn(d, device=device) if has_b2 else None,
    )
    store_pre = act == "gelu"
    rng = _rng(p, 42, 3, device)
    _opcheck(OPS.ffn.default, (x, w1, b1, w2, b2, act, p, rng, store_pre))
    y, a, pre = OPS.ffn(x, w1, b1, w2, b2, act, p, rng, store_pre)
    assert a.shape == (x.numel() // d, f) and (pre.shape == a.shape) == store_pre
    dy = torch.randn_like(y)
    for needs_dx in (True, False):
        _opcheck(OPS.ffn_backward.default, (dy, x.detach(), w1.detach(), w2.detach(), a.detach(), pre.detach(), act,
                                            has_b1, has_b2, p, rng, needs_dx))


def test_public_entry_points_go_through_the_ops(device):
    """The entry points run the registered forward ops, and their autograd.Functions the backward ops."""
    x = torch.randn(2, 4, 32, device=device, requires_grad=True)
    w = torch.ones(32, device=device, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        LN.add_layer_norm(x, None, w, None).sum().backward()
        q = torch.randn(1, 1, 3, 16, device=device, requires_grad=True)
        A.attention(q, q, q).sum().backward()
        w1 = torch.randn(16, 16, device=device, requires_grad=True)
        F.ffn(q[0, 0], w1, None, w1, None).sum().backward()
    names = {e.name for e in prof.events()}
    for op in ("add_layer_norm", "add_layer_norm_backward", "attention", "attention_backward", "ffn", "ffn_backward"):
        op = f"scratchformer::{op}"
        assert op in names, op


def test_without_grad_the_entry_points_call_the_ops_alone(device):
    """No gradient wanted (inference, decoding): the entry points call the forward op without its
    autograd.Function (no node to build: host time per call, bench/host_overhead.py), and give
    what the autograd path gives."""
    x = torch.randn(2, 4, 32, device=device, requires_grad=True)
    w = torch.ones(32, device=device, requires_grad=True)
    q = torch.randn(1, 2, 3, 16, device=device, requires_grad=True)
    w1 = torch.randn(16, 16, device=device, requires_grad=True)
    calls = {
        "add_layer_norm": lambda: LN.add_layer_norm(x, None, w, None),
        "attention": lambda: A.attention(q, q, q, key_lengths=torch.tensor([2], device=device)),
        "ffn": lambda: F.ffn(q[0, 0], w1, None, w1, None),
    }
    for name, call in calls.items():
        with_grad = call()
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            without = call()
        names = {e.name for e in prof.events()}
        assert with_grad.grad_fn is not None and without.grad_fn is None, name
        assert f"scratchformer::{name}" in names and not any("Function" in n for n in names), (name, names)
        torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)


def _entry_and_op_calls(device):
    """name -> (inputs that want a gradient, the entry point's call, the op's through the
    dispatcher, the eager reference's: y alone), on small ragged inputs."""
    torch.manual_seed(0)
    q, k, v = _grad(*(torch.randn(2, 2, n, 16, device=device) for n in (5, 7, 7)))
    kl = torch.tensor([7, 3], device=device)
    x, r, w, b = _grad(torch.randn(2, 5, 32, device=device), torch.randn(2, 5, 32, device=device),
                       torch.randn(32, device=device), torch.randn(32, device=device))
    w1, b1, w2, b2 = _grad(torch.randn(48, 32, device=device) / 6, torch.randn(48, device=device),
                           torch.randn(32, 48, device=device) / 7, torch.randn(32, device=device))
    return {
        "attention": ((q, k, v), lambda: A.attention(q, k, v, key_lengths=kl),
                      lambda: OPS.attention(q, k, v, kl, None, False, 0.0, None, None)[0],
                      lambda: R.attention_ref(q, k, v, key_lengths=kl)),
        "add_layer_norm": ((x, r, w, b), lambda: LN.add_layer_norm(x, r, w, b),
                           lambda: OPS.add_layer_norm(x, r, w, b, 1e-5, 0.0, None, True, None, None)[0],
                           lambda: R.add_layer_norm_ref(x, r, w, b)),
        "ffn": ((x, w1, b1, w2, b2), lambda: F.ffn(x, w1, b1, w2, b2, activation="gelu"),
                lambda: OPS.ffn(x, w1, b1, w2, b2, "gelu", 0.0, None, True)[0],
                lambda: R.ffn_ref(x, w1, b1, w2, b2, activation="gelu")),
    }


@pytest.mark.parametrize(("module", "title"), [(A, "AttentionFunction"), (LN, "AddLayerNormFunction"),
                                              (F, "FFNFunction"), (CE, "LinearCrossEntropyFunction")])
def test_each_autograd_function_is_named_as_its_entry_point_calls_it(module, title):
    """The Function an entry point applies carries its own name (tracebacks, grad_fn, profiles):
    `op_autograd` builds the class, so the name is given, not derived from the op's."""
    function = getattr(module, title)
    assert (function.__name__, function.__qualname__, function.__module__) == (title, title, module.__name__)


@pytest.mark.parametrize("name", ["attention", "add_layer_norm", "ffn"])
def test_an_op_called_through_the_dispatcher_is_differentiable(name, device):
    """torch.ops.scratchformer.<op> on inputs that want a gradient (a user's own code, opcheck)
    has the entry point's autograd, registered on the op: the same gradients, bit for bit, those
    of the eager reference, and no warning (before, autograd's fallback warned and left every
    gradient None)."""
    inputs, entry, op, ref = _entry_and_op_calls(device)[name]
    y = entry()
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, inputs, dy)
    with warnings.catch_warnings():  # autograd's fallback, had the op no autograd of its own
        warnings.filterwarnings("error", r"scratchformer::\w+: an autograd kernel was not registered")
        got = torch.autograd.grad(op(), inputs, dy)
    for g, w, r in zip(got, want, torch.autograd.grad(ref(), inputs, dy), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_an_op_called_without_what_its_backward_needs_says_so(device):
    """The forward ops store what the backward needs only when asked (store_s, store_pre: the
    entry points ask when a gradient is wanted); called through the dispatcher without it, the
    backward names what is missing instead of failing inside a launcher."""
    calls = _entry_and_op_calls(device)
    (x, r, w, b), *_ = calls["add_layer_norm"]
    (_, w1, b1, w2, b2), *_ = calls["ffn"]
    y = OPS.add_layer_norm(x, r, w, b, 1e-5, 0.0, None, False, None, None)[0]
    with pytest.raises(RuntimeError, match=r"add_layer_norm: the backward needs s .*\(store_s=False\)"):
        y.sum().backward()
    y = OPS.ffn(x, w1, b1, w2, b2, "gelu", 0.0, None, False)[0]
    with pytest.raises(RuntimeError, match=r"ffn: the gelu backward needs the pre-activation.*\(store_pre=False\)"):
        y.sum().backward()


def _gradless_op_calls(device):
    """name -> a call of that op through the dispatcher, on inputs that want a gradient: the loss
    op (it returns the gradients of its summed loss) and the backward ops (their gradient would
    be a second derivative)."""
    calls = _entry_and_op_calls(device)
    (q, k, v), *_ = calls["attention"]
    (x, r, w, b), *_ = calls["add_layer_norm"]
    (_, w1, b1, w2, b2), *_ = calls["ffn"]
    x2, w3 = _grad(torch.randn(6, 16, device=device), torch.randn(10, 16, device=device))
    target = torch.randint(1, 10, (6,), device=device)
    with torch.no_grad():
        out, lse = OPS.attention(q, k, v, None, None, False, 0.0, None, None)
        _, s, mean, rstd, _ = OPS.add_layer_norm(x, r, w, b, 1e-5, 0.0, None, True, None, None)
        _, a, pre = OPS.ffn(x, w1, b1, w2, b2, "gelu", 0.0, None, True)
    dout = _grad(torch.randn_like(out))[0]
    return {
        "linear_cross_entropy": lambda: OPS.linear_cross_entropy(x2, w3, None, target, 0.1, 0, True)[0],
        "attention_backward": lambda: OPS.attention_backward(dout, q, k, v, out, lse, None, None, False, 0.0,
                                                             None, None)[0],
        "add_layer_norm_backward": lambda: OPS.add_layer_norm_backward(torch.ones_like(s), None, None, s, w, mean,
                                                                       rstd, True, 0.0, None, False,
                                                                       torch.float32)[2],
        "ffn_backward": lambda: OPS.ffn_backward(torch.randn_like(x), x, w1, w2, a, pre, "gelu", True, True, 0.0,
                                                 None, True)[1],
    }


@pytest.mark.parametrize("name,why", [
    ("linear_cross_entropy", r"not differentiated itself.*call linear_cross_entropy\(\.\.\.\)"),
    ("attention_backward", "no gradient: it would be a second derivative of scratchformer::attention"),
    ("add_layer_norm_backward", "no gradient: it would be a second derivative of scratchformer::add_layer_norm"),
    ("ffn_backward", "no gradient: it would be a second derivative of scratchformer::ffn"),
])
def test_an_op_with_no_gradient_refuses_one_by_name(name, why, device):
    """Called through the dispatcher on inputs that want a gradient, an op with none to give (the
    loss op, whose per-row loss would need dW reweighted per row; a backward op) refuses its
    backward, naming itself, where autograd's fallback would warn and leave the gradients None."""
    y = _gradless_op_calls(device)[name]()
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=rf"scratchformer::{name}: {why}"):
        y.sum().backward()


@pytest.mark.parametrize("name", ["attention", "add_layer_norm", "ffn", "linear_cross_entropy", "the model"])
def test_a_second_derivative_is_refused_by_name(name, device):
    """Our backward kernels have no derivative of their own: under create_graph=True (a gradient
    penalty, a Hessian-vector product) the backward refuses, naming the op, instead of handing
    back gradients with no history (which a penalty would then silently drop). First-order
    gradients, of the entry points and of the op called through the dispatcher, are unaffected."""
    if name == "linear_cross_entropy":
        x, w = _grad(torch.randn(6, 16, device=device), torch.randn(10, 16, device=device))
        target = torch.randint(1, 10, (6,), device=device)
        inputs, calls = (x, w), [lambda: CE.linear_cross_entropy(x, w, None, target, label_smoothing=0.1)[0]]
    elif name == "the model":
        model = _model("triton")
        src, sl, tgt_in, tl, tgt_out = _batch()
        inputs = [p for p in model.parameters() if p.requires_grad]
        calls = [lambda: model(src, sl, tgt_in, tl, target=tgt_out, label_smoothing=0.1)[0]]
    else:
        inputs, entry, op, _ = _entry_and_op_calls(device)[name]
        calls = [entry, op]
    for call in calls:
        y = call()
        assert all(g is not None for g in torch.autograd.grad(y.sum(), inputs, retain_graph=True))
        with pytest.raises(RuntimeError, match=r"scratchformer::\w+: no second derivative .*--kernel eager for that"):
            torch.autograd.grad(y.sum(), inputs, create_graph=True)


def test_the_eager_model_has_the_second_derivative_the_triton_model_refuses():
    """The reference backend (plain tensor ops) gives a second derivative: the refusal above is
    our kernels', not the model's."""
    model = _model("eager")
    src, sl, tgt_in, tl, tgt_out = _batch()
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(src, sl, tgt_in, tl, target=tgt_out, label_smoothing=0.1)[0]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    assert all(g is not None and g.abs().sum() > 0 for g in torch.autograd.grad(penalty, params[:3]))


class _Recorder(TorchDispatchMode):
    """Passes every op through, recording the scratchformer:: ones it sees (the dispatcher's calls)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("scratchformer::"):
            self.ops.append(func._schema.name.split("::")[1])
        return func(*args, **(kwargs or {}))


class _Plain(torch.Tensor):
    """A tensor subclass with no dispatch of its own (torch's default __torch_function__)."""


def test_eager_op_calls_skip_the_dispatcher_unless_something_intercepts(device, monkeypatch):
    """In plain eager the entry points call each op's impl directly (`_common.call_op`: the
    dispatcher would only box the arguments and call it): the impls, swapped for recording ones
    in `_IMPLS` (which the dispatcher does not read), see every forward and backward call. With a
    dispatch mode, the profiler, or a tensor subclass argument, the calls go through the
    dispatcher instead (the mode sees them; the swapped impls do not); the outputs and gradients
    are the same either way."""
    direct = []
    for op, impl in list(_common._IMPLS.items()):
        monkeypatch.setitem(_common._IMPLS, op, lambda *a, _impl=impl, _name=op._schema.name: (
            direct.append(_name.split("::")[1]), _impl(*a))[1])
    x = torch.randn(2, 4, 32, device=device)
    w = torch.randn(32, device=device)
    q = torch.randn(1, 2, 3, 16, device=device)
    w1 = torch.randn(16, 16, device=device)
    classes = torch.randn(16, 32, device=device)
    target = torch.tensor([1, 0, 5, 15], device=device)
    calls = {
        "add_layer_norm": lambda x, w: LN.add_layer_norm(x, None, w, None),
        "attention": lambda x, w: A.attention(x, x, x * w[:16]),
        "ffn": lambda x, w: F.ffn(x, w, None, w, None),
        "linear_cross_entropy": lambda x, w: CE.linear_cross_entropy(x, w, None, target, label_smoothing=0.1)[0],
    }
    inputs = {"add_layer_norm": (x, w), "attention": (q, w), "ffn": (q[0, 0], w1),
              "linear_cross_entropy": (x[0], classes)}
    # the ops each call makes, forward then backward (linear_cross_entropy's forward computes its gradients)
    ops = {name: [name, f"{name}_backward"] for name in calls} | {"linear_cross_entropy": ["linear_cross_entropy"]}
    for name, call in calls.items():
        results = []
        for how in ("eager", "mode", "profiler", "subclass"):
            direct.clear()
            leaves = [t.detach().clone().requires_grad_() for t in inputs[name]]
            if how == "subclass":
                leaves[0] = leaves[0].detach().as_subclass(_Plain).requires_grad_()
            recorder = _Recorder()
            with recorder if how == "mode" else torch.profiler.profile() if how == "profiler" else torch.enable_grad():
                out = call(*leaves)
                grads = torch.autograd.grad(out.sum(), leaves)
            assert direct == (ops[name] if how == "eager" else []), (name, how, direct)
            assert recorder.ops == (ops[name] if how == "mode" else []), (name, how, recorder.ops)
            results.append((out.as_subclass(torch.Tensor).detach(), [g.as_subclass(torch.Tensor) for g in grads]))
        for out, grads in results[1:]:
            torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
            for g, r in zip(grads, results[0][1], strict=True):
                torch.testing.assert_close(g, r, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# dropout's RNG state: a (2,) int64 [seed, offset] tensor drawn on the op's device per call
# ---------------------------------------------------------------------------------------------

DROPOUT_OPS = ("attention", "add_layer_norm", "ffn")
ENTRY_MODULES = {"attention": A, "add_layer_norm": LN, "ffn": F}


def _dropout_case(name, device):
    """(call, leaves): call(**kw) runs the op's entry point with dropout 0.3 on fixed fp32 inputs
    (kw: seed, return_dropout_mask); leaves are the inputs that take a gradient. ffn is gelu, whose
    backward replays the mask from the rng tensor (relu's reads it off the saved output)."""
    g = torch.Generator().manual_seed(1)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device).requires_grad_()

    if name == "attention":
        q, k, v = leaf(2, 2, 9, 16), leaf(2, 2, 11, 16), leaf(2, 2, 11, 16)
        return (lambda **kw: A.attention(q, k, v, causal=True, dropout_p=0.3, **kw)), [q, k, v]
    if name == "add_layer_norm":
        x, r, w, b = leaf(3, 5, 40), leaf(3, 5, 40), leaf(40), leaf(40)
        return (lambda **kw: LN.add_layer_norm(x, r, w, b, dropout_p=0.3, **kw)), [x, r, w, b]
    x, w1, b1, w2, b2 = leaf(3, 5, 32), leaf(48, 32, scale=32**-0.5), leaf(48), leaf(32, 48, scale=48**-0.5), leaf(32)
    return (lambda **kw: F.ffn(x, w1, b1, w2, b2, activation="gelu", dropout_p=0.3, **kw)), [x, w1, b1, w2, b2]


def test_dropout_rng_helper(device):
    assert dropout_rng(0.0, None, device) is None and dropout_rng(0.0, 7, device) is None  # nothing drawn
    given = dropout_rng(0.1, 2**40, device)
    assert given.dtype == torch.int64 and given.tolist() == [2**40, 0]
    torch.manual_seed(3)
    drawn = dropout_rng(0.1, None, device)
    assert drawn.dtype == torch.int64 and drawn.shape == (2,) and drawn.device.type == torch.device(device).type
    assert ((drawn >= 0) & (drawn < 2**31 - 1)).all()
    torch.manual_seed(3)
    assert torch.equal(dropout_rng(0.1, None, device), drawn)  # torch's generator for that device


@pytest.mark.parametrize("name", DROPOUT_OPS)
def test_dropout_fresh_per_call_reproducible_with_manual_seed(name, device):
    """seed=None: each call draws a fresh (seed, offset), so two calls drop different elements; the
    same torch.manual_seed gives the same masks and outputs again."""
    call, _ = _dropout_case(name, device)
    torch.manual_seed(5)
    (out1, m1), (out2, m2) = call(return_dropout_mask=True), call(return_dropout_mask=True)
    assert not torch.equal(m1, m2) and not torch.equal(out1, out2)
    torch.manual_seed(5)
    (again1, n1), (again2, n2) = call(return_dropout_mask=True), call(return_dropout_mask=True)
    assert torch.equal(m1, n1) and torch.equal(m2, n2)
    assert torch.equal(out1, again1) and torch.equal(out2, again2)


class _OpRng(TorchDispatchMode):
    """Records the `rng` argument of every scratchformer:: op call: [(op name, rng, first tensor arg)]."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        if schema.name.startswith("scratchformer::"):
            names = [a.name for a in schema.arguments]
            if "rng" in names:
                self.calls.append((schema.name.split("::")[1], args[names.index("rng")], args[0]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", DROPOUT_OPS)
def test_dropout_rng_tensor_passed_to_the_op_and_its_backward(name, device):
    """The forward op gets a (2,) int64 tensor on its own device; the backward op the same tensor
    (saved, not redrawn), so it replays the forward's mask; a given seed gives [seed, 0]; without
    dropout, None."""
    call, leaves = _dropout_case(name, device)
    with _OpRng() as rec:
        out = call()
        out.sum().backward()
    (fwd_name, rng, first), (bwd_name, bwd_rng, _) = rec.calls
    assert (fwd_name, bwd_name) == (name, f"{name}_backward")
    assert rng.dtype == torch.int64 and rng.shape == (2,) and rng.device == first.device
    assert bwd_rng.data_ptr() == rng.data_ptr() and torch.equal(bwd_rng, rng)
    with _OpRng() as rec:
        call(seed=17)
    assert rec.calls[0][1].tolist() == [17, 0] and rec.calls[0][1].device == first.device
    module = ENTRY_MODULES[name]
    x = leaves[0]
    with _OpRng() as rec:  # no dropout: no tensor drawn
        if name == "attention":
            module.attention(x, x, x)
        elif name == "add_layer_norm":
            module.add_layer_norm(x, None, leaves[2], None)
        else:
            module.ffn(x, *leaves[1:], activation="gelu")
    assert rec.calls[0][1] is None


class _Fills(TorchDispatchMode):
    """Records the ops that build filled tensors (zeros and the like) outside our ops."""

    FILLS = {"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "full", "full_like", "new_full"}

    def __init__(self):
        super().__init__()
        self.fills = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[1] in self.FILLS:
            self.fills.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", DROPOUT_OPS)
def test_backward_builds_no_zero_gradients(name, device):
    """Autograd hands each backward op the gradients of the outputs that take one and builds no
    zero tensor for the others (the forward's saved activations, attention's lse: the FFN's were
    (M, d_ff) each, filled and passed in unread, until its Function stopped materialising them)."""
    call, _ = _dropout_case(name, device)
    out = call()
    with _Fills() as rec:
        out.sum().backward()
    assert rec.fills == []


@pytest.mark.parametrize("name", DROPOUT_OPS)
def test_compiled_dropout_op_draws_fresh_masks(name, device):
    """torch.compile(fullgraph=True) of an entry point with dropout traces its (seed, offset) draw
    as an ordinary op (no dynamo flag, no graph break, one graph): each call of the compiled graph
    draws afresh, and under the same torch.manual_seed the outputs and gradients equal eager's."""
    call, leaves = _dropout_case(name, device)

    def fwd_bwd(fn):
        out = fn()
        return out, torch.autograd.grad(out.sum(), leaves)

    torch.manual_seed(3)
    ref = [fwd_bwd(call) for _ in range(2)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda: call(), fullgraph=True, backend=cnt)
    assert not torch._dynamo.config.capture_scalar_outputs
    torch.manual_seed(3)
    got = [fwd_bwd(compiled) for _ in range(2)]
    assert cnt.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    graph_ops = {str(n.target) for gm in cnt.graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any("randint" in t for t in graph_ops), graph_ops  # the draw is in the graph
    assert not torch.equal(got[0][0], got[1][0])  # fresh masks per call
    for (out, grads), (r_out, r_grads) in zip(got, ref, strict=True):
        torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, r_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@requires_cuda
@pytest.mark.parametrize("name", DROPOUT_OPS)
def test_cuda_graph_replays_draw_fresh_consistent_masks(name, monkeypatch):
    """A forward + backward of the op captured in a torch.cuda.CUDAGraph: each replay draws a new
    (seed, offset) into the graph's rng tensor (torch's CUDA generator is graph-safe), so two
    replays drop different elements; and each replay's outputs and gradients equal an eager call
    fed that replay's rng, read back from the tensor: forward and backward used the same, fresh mask."""
    module = ENTRY_MODULES[name]
    real = module.dropout_rng
    drawn = []

    def recording(*args):
        rng = real(*args)
        drawn.append(rng)
        return rng

    monkeypatch.setattr(module, "dropout_rng", recording)
    call, leaves = _dropout_case(name, "cuda")
    dout = torch.randn_like(call())

    def step():
        out = call()
        return (out, *torch.autograd.grad(out, leaves, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, autotune and warm the allocator outside the capture
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    drawn.clear()
    with torch.cuda.graph(graph):
        static = step()
    (rng,) = drawn  # the graph's rng tensor: every replay redraws it in place
    assert rng.is_cuda and rng.dtype == torch.int64
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(([t.clone() for t in static], rng.clone()))
    (first, rng1), (second, rng2) = replays
    assert not torch.equal(rng1, rng2), "the replays reused one (seed, offset)"
    assert not torch.equal(first[0], second[0]), "the replays reused one dropout mask"
    for got, replay_rng in replays:
        monkeypatch.setattr(module, "dropout_rng", lambda *args, r=replay_rng: r.clone())
        want = step()  # eager, with the replay's (seed, offset)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# the whole model under torch.compile
# ---------------------------------------------------------------------------------------------


def _model(kernel, **kw):
    torch.manual_seed(0)
    base = dict(src_vocab_size=V, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32,
                dropout=0.0)
    base.update(kw)
    return build_model(ModelConfig(**base, kernel=kernel), DEVICE)


def _batch():
    """Two ragged rows (a full and a padded one each side): the interpreter runs a kernel program
    per (row, head), so each row more costs the triton tests a share of their time."""
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(4, V, (2, 7), generator=g), torch.randint(4, V, (2, 6), generator=g)
    batch = src, torch.tensor([7, 2]), tgt[:, :-1], torch.tensor([5, 1]), tgt[:, 1:]
    return tuple(t.to(DEVICE) for t in batch)


def _loss_and_grads(model, batch, seed=0):
    src, sl, tgt_in, tl, tgt_out = batch
    torch.manual_seed(seed)
    logits = model(src, sl, tgt_in, tl)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt_out.reshape(-1))
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return logits, grads


@pytest.mark.parametrize(
    "kernel,train,copy",
    [("eager", False, False), ("torch", False, False), ("triton", False, False), ("triton", True, False),
     ("triton", False, True)],
    ids=["eager", "torch", "triton", "triton-dropout", "triton-copy"],
)
def test_model_compiles_fullgraph(kernel, train, copy):
    kw = dict(dropout=0.1, attn_dropout=0.1, ffn_dropout=0.1) if train else {}
    model = _model(kernel, copy=copy, **kw).train(train)
    batch = _batch()
    ref_logits, ref_grads = _loss_and_grads(model, batch)  # eager first: resolves the backend
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=cnt)  # no dynamo flag, dropout or not
    logits, grads = _loss_and_grads(compiled, batch)
    assert cnt.frame_count >= 1 and not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    if kernel == "triton":  # the hot paths are our op nodes in the graph, not traced-through code
        # (inside autograd_function_apply's forward and backward subgraphs, our autograd.Functions)
        graphs = [sub for gm in cnt.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)]
        targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
        for op in ("scratchformer.attention.default", "scratchformer.add_layer_norm.default",
                   "scratchformer.ffn.default", "scratchformer.embed_sinusoidal.default"):
            assert op in targets, (op, sorted(t for t in targets if "scratchformer" in t))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    if train:  # a second call draws fresh dropout (seed, offset) tensors (not baked into the graph);
        # its forward alone (grad mode on, as above: the same graph's guards)
        src, sl, tgt_in, tl, _ = batch
        torch.manual_seed(1)
        again = compiled(src, sl, tgt_in, tl)
        assert not torch.equal(again, logits)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_model_loss_compiles_fullgraph():
    """The training loss the model returns (`forward(target=)`): one graph with the fused generator +
    loss as our op node, the same loss and gradients as uncompiled."""
    model = _model("triton").train(False)
    src, sl, tgt_in, tl, tgt_out = _batch()
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(m):
        loss, nll = m(src, sl, tgt_in, tl, target=tgt_out, label_smoothing=0.1)
        return loss, nll, torch.autograd.grad(loss, params)

    ref = loss_and_grads(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    got = loss_and_grads(torch.compile(model, fullgraph=True, backend=cnt))
    assert not torch._dynamo.utils.counters["graph_break"]
    graphs = [sub for gm in cnt.graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)]
    assert "scratchformer.linear_cross_entropy.default" in {str(n.target) for gm in graphs for n in gm.graph.nodes}
    torch.testing.assert_close(got[:2], ref[:2], rtol=1e-5, atol=1e-6)
    for g, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# compile_model: dynamic shapes, recompiles over a run with varied lengths
# ---------------------------------------------------------------------------------------------

MAX_GRAPHS = 3  # measured: 1 (docs/training.md, `--compile`)


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_compile_model_few_recompiles_over_varied_lengths(kernel):
    """20 training steps (forward, backward, AdamW) on batches of varied size and lengths, as
    length bucketing gives: compile_model's dynamic shapes keep the graph count at a handful, and
    each graph is traced once (with every Python float of the model symbolic, torch.compile's
    dynamic=True, dynamo specialised them and traced the model again: two frames for one graph).
    On every backend: the torch backend's embedding sized its position table from the length's
    bit_length(), which specialised each graph on its length (a graph per batch: 6 for 6). The
    triton backend under the interpreter: 3 steps, 3 shapes (each step is seconds of kernels)."""
    steps = 3 if kernel == "triton" and INTERPRET else 20
    model = _model(kernel, dropout=0.1).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = compile_model(model, backend=cnt)
    assert not torch._dynamo.config.capture_scalar_outputs  # compile_model sets no dynamo flag
    g = torch.Generator().manual_seed(1)
    shapes = set()
    for _ in range(steps):
        B, Ls, Lt = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((2, 6), (2, 12), (2, 10)))
        src, tgt = torch.randint(4, V, (B, Ls), generator=g), torch.randint(4, V, (B, Lt + 1), generator=g)
        sl, tl = torch.randint(1, Ls + 1, (B,), generator=g), torch.randint(1, Lt + 1, (B,), generator=g)
        sl[0], tl[0] = Ls, Lt
        src, tgt, sl, tl = (t.to(DEVICE) for t in (src, tgt, sl, tl))
        shapes.add((B, Ls, Lt))
        logits = compiled(src, sl, tgt[:, :-1], tl)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    print(f"{len(shapes)} distinct (B, Ls, Lt) shapes over {steps} steps -> {graphs} graph(s)")
    assert len(shapes) >= 0.75 * steps
    assert 1 <= graphs <= min(MAX_GRAPHS, len(shapes) - 1)
    assert cnt.frame_count == graphs, f"{cnt.frame_count} traces for {graphs} graph(s)"
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_compile_decoding_equals_uncompiled_with_one_graph_for_every_step(kernel):
    """compile_decoding: greedy and beam search with the KV cache, compiled, give the uncompiled
    tokens, with no graph break (the cache's in-place appends are traced), and every step of every
    decoding reuses the step's graph: the encoder compiled once (its inputs' dims dynamic from the
    first call), the step for the first batch size (its static caches' size) and once more (dynamic)
    for the next, none for the 12 steps nor for a third size; beam search's step once (its K
    hypotheses a source read the source's cross-attention keys and values as one row of queries, so
    its rows are K times its sources, where greedy's are as many: one size then), and none for a
    second beam search of another size. Each graph is traced once:
    before, 4 frames and two restarted traces, when torch.compile's dynamic=True made the floats symbolic.
    Before static caches, torch's and triton's embeddings took the step's position as an int and
    dynamo compiled every step anew (11 frames for 12 greedy steps). On triton, whose kernels run in
    the interpreter, fewer steps and beam search on one size."""
    model = _model(kernel).eval()
    g = torch.Generator().manual_seed(3)
    sizes, steps, beams = ((5, 3, 2), 12, 2) if kernel != "triton" else ((3, 2), 4, 1)
    batches = [(torch.randint(4, V, (b, 7), generator=g), torch.randint(2, 8, (b,), generator=g)) for b in sizes]

    def decode():
        with torch.no_grad():
            return ([greedy_decode(model, src, sl, max_len=steps, no_repeat_ngram=2) for src, sl in batches]
                    + [beam_search(model, src, sl, max_len=steps, beam_size=3) for src, sl in batches[-beams:]])

    ref = decode()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compile_decoding(model, backend=cnt)
    assert not torch._dynamo.config.capture_scalar_outputs  # no dynamo flag set
    out = decode()
    assert cnt.frame_count == 4 and not torch._dynamo.utils.counters["graph_break"], cnt.frame_count
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)


class _Scaled(torch.nn.Module):
    """A tiny module whose output depends on its inputs' sizes: x (B, L), scale (B,) -> (B,)."""

    def forward(self, x, scale):
        return x.sum(-1) * x.shape[1] * scale


def test_compile_model_makes_every_dim_of_its_inputs_dynamic_from_the_first_call():
    """compile_model's dynamic=True (its default): every dim of every tensor a call is given,
    positional or keyword, symbolic from the first call, so three calls of new batch sizes and
    lengths trace one graph (torch's automatic dynamic, dynamic=None, traces a static graph first
    and a dynamic one at the first change: 2; a batch dim left static, in `scale` or in `x`, is
    specialised, the same); dynamic=False traces one graph a shape (3). The outputs are the eager
    module's."""
    eager = _Scaled()
    for dynamic, traces in ((True, 1), (False, 3)):
        torch._dynamo.reset()
        cnt = CompileCounterWithBackend("eager")
        compiled = compile_model(_Scaled(), backend=cnt) if dynamic else compile_model(_Scaled(), backend=cnt,
                                                                                         dynamic=False)
        for B, L in ((2, 3), (4, 5), (3, 7)):
            x, scale = torch.randn(B, L), torch.randn(B)
            torch.testing.assert_close(compiled(x, scale=scale), eager(x, scale=scale))
        assert cnt.frame_count == traces, (dynamic, cnt.frame_count)


def test_compile_passes_mode_and_fullgraph_to_torch_compile(monkeypatch):
    """compile_model and compile_decoding hand torch.compile the mode they are given (the trainer's
    --compile-mode reduce-overhead: inductor's CUDA graphs, GPU only, so torch.compile is stood in
    for here) and compile_model its fullgraph; compile_decoding compiles both encode and decode."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn, kw)) or fn)
    module = _Scaled()
    compile_model(module, backend="inductor", mode="max-autotune", fullgraph=True)
    (fn, kw), = seen
    assert fn is module and (kw["backend"], kw["mode"], kw["fullgraph"]) == ("inductor", "max-autotune", True)
    seen.clear()
    encode, decode = (lambda *a: None), (lambda *a: None)
    compile_decoding(types.SimpleNamespace(encode=encode, decode=decode), backend="inductor", mode="reduce-overhead")
    assert [fn for fn, _ in seen] == [encode, decode]
    assert all((kw["backend"], kw["mode"]) == ("inductor", "reduce-overhead") for _, kw in seen)


def test_compile_model_refuses_a_graph_break_with_fullgraph():
    """compile_model(fullgraph=True) turns a graph break into an error (what --compile's tests
    rely on to show the model is one graph); without it the module runs in two graphs."""

    class Breaks(torch.nn.Module):
        def forward(self, x):
            x = x + 1
            torch._dynamo.graph_break()
            return x * 2

    x = torch.ones(2, 3)
    torch._dynamo.reset()
    assert torch.equal(compile_model(Breaks(), backend="eager")(x), (x + 1) * 2)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compile_model(Breaks(), backend="eager", fullgraph=True)(x)


def test_compile_refuses_a_backend_torch_does_not_have():
    """A backend torch.compile does not have is refused by name before anything is traced, by
    compile_model and compile_decoding alike (torch's own error comes from deep inside dynamo);
    torch's debug backends (aot_eager, eager: the tests' and a CPU's) and inductor are accepted."""
    for backend in ("inductor", "aot_eager", "eager"):
        check_backend(backend)
    with pytest.raises(ValueError, match="--compile nosuch: torch.compile has no such backend; it has .*aot_eager"):
        compile_model(_Scaled(), backend="nosuch")
    model = types.SimpleNamespace(encode=lambda *a: None, decode=lambda *a: None)
    with pytest.raises(ValueError, match="--compile nosuch: torch.compile has no such backend"):
        compile_decoding(model, backend="nosuch")


def test_export_triton_model_with_dynamic_shapes():
    """torch.export of the triton model: our ops stay as nodes (fake impls give the shapes), with
    batch and lengths dynamic, and the exported program computes what the model does."""
    model = _model("triton").eval()
    src, sl, tgt_in, tl, _ = (t.contiguous() for t in _batch())  # a sliced tgt_in ties its stride to Lt + 1
    with torch.no_grad():
        ref = model(src, sl, tgt_in, tl)  # eager first: resolves the backend
    B, Ls, Lt = (torch.export.Dim(n, min=2, max=512) for n in ("B", "Ls", "Lt"))
    dynamic = ({0: B, 1: Ls}, {0: B}, {0: B, 1: Lt}, {0: B})
    ep = torch.export.export(model, (src, sl, tgt_in, tl), dynamic_shapes=dynamic)
    targets = {str(n.target) for n in ep.graph.nodes}
    for op in ("attention", "add_layer_norm", "ffn", "embed_sinusoidal"):
        assert f"scratchformer.{op}.default" in targets, op
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(src, sl, tgt_in, tl), ref, rtol=1e-5, atol=1e-6)
