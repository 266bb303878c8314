"""Under autocast the add + LayerNorm writes the next sublayer's input in autocast's dtype
(`AddNorm` in scratchformer/model/layers.py): Pre-LN its LN(s) in that dtype, Post-LN a copy of
the fp32 stream in it beside the stream; and the decoder's last norm the generator's (a final
norm's y, a Post-LN layer's copy). The step is the one where each sublayer's matmul casts
the fp32 norm output itself, bit for bit (loss and every gradient) on the eager and torch backends
and on a GPU; in Triton's interpreter, which truncates fp32 to bf16 where a cast rounds to nearest,
it is the step with the norm's fp32 output truncated outside it. And the triton step issues none
of those casts: two per sublayer fed by a norm (the input's, forward, and its gradient's,
backward), and Post-LN the add of the stream's and the copy's gradients."""

import pytest
import torch
from conftest import DEVICE, requires_cuda, step_grads, step_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from scratchformer.model import layers

KINDS = {  # step_model's overrides
    "post-ln": {},
    "pre-ln": dict(norm="pre", final_norm=True),
    "pre-ln-no-final-norm": dict(norm="pre"),
    "copy": dict(copy=True, tie_embeddings="all"),
    "classifier": dict(num_classes=3, n_decoder_layers=0, final_norm=True),
    "extractive": dict(extractive=True, n_decoder_layers=0, norm="pre", final_norm=True),
}


def _model(kind: str, kernel: str, device: str) -> nn.Module:
    return step_model(kernel, device, **KINDS[kind])


def _step(model, device, *, norm_writes: bool, monkeypatch):
    """Loss and gradients of one bf16-autocast step; with norm_writes False the norms hand on their
    fp32 output and the matmuls cast it (autocast's way)."""
    with monkeypatch.context() as m:
        if not norm_writes:
            m.setattr(layers, "autocast_dtype", lambda t: None)
        return step_grads(model, device)


@pytest.mark.parametrize("kernel", ["eager", "torch"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_the_step_is_the_same_bit_for_bit(kind, kernel, monkeypatch):
    model = _model(kind, kernel, DEVICE)
    loss, grads = _step(model, DEVICE, norm_writes=False, monkeypatch=monkeypatch)
    loss_new, grads_new = _step(model, DEVICE, norm_writes=True, monkeypatch=monkeypatch)
    assert torch.equal(loss, loss_new)
    assert grads.keys() == grads_new.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert grads_new[name].dtype == torch.float32 and torch.equal(grads[name], grads_new[name]), name


class _AsStored(torch.autograd.Function):
    """fp32 -> bf16 as a kernel's store rounds it (`_as_stored` of tests/test_add_layer_norm.py: to
    nearest even on a GPU, as a cast; Triton's interpreter drops the low 16 bits), the gradient
    cast back as a cast's is."""

    @staticmethod
    def forward(ctx, t):
        if t.is_cuda:
            return t.to(torch.bfloat16)
        return (t.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, g):
        return g.float()


@pytest.mark.parametrize("kind", ["post-ln", "pre-ln"])
def test_the_triton_step_is_the_same_bit_for_bit_as_its_stores_round(kind, monkeypatch):
    """The step is bit for bit the one where the norms hand on their fp32 output and it is rounded
    to bf16 outside them as the kernel's stores round (its gradient cast back and added to the
    stream's by autograd): in the interpreter, which truncates where a cast rounds to nearest even,
    the truncated values; on a GPU the cast's, the step without the norms' writes (below)."""
    model = _model(kind, "triton", DEVICE)
    loss_new, grads_new = _step(model, DEVICE, norm_writes=True, monkeypatch=monkeypatch)
    post, pre, norm = layers.AddNorm.post, layers.AddNorm.pre, layers.AddNorm.norm

    def post_rounded(self, x, out):
        y, _ = post(self, x, out)
        return y, _AsStored.apply(y)

    def pre_rounded(self, x, delta):
        h, x = pre(self, x, delta)
        return _AsStored.apply(h), x

    def norm_rounded(self, x, delta=None, *, for_matmul=False):  # a stack's last: the generator's input
        y = norm(self, x, delta)
        return _AsStored.apply(y) if for_matmul else y

    with monkeypatch.context() as m:
        m.setattr(layers.AddNorm, "post", post_rounded)
        m.setattr(layers.AddNorm, "pre", pre_rounded)
        m.setattr(layers.AddNorm, "norm", norm_rounded)
        loss, grads = _step(model, DEVICE, norm_writes=False, monkeypatch=monkeypatch)
    assert torch.equal(loss, loss_new)
    assert grads.keys() == grads_new.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_new[name]), name


class _CountCasts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = self.adds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default:
            self.casts += 1
        elif func is torch.ops.aten.add.Tensor:
            self.adds += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["post-ln", "pre-ln"])
def test_the_triton_step_has_no_casts_of_sublayer_inputs(kind, monkeypatch):
    """Two casts fewer per matmul input a norm writes (the input's and its gradient's): of the 2 + 2
    layers' 4 encoder and 6 decoder sublayers, Pre-LN all, Post-LN all but each stack's first
    self-attention (fed by the embedding), and each stack's output (its last norm's: the final
    norm's y, Post-LN the last layer's copy) into its one matmul, the generator's and the
    cross-attentions' K/V projection; Post-LN also one add of two gradients fewer per sublayer input
    (the stacks' outputs: none, as their fp32 output has no other reader)."""
    model = _model(kind, "triton", DEVICE)
    counts = {}
    for norm_writes in (False, True):
        with _CountCasts() as c:
            _step(model, DEVICE, norm_writes=norm_writes, monkeypatch=monkeypatch)
        counts[norm_writes] = c
    fed = 4 + 6 if kind == "pre-ln" else 3 + 5
    assert counts[False].casts - counts[True].casts == 2 * (fed + 2)
    assert counts[False].adds - counts[True].adds == (fed if kind == "post-ln" else 0)


@pytest.mark.parametrize("kernel", ["eager", "torch", "triton"])
def test_without_autocast_nothing_changes(kernel, monkeypatch):
    """fp32: the norms hand on their own output, no copy."""
    model = _model("post-ln", kernel, DEVICE)
    h = model.encoder.layers[0].norm1.post(torch.randn(2, 3, 32, device=DEVICE), torch.randn(2, 3, 32, device=DEVICE))
    assert h[0] is h[1]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y, copy = model.encoder.layers[0].norm1.post(torch.randn(2, 3, 32, device=DEVICE),
                                                     torch.randn(2, 3, 32, device=DEVICE))
    assert y.dtype == torch.float32 and copy.dtype == torch.bfloat16


@requires_cuda
@pytest.mark.parametrize("kind", ["post-ln", "pre-ln", "copy"])
def test_the_triton_step_is_the_same_bit_for_bit_on_the_gpu(kind, monkeypatch):
    """On a GPU the kernel's bf16 stores round to nearest even, as the casts: the same step."""
    model = _model(kind, "triton", "cuda")
    loss, grads = _step(model, "cuda", norm_writes=False, monkeypatch=monkeypatch)
    loss_new, grads_new = _step(model, "cuda", norm_writes=True, monkeypatch=monkeypatch)
    assert torch.equal(loss, loss_new) and all(torch.equal(grads[n], grads_new[n]) for n in grads)
