"""Under autocast the add + LayerNorm writes the next sublayer's input in autocast's dtype
(`AddNorm` in scratchformer/model/layers.py): Pre-LN its LN(s) in that dtype, Post-LN a copy of
the fp32 stream in it beside the stream. The step is the one where each sublayer's matmul casts
the fp32 norm output itself, bit for bit (loss and every gradient) on the eager and torch backends
and on a GPU; in Triton's interpreter, which truncates fp32 to bf16 where a cast rounds to nearest,
it is the step with the norm's fp32 output truncated outside it. And the triton step issues none
of those casts: two per sublayer fed by a norm (the input's, forward, and its gradient's,
backward), and Post-LN the add of the stream's and the copy's gradients."""

import pytest
import torch
from conftest import DEVICE, requires_cuda
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from scratchformer.model import build_model, get_config, layers

V = 50
KINDS = ("post-ln", "pre-ln", "pre-ln-no-final-norm", "copy", "classifier", "extractive")


def _model(kind: str, kernel: str, device: str) -> nn.Module:
    overrides = dict(src_vocab_size=V, kernel=kernel, d_model=32, n_heads=2, d_ff=64, dropout=0.1,
                     n_encoder_layers=2, n_decoder_layers=2)
    if kind == "pre-ln":
        overrides.update(norm="pre", final_norm=True)
    elif kind == "pre-ln-no-final-norm":
        overrides.update(norm="pre")
    elif kind == "copy":
        overrides.update(copy=True, tie_embeddings="all")
    elif kind == "classifier":
        overrides.update(num_classes=3, n_decoder_layers=0, final_norm=True)
    elif kind == "extractive":
        overrides.update(extractive=True, n_decoder_layers=0, norm="pre", final_norm=True)
    torch.manual_seed(0)
    return build_model(get_config("tiny", **overrides), device).train()


def _loss(model: nn.Module, kind: str, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, V, (3, 9), generator=g).to(device)
    lengths = torch.tensor([9, 6, 3], device=device)
    if kind == "classifier":
        return model(src, lengths).float().logsumexp(-1).sum()
    if kind == "extractive":
        return model(src, lengths, torch.tensor([[0, 4], [0, 2], [0, 1]], device=device)).float().sum()
    tgt = torch.randint(4, V, (3, 7), generator=g).to(device)
    loss, _ = model(src, lengths, tgt[:, :-1], torch.tensor([6, 4, 2], device=device), target=tgt[:, 1:],
                    label_smoothing=0.1)
    return loss


def _step(model, kind, device, *, norm_writes: bool, monkeypatch):
    """Loss and gradients of one bf16-autocast step, dropout's draws the same each time; with
    norm_writes False the norms hand on their fp32 output and the matmuls cast it (autocast's way)."""
    with monkeypatch.context() as m:
        if not norm_writes:
            m.setattr(layers, "autocast_dtype", lambda t: None)
        torch.manual_seed(2)
        if device == "cuda":
            torch.cuda.manual_seed(2)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = _loss(model, kind, device)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("kernel", ["eager", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_step_is_the_same_bit_for_bit(kind, kernel, monkeypatch):
    model = _model(kind, kernel, DEVICE)
    loss, grads = _step(model, kind, DEVICE, norm_writes=False, monkeypatch=monkeypatch)
    loss_new, grads_new = _step(model, kind, DEVICE, norm_writes=True, monkeypatch=monkeypatch)
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
    loss_new, grads_new = _step(model, kind, DEVICE, norm_writes=True, monkeypatch=monkeypatch)
    post, pre = layers.AddNorm.post, layers.AddNorm.pre

    def post_rounded(self, x, out):
        y, _ = post(self, x, out)
        return y, _AsStored.apply(y)

    def pre_rounded(self, x, delta):
        h, x = pre(self, x, delta)
        return _AsStored.apply(h), x

    with monkeypatch.context() as m:
        m.setattr(layers.AddNorm, "post", post_rounded)
        m.setattr(layers.AddNorm, "pre", pre_rounded)
        loss, grads = _step(model, kind, DEVICE, norm_writes=False, monkeypatch=monkeypatch)
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
    """Two casts fewer per sublayer input a norm writes (the input's and its gradient's): of the
    2 + 2 layers' 4 encoder and 6 decoder sublayers, Pre-LN all, Post-LN all but each stack's first
    self-attention (fed by the embedding); Post-LN also one add of two gradients fewer per such
    input."""
    model = _model(kind, "triton", DEVICE)
    counts = {}
    for norm_writes in (False, True):
        with _CountCasts() as c:
            _step(model, kind, DEVICE, norm_writes=norm_writes, monkeypatch=monkeypatch)
        counts[norm_writes] = c
    fed = 4 + 6 if kind == "pre-ln" else 3 + 5
    assert counts[False].casts - counts[True].casts == 2 * fed
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
    loss, grads = _step(model, kind, "cuda", norm_writes=False, monkeypatch=monkeypatch)
    loss_new, grads_new = _step(model, kind, "cuda", norm_writes=True, monkeypatch=monkeypatch)
    assert torch.equal(loss, loss_new) and all(torch.equal(grads[n], grads_new[n]) for n in grads)
