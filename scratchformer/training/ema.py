"""`train --ema DECAY`: an exponential moving average of the weights (Polyak averaging), what a run
validates, saves as its model and predicts with (fairseq's --ema-decay, Marian's exponential
smoothing, timm's ModelEmaV2).

After every optimizer step, ema = d * ema + (1 - d) * weights, in fp32 beside the weights, with
d = min(DECAY, (1 + t) / (10 + t)) at step t (TensorFlow's ExponentialMovingAverage with num_updates):
early on the average follows the weights closely, so a short run's average is not held back by the
random initial weights (at DECAY 0.999 they would weigh 0.999 ** 3000 = 5 % after 3,000 steps).
The average never feeds back into training: a run's training weights are those of the same run
without --ema. A checkpoint's "model" holds the average (so evaluate, generate, average, score and
--init-from all take it), and its "training_model" the weights that training goes on from.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def ema_decay(decay: float, step: int) -> float:
    """The average's decay at optimizer step `step` (1 for the first): min(decay, (1 + step) / (10 + step))."""
    return min(decay, (1 + step) / (10 + step))


class WeightEMA:
    """The moving average of `model`'s floating-point parameters (each tied parameter once); `decay` 0:
    none, and a checkpoint holds the training weights as its "model"."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0 <= decay < 1:
            raise ValueError(f"the average's decay must be in [0, 1) (0: none), got {decay}")
        self.decay, self._model = decay, model
        self.params = [p for p in model.parameters() if p.is_floating_point()] if decay else []
        self.average = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold the weights after optimizer step `step` into the average (foreach kernels, no host sync)."""
        if self.params:
            weights = [p.detach().float() for p in self.params]  # fp32 weights: the parameters themselves
            torch._foreach_lerp_(self.average, weights, 1.0 - ema_decay(self.decay, step))

    def checkpoint(self) -> dict[str, dict[str, torch.Tensor]]:
        """A checkpoint's weights: "model", the model's state dict with the average for each parameter
        (a tied parameter's names share one tensor, as in the model's own), and "training_model", the
        model's own; without an average, "model" alone, the model's own."""
        if not self.params:
            return {"model": self._model.state_dict()}
        averaged = {id(p): a.to(p.dtype) for p, a in zip(self.params, self.average, strict=True)}
        state = self._model.state_dict(keep_vars=True)
        return {"model": {k: averaged.get(id(v), v.detach()) for k, v in state.items()},
                "training_model": self._model.state_dict()}

    @torch.no_grad()
    def load(self, ckpt: dict) -> None:
        """The weights of a checkpoint (`checkpoint`): the model's from its "training_model" (or its "model",
        one saved without an average), the average from its "model"."""
        self._model.load_state_dict(ckpt.get("training_model", ckpt["model"]))
        names = {id(v): k for k, v in self._model.state_dict(keep_vars=True).items()}
        for p, a in zip(self.params, self.average, strict=True):
            a.copy_(ckpt["model"][names[id(p)]])

    @contextmanager
    def swapped(self):
        """The model holds the average inside the block (without one, its own weights), its training
        weights again after it."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            if self.params:
                torch._foreach_copy_(self.params, [a.to(p.dtype) for p, a in zip(self.params, self.average)])
        try:
            yield
        finally:
            if self.params:
                with torch.no_grad():
                    torch._foreach_copy_(self.params, kept)
