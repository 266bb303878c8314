"""WeightCast (scratchformer/model/weight_cast.py): autocast's weight casts done once a step.
A step with the weights lent as one multi-tensor cast gives the loss and every parameter's gradient
of the step without it, bit for bit (the same rounding, the same ops), for each model kind, with
tied embeddings and the pointer-generator's fp32 layers (left out: they run with autocast off), on
each backend; a weight no output reached keeps no gradient (None, not zeros: AdamW would decay it);
the parameters are back after the step, after an error too; and the trainer lends only where the
step is served (autocast on; not compiled, recomputed or DDP)."""


import pytest
import torch
from conftest import DEVICE, Dispatched, requires_cuda, step_grads, step_model
from torch import nn

from scratchformer.model.copy import PointerGenerator
from scratchformer.model.weight_cast import WeightCast, cast_slots
from scratchformer.training.config import TrainConfig
from scratchformer.training.weight_cast import for_step

KINDS = {  # step_model's overrides
    "seq2seq": {},
    "classifier": dict(num_classes=3, n_decoder_layers=0),
    "extractive": dict(extractive=True, n_decoder_layers=0),
    "copy": dict(copy=True, tie_embeddings="all"),
    "tied-pre-ln": dict(tie_embeddings="all", norm="pre", final_norm=True),
}


def _model(kind: str, kernel: str, device: str) -> nn.Module:
    return step_model(kernel, device, **KINDS[kind])


def _step(model, device, cast: WeightCast | None):
    """Loss and gradients of one bf16-autocast step, with the weights lent by `cast` or not."""
    return step_grads(model, device, cast() if cast else None)


CASES = [(kind, "torch") for kind in ("seq2seq", "copy", "tied-pre-ln", "classifier", "extractive")]
CASES += [("seq2seq", "eager"), ("seq2seq", "triton")]


@pytest.mark.parametrize("kind,kernel", CASES)
def test_the_step_is_the_same_bit_for_bit(kind, kernel):
    model = _model(kind, kernel, DEVICE)
    cast = WeightCast(model, torch.bfloat16)
    assert len(cast.slots) > 0
    loss, grads = _step(model, DEVICE, None)
    loss_cast, grads_cast = _step(model, DEVICE, cast)
    assert torch.equal(loss, loss_cast)
    assert grads.keys() == grads_cast.keys() and len(grads) == len(list(model.parameters()))
    for name in grads:
        assert grads_cast[name].dtype == torch.float32 and torch.equal(grads[name], grads_cast[name]), name


@requires_cuda
def test_the_step_is_the_same_bit_for_bit_on_the_gpu():
    """As above on CUDA's autocast, where the casts are multi-tensor kernels."""
    model = _model("seq2seq", "triton", "cuda")
    loss, grads = _step(model, "cuda", None)
    loss_cast, grads_cast = _step(model, "cuda", WeightCast(model, torch.bfloat16))
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


def test_decoding_lends_the_generators_tied_weight_in_its_slot_only():
    """With `shared` (decoding's, no gradients): the tied weight too, in the generator's slot; the
    embeddings keep the fp32 table, which their op reads."""
    model = _model("copy", "torch", "cpu")
    slots = cast_slots(model, shared=True)
    assert set(slots) - set(cast_slots(model)) == {(model.generator, "weight")}
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCast(model, torch.bfloat16, shared=True)():
        assert model.generator.weight.dtype == torch.bfloat16
        assert model.decoder.embedding.weight.dtype == model.encoder.embedding.weight.dtype == torch.float32


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
    cast = for_step(nn.Linear(4, 4), config, ddp=ddp)
    assert (cast.dtype == torch.bfloat16 and len(cast.slots) == 2) if served else not cast.slots


def test_a_weight_autocast_would_not_cast_is_not_lent():
    """Autocast casts only fp32 tensors to its dtype (a float64 layer runs in float64 under it), so
    only fp32 weights are lent: a float64 layer keeps its parameters, and its output is the one
    without the lending, bit for bit (lending it in bf16 would round its weights)."""
    net = nn.ModuleDict({"fp32": nn.Linear(4, 4), "fp64": nn.Linear(4, 4).double()})
    assert {(m, name) for m, name in cast_slots(net)} == {(net["fp32"], "weight"), (net["fp32"], "bias")}
    x = torch.randn(2, 4, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = net["fp64"](x)
        with WeightCast(net, torch.bfloat16)():
            assert net["fp64"].weight.dtype == torch.float64 and isinstance(net["fp64"].weight, nn.Parameter)
            lent = net["fp64"](x)
    assert own.dtype == torch.float64 and torch.equal(own, lent)


def test_the_gradients_come_back_in_one_multi_tensor_copy():
    """The backward brings the lent weights' bf16 gradients to their fp32 parameters in one
    `_foreach_copy_`, and no gradient is cast on its own. (Given a bf16 gradient for an fp32 input,
    autograd's engine would cast it itself, one `_to_copy` a weight, with the same values: what the
    lending saves is those ops, so the ops are what this checks.)"""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCast(net, torch.bfloat16)():
        loss = net(torch.randn(2, 4)).sum()  # bf16: no cast of the loss's own gradient either
    with Dispatched() as ops:
        loss.backward()
    assert ops.names.count("_foreach_copy_.default") == 1 and "_to_copy.default" not in ops.names
    assert all(p.grad.dtype == torch.float32 for p in net.parameters())
