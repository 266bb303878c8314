"""Where a run stands: `Progress` (saved in every checkpoint; what an exact resume continues from)
and the `Window` of sums a train row logs."""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .optim import is_better


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint as a plain dict."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # batches of this epoch consumed
    best: float | None = None
    best_step: int = -1
    bad_evals: int = 0
    validated: int = -1  # the step last validated: a resume does not validate it again (-1 in older checkpoints)
    stopped_early: bool = False
    out_of_time: bool = False  # --time-budget reached: training ended there
    tokens: int = 0  # target tokens trained on by the process that saved it (under DDP: rank 0's share)
    seconds: float = 0.0  # training time over every session of the run (--resume adds to it), as of last.pt

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def step_epoch(self) -> int:
        """The epoch (from 1) the last step was taken in, which its logged rows name: the current one,
        or at an epoch's end (no batch of the next consumed yet) the one that just ended, whose
        validation that is (it was logged as the next)."""
        return max(1, self.epoch + (1 if self.batch else 0))

    def track(self, metric: str, value: float, patience: int) -> bool:
        """A validation's `metric`: a new best (best, best_step), or one more evaluation without gain;
        True when that makes `patience` of them (0: never), which stops the run early."""
        if is_better(metric, value, self.best):
            self.best, self.best_step, self.bad_evals = value, self.step, 0
        else:
            self.bad_evals += 1
        if patience and self.bad_evals >= patience:
            self.stopped_early = True
        return self.stopped_early

    def resumed(self, time_budget: float | None, patience: int) -> None:
        """Resumed with today's --time-budget and --patience: a run that a smaller budget ended
        goes on under a larger one; one that early stopping ended goes on when its evaluations
        without gain are fewer than the new --patience (or it is 0: no early stopping)."""
        if self.out_of_time and time_budget and self.seconds < time_budget:
            self.out_of_time = False
        if self.stopped_early and (not patience or self.bad_evals < patience):
            self.stopped_early = False


def count_steps(batches_per_epoch, grad_accum: int, epochs: int | None, max_steps: int | None,
                at: Progress | None = None) -> int:
    """The steps a run comes to, for its schedule's length and its progress bar: --max-steps or the end
    of its epochs, whichever comes first (epochs None: --max-steps). The epochs' steps are counted at
    epoch 0's batches (`batches_per_epoch(epoch)`): an epoch's count may differ (BPE-dropout segments
    each anew; --max-tokens packs them), so the epochs themselves end training, not this count (it cut
    the last epoch short, or ran past it). `at`: a resumed run's place, its steps taken, then the rest of
    its epoch and the epochs after it at today's `grad_accum` (a resume that changed it counted every
    step at today's: a cosine decayed to its floor at once, or never reached it)."""
    per_epoch = math.ceil(batches_per_epoch(0) / grad_accum)
    if at is None:
        steps = per_epoch * (epochs or math.inf)
    else:
        rest = per_epoch * max(0, epochs - at.epoch - 1) if epochs else math.inf
        steps = at.step + math.ceil(max(0, batches_per_epoch(at.epoch) - at.batch) / grad_accum) + rest
    return min(max_steps or math.inf, steps)


def resumed_steps(ckpt: dict, cfg, batches_per_epoch, epochs: int | None, counted: int) -> int:
    """A resumed run's steps (`count_steps`): as the run counted them while its --grad-accum, --epochs
    and --max-steps stay (an earlier resume may have recounted them; `counted`, today's count, for a
    checkpoint without one); else the steps taken, and the rest at today's settings."""
    if any(ckpt["args"].get(k) != getattr(cfg, k) for k in ("grad_accum", "epochs", "max_steps")):
        return count_steps(batches_per_epoch, cfg.grad_accum, epochs, cfg.max_steps, at=Progress(**ckpt["progress"]))
    return ckpt.get("total_steps") or counted


@dataclass
class Window:
    """Sums since the last train row was logged (loss and NLL: 0-dim tensors on the device until then);
    t0: the start of its training time (moved on by the validations and saves in between)."""

    loss: float | torch.Tensor = 0.0
    nll: float | torch.Tensor = 0.0
    tokens: int = 0
    t0: float = field(default_factory=time.time)

    def to_dict(self) -> dict:
        """Plain numbers for a checkpoint (reads the sums on the host): a resumed run's next train row
        then sums the same steps as the uninterrupted run's."""
        return {"loss": float(self.loss), "nll": float(self.nll), "tokens": self.tokens,
                "seconds": time.time() - self.t0}

    @classmethod
    def from_dict(cls, saved: dict | None) -> Window:
        """The window a checkpoint saved (`to_dict`), its time going on from now; a new one for None."""
        if not saved:
            return cls()
        return cls(saved["loss"], saved["nll"], saved["tokens"], time.time() - saved["seconds"])

    @contextmanager
    def paused(self):
        """The time spent inside (validation, checkpoints) is left out of the window's throughput."""
        start = time.time()
        try:
            yield
        finally:
            self.t0 += time.time() - start
