"""Stopping a run: on purpose, from outside (SIGINT (Ctrl-C) and SIGTERM finish the current step, save
last.pt and stop, so `train --resume` continues exactly; the Trainer's --time-limit and --time-budget
are its own clock's), and when it diverged (`check_finite`: weights no longer finite are never saved)."""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

import torch


class Diverged(ValueError):
    """Training diverged: the weights are no longer finite. What the user changes is the recipe (the
    learning rate, its warm-up, the clipping, the precision), so the command says it in one line."""


def check_finite(trainer, before: str) -> None:
    """Raise `Diverged` when a weight is NaN or infinite, `before` logging, validating or saving: a
    diverged run stops with an error, and its checkpoints keep the last finite weights (a NaN last.pt
    would replace them, and its step files prune the good ones). The weights, not the loss: under
    fp16's GradScaler an overflowing step is skipped and leaves them finite. Read where the host
    reads anyway (a train row, a validation, a save), never every step."""
    norms = torch._foreach_norm([p.detach() for p in trainer.model.parameters()], float("inf"))  # NaN stays NaN
    if bool(torch.stack([n.float() for n in norms]).isfinite().all()):
        return
    last, step = trainer.out / "last.pt", f" (step {trainer.last_saved})" if trainer.last_saved >= 0 else ""
    saved = f"{last} holds the last weights saved{step}" if last.exists() else "no checkpoint was saved"
    raise Diverged(f"training diverged: the weights are NaN or infinite after step {trainer.progress.step} "
                   f"(found {before}); {saved}. Train again with a lower --lr (this run's {trainer.config.lr:g}), "
                   "a longer --warmup-steps or a smaller --clip-norm")


@contextmanager
def stop_on_signals(trainer):
    """While fitting, SIGINT (Ctrl-C) and SIGTERM ask `trainer` to stop after the current step and
    save last.pt; a second one interrupts at once. Not under DDP (each rank would get the signal at
    another step) nor outside the main thread, where Python cannot take signals. A process forked
    meanwhile (a DataLoader worker) inherits the handler and, from a terminal's Ctrl-C, the signal:
    there it does nothing (it logged the stop once a worker, and the main process ends the workers)."""
    if trainer.dist.on or threading.current_thread() is not threading.main_thread():
        yield
        return
    owner = os.getpid()

    def ask(signum, frame):
        if os.getpid() != owner:
            return
        if trainer.stop_reason is not None:
            raise KeyboardInterrupt
        trainer.stop_reason = signal.Signals(signum).name
        trainer.log.info(f"{trainer.stop_reason}: stopping after this step and saving last.pt (again: stop at once)")

    previous = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
