"""Stopping a run on purpose, from outside: SIGINT (Ctrl-C) and SIGTERM finish the current step, save
last.pt and stop, so `train --resume` continues exactly (the Trainer's --time-limit and --time-budget
are its own clock's)."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


@contextmanager
def stop_on_signals(trainer):
    """While fitting, SIGINT (Ctrl-C) and SIGTERM ask `trainer` to stop after the current step and
    save last.pt; a second one interrupts at once. Not under DDP (each rank would get the signal at
    another step) nor outside the main thread, where Python cannot take signals."""
    if trainer.dist.on or threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask(signum, frame):
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
