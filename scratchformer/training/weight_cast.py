"""The training step's weight lending (`scratchformer.model.weight_cast`): the weights cast once a
step, all together, and their gradients back, instead of autocast's cast per use and per gradient."""

from __future__ import annotations

from torch import nn

from ..evaluation.evaluate import AUTOCAST_DTYPES
from ..model.weight_cast import WeightCast
from .config import TrainConfig


def for_step(model: nn.Module, config: TrainConfig, *, ddp: bool) -> WeightCast:
    """The training step's: the dtype of `config.precision`'s autocast (None for fp32), but None
    for a model run by torch.compile (which would trace the lending), with recomputed layers
    (their recomputation in the backward reads the parameters again, after the lending) or under
    DDP (its gradient hooks sit on the parameters; not tried with lent copies): each of those
    keeps autocast's own casts."""
    served = not (config.compile or config.recompute_activations or ddp)
    return WeightCast(model, AUTOCAST_DTYPES[config.precision] if served else None)
