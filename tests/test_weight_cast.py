"""WeightCast (scratchformer/training/weight_cast.py): autocast's weight casts done once a step.
A step with the weights lent as one multi-tensor cast gives the loss and every parameter's gradient
of the step without it, bit for bit (the same rounding, the same ops), for each model kind, with
tied embeddings and the pointer-generator's fp32 layers (left out: they run with autocast off), on
each backend; a weight no output reached keeps no gradient (None, not zeros: AdamW would decay it);
the parameters are back after the step, after an error too; and the trainer lends only where the
step is served (autocast on; not compiled, recomputed or DDP)."""

from contextlib import nullcontext

import pytest
import torch
from conftest import DEVICE, requires_cuda
from torch import nn

from scratchformer.model import build_model, get_config
from scratchformer.model.copy import PointerGenerator
from scratchformer.training.config import TrainConfig
from scratchformer.training.weight_cast import WeightCast, cast_slots

V = 50


def _model(kind: str, kernel: str, device: str) -> nn.Module:
    overrides = dict(src_vocab_size=V, kernel=kernel, d_model=32, n_heads=2, d_ff=64, dropout=0.1,
                     n_encoder_layers=2, n_decoder_layers=2)
    if kind == "classifier":
        overrides.update(num_classes=3, n_decoder_layers=0)
    elif kind == "extractive":
        overrides.update(extractive=True, n_decoder_layers=0)
    elif kind == "copy":
        overrides.update(copy=True, tie_embeddings="all")
    elif kind == "tied-pre-ln":
        overrides.update(tie_embeddings="all", norm="pre", final_norm=True)
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


def _step(model, kind, device, cast: WeightCast | None):
    """Loss and gradients of one step under bf16 autocast, dropout's draws the same each time."""
    torch.manual_seed(2)
    if device == "cuda":
        torch.cuda.manual_seed(2)
    with torch.autocast(device, dtype=torch.bfloat16), (cast() if cast else nullcontext()):
        loss = _loss(model, kind, device)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


CASES = [(kind, "torch") for kind in ("seq2seq", "copy", "tied-pre-ln", "classifier", "extractive")]
CASES += [("seq2seq", "eager"), ("seq2seq", "triton")]


@pytest.mark.parametrize("kind,kernel", CASES)
def test_the_step_is_the_same_bit_for_bit(kind, kernel):
    model = _model(kind, kernel, DEVICE)
    cast = WeightCast(model, torch.bfloat16)
    assert len(cast.slots) > 0
    loss, grads = _step(model, kind, DEVICE, None)
    loss_cast, grads_cast = _step(model, kind, DEVICE, cast)
    assert torch.equal(loss, loss_cast)
    assert grads.keys() == grads_cast.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert grads_cast[name].dtype == torch.float32 and torch.equal(grads[name], grads_cast[name]), name


@requires_cuda
def test_the_step_is_the_same_bit_for_bit_on_the_gpu():
    """As above on CUDA's autocast, where the casts are multi-tensor kernels."""
    model = _model("seq2seq", "triton", "cuda")
    loss, grads = _step(model, "seq2seq", "cuda", None)
    loss_cast, grads_cast = _step(model, "seq2seq", "cuda", WeightCast(model, torch.bfloat16))
    assert torch.equal(loss, loss_cast) and all(torch.equal(grads[n], grads_cast[n]) for n in grads)


def test_which_weights_are_lent():
    """Every nn.Linear's weight and bias; not the tied embedding (the embedding op reads it in fp32)
    nor the pointer-generator's layers (autocast off there)."""
    model = _model("copy", "torch", "cpu")
    lent = {id(getattr(m, name)) for m, name in cast_slots(model)}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    pointer = {id(p) for m in model.modules() if isinstance(m, PointerGenerator) for p in m.parameters()}
    tied = model.generator.weight
    assert tied is model.decoder.embedding.weight and id(tied) not in lent
    assert pointer and not pointer & lent
    expected = {id(p) for m in linears for p in m.parameters()} - pointer - {id(tied)}
    assert lent == expected


def test_an_unreached_weight_keeps_no_gradient():
    net = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCast(net, torch.bfloat16)():
        assert net["used"].weight.dtype == torch.bfloat16 and not isinstance(net["used"].weight, nn.Parameter)
        net["used"](torch.randn(2, 4)).float().sum().backward()
    assert net["used"].weight.grad.dtype == torch.float32 and net["unused"].weight.grad is None


def test_the_parameters_come_back_after_an_error():
    net = nn.Linear(4, 4)
    params = list(net.parameters())
    with pytest.raises(RuntimeError, match="boom"), WeightCast(net, torch.bfloat16)():
        assert net.weight.dtype == torch.bfloat16
        raise RuntimeError("boom")
    assert [p for p in net.parameters()] == params and all(isinstance(p, nn.Parameter) for p in params)


@pytest.mark.parametrize("change,served", [({}, True), ({"precision": "fp32"}, False), ({"compile": "inductor"}, False),
                                           ({"recompute_activations": True}, False), ({"ddp": True}, False)])
def test_the_training_step_lends_where_it_is_served(change, served):
    ddp = change.pop("ddp", False)
    config = TrainConfig(**{"precision": "bf16", **change})
    cast = WeightCast.for_step(nn.Linear(4, 4), config, ddp=ddp)
    assert (cast.dtype == torch.bfloat16 and len(cast.slots) == 2) if served else not cast.slots
