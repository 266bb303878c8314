"""Autocast's weight casts, done once in one multi-tensor op instead of one kernel a weight a use.

Under autocast every matmul casts its fp32 weight and bias to the low-precision dtype where it is
used (our ops, which autocast cannot see into, cast theirs the same way: `scratchformer.ops`), and
the backward casts each of their gradients back to fp32. `WeightCast` casts them all at once with
one `torch._foreach_copy_` (a few multi-tensor launches on a GPU; one copy a tensor on the CPU), and
their gradients back with another, and lends the model the cast copies meanwhile. The copies hold
the values autocast's casts would (round to nearest even, either way), so every output and
gradient is the same bit for bit; autocast finds them already in its dtype and casts nothing.

Two users:
- the training step (`training/weight_cast.py`, `for_step`): once a step, where each weight was
  cast at each use and each gradient cast back (268 of the 764 aten ops of a base-layered triton
  bf16 step were these; tests/test_weight_cast.py);
- decoding (`model/decoding.py`, `for_decoding`): once a decoding call, where every step cast the
  weights again: our ops' adapter at each step, and autocast's own casts inside a CUDA graph's
  capture, whose cast cache is off, so that every replayed step read each fp32 weight and wrote it
  in bf16 before its matmul read it: three times the bytes of the matmuls' own weight reads. The
  price: a copy of the lent weights in bf16 while the call runs (tests/test_decoding.py).

Which weights (`cast_slots`): those of the `nn.Linear` layers (every matmul the model runs under
autocast: attention projections, the FFN, the generator and the heads), but the layers of a module
that computes in fp32 (`FP32_MODULES`: the pointer-generator, which turns autocast off for its
mixture; its key projection, run under autocast, keeps autocast's own cast), and, for a step with
gradients, a weight another module also holds (the generator's tied embedding): the lending
replaces only the linear layer's slot (the embedding op reads the table in fp32 from its own), so
the values are the same, but the generator's gradient would come to the parameter after the
embeddings' instead of before them: another order of a sum of three terms where both sides'
embeddings are tied too, not the same bits. Leaving a weight out is always safe (autocast casts it
where it is used, as before); lending a copy of one autocast would not have cast is not, hence a
list, not a guess.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..ops import autocast_on
from .copy import PointerGenerator

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


def cast_slots(model: nn.Module, *, shared: bool = False) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every weight `WeightCast` casts (module docstring); `shared`:
    with the weights other modules hold too (for a call without gradients)."""
    holders: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    skipped = {id(sub) for m in model.modules() if isinstance(m, FP32_MODULES) for sub in m.modules()}
    return [(m, name) for m in model.modules() if isinstance(m, nn.Linear) and id(m) not in skipped
            for name, p in m._parameters.items()
            if p is not None and p.dtype == torch.float32 and (shared or holders[id(p)] == 1)]


class WeightCast:
    """`with WeightCast(model, dtype)():` the model's `cast_slots` weights are their copies in
    `dtype` inside (one `_CastAll` of them all, whose backward brings the gradients to the fp32
    parameters), the parameters again outside. The slots are found once, here. dtype None:
    nothing changes (no autocast, or a call this does not serve)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None, *, shared: bool = False):
        self.dtype = dtype
        self.slots = cast_slots(model, shared=shared) if dtype is not None else []

    @classmethod
    def for_decoding(cls, model: nn.Module, device: torch.device) -> WeightCast:
        """A decoding call's: autocast's dtype on `device` where it is on, shared weights too (no
        gradients); None for a model whose decoding is compiled (`static_caches`), which would
        trace the lending (`for_step` leaves compiled steps out alike)."""
        return cls(model, None if model.static_caches else autocast_on(device), shared=True)

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
