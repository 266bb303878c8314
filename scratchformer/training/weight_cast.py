"""Autocast's weight casts, done once a step in one multi-tensor op instead of one kernel a weight.

Under autocast every matmul casts its fp32 weight and bias to the low-precision dtype where it is
used (our ops, which autocast cannot see into, cast theirs the same way: `scratchformer.ops`), and
the backward casts each of their gradients back to fp32: two kernels a weight a step, each a launch
and an autograd node on the host. A `base`-layered triton step under bf16 autocast issues 446 casts
among its 764 aten ops (and 223 Triton launches), 268 of them these (`bench/host_overhead.py`;
the rest are activations). `WeightCast` casts them all ahead of the forward with one
`torch._foreach_copy_` (a few multi-tensor launches on a GPU; one copy a tensor on the CPU) and
their gradients back with another, and lends the model the cast copies for the forward. The copies
hold the values autocast's casts would (round to nearest even, either way), so the loss and every
gradient are the same bit for bit (tests/test_weight_cast.py); autocast finds them already in its
dtype and casts nothing.

Which weights (`cast_slots`): those of the `nn.Linear` layers (every matmul the model runs under
autocast: attention projections, the FFN, the generator and the heads), but a weight another module
also holds (a tied embedding: the embedding op reads the table in fp32) and the layers of a module
that computes in fp32 (`FP32_MODULES`: the pointer-generator, which turns autocast off for its
mixture; its key projection, run under autocast, keeps autocast's own cast). Leaving a weight
out is always safe (autocast casts it where it is used, as before); lending a copy of one autocast
would not have cast is not, hence a list, not a guess.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..evaluation.evaluate import AUTOCAST_DTYPES
from ..model.copy import PointerGenerator
from .config import TrainConfig

FP32_MODULES = (PointerGenerator,)  # modules that run their layers with autocast off


class _CastAll(torch.autograd.Function):
    """(dtype, *weights) -> the weights in dtype, one multi-tensor copy; the backward casts the
    gradients back to each weight's dtype, one more (a weight no output reached gets None)."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.dtypes = [w.dtype for w in weights]
        out = [torch.empty_like(w, dtype=dtype) for w in weights]
        torch._foreach_copy_(out, list(weights))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        given = [i for i, g in enumerate(grads) if g is not None]
        back = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in given]
        if back:
            torch._foreach_copy_(back, [grads[i] for i in given])
        result: list[torch.Tensor | None] = [None] * len(grads)
        for i, g in zip(given, back):
            result[i] = g
        return (None, *result)


def cast_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every weight `WeightCast` casts (module docstring)."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    skipped = {id(sub) for m in model.modules() if isinstance(m, FP32_MODULES) for sub in m.modules()}
    return [(m, name) for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in skipped
            for name, p in m._parameters.items()
            if p is not None and p.dtype == torch.float32 and holders[id(p)] == 1]


class WeightCast:
    """`with WeightCast(model, dtype)():` the model's `cast_slots` weights are their copies in
    `dtype` inside (one `_CastAll` of them all, whose backward brings the gradients to the fp32
    parameters), the parameters again outside. The slots are found once, here. dtype None:
    nothing changes (no autocast, or a step this does not serve: `Trainer`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.dtype = dtype
        self.slots = cast_slots(model) if dtype is not None else []

    @classmethod
    def for_step(cls, model: nn.Module, config: TrainConfig, *, ddp: bool) -> WeightCast:
        """The training step's: the dtype of `config.precision`'s autocast (None for fp32), but None
        for a model run by torch.compile (which would trace the lending), with recomputed layers
        (their recomputation in the backward reads the parameters again, after the lending) or under
        DDP (its gradient hooks sit on the parameters; not tried with lent copies): each of those
        keeps autocast's own casts."""
        served = not (config.compile or config.recompute_activations or ddp)
        return cls(model, AUTOCAST_DTYPES[config.precision] if served else None)

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.slots:
            yield
            return
        params = [m._parameters[name] for m, name in self.slots]
        for (m, name), copy in zip(self.slots, _CastAll.apply(self.dtype, *params)):
            m._parameters[name] = copy  # read as m.<name>; nn.Module's setattr would refuse a non-Parameter
        try:
            yield
        finally:
            for (m, name), p in zip(self.slots, params):
                m._parameters[name] = p
