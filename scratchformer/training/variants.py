"""Running an ablation grid's variants (`ablation.run_grid` plans and checks them): each one's train
command, its final report read back, and the variants trained one after the other in this process or
up to --jobs at once, each in a process of its own."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from ..checkpoint import CheckpointError
from ..cli import describe, is_user_error
from .config import ConfigError, parse_args
from .resume import load_resume_checkpoint
from .trainer import train


class VariantError(ValueError):
    """Variants whose training failed, each named with its log (a user error: `cli` prints it, exit 2)."""

    def __init__(self, failed: str):  # once the grid's other variants ran
        super().__init__(f"ablation variants failed, the others ran: {failed}")


class Variant(NamedTuple):
    """A checked variant; `final`: its finished run's report, read back, or None to train (or resume) it."""
    name: str
    flags: str
    folder: Path
    final: dict | None = None


def variant_argv(v: Variant, shared: list[str], log: Path | None = None, deadline: float | None = None) -> list[str]:
    """One variant's train flags, announced: resumed when its folder holds checkpoints; with the grid's
    --time-limit, what is left of it at the variant's start (`deadline`, time.monotonic()'s: each
    variant counted the whole limit from its own start, a grid of n variants n times it)."""
    resume = ["--resume"] if list(v.folder.glob("*.pt")) else []
    print(f"=== ablation {v.name}: {v.flags or '(shared flags only)'} -> {v.folder}{' (resumed)' if resume else ''}"
          f"{f', log {log}' if log else ''}", flush=True)
    left = [] if deadline is None else ["--time-limit", f"{max(deadline - time.monotonic(), 1e-3):.3f}"]
    return [*resume, *shared, *shlex.split(v.flags), *left, "--out", str(v.folder), "--no-progress"]


def final_of(run_dir: Path) -> dict | None:
    """A finished run's final report (metrics.final.json); None before its end, and for the report of an
    earlier end of a run since given more steps and stopped on the way: its newest step_N.pt is
    past the report's step (the report was read back as the run's, which never trained on). A run whose
    step checkpoints are gone (best.pt kept, or none) has its report."""
    done = run_dir / "metrics.final.json"
    if not done.is_file():
        return None
    final = json.loads(done.read_text(encoding="utf-8"))
    newest = _newest_step(run_dir)
    return None if newest is not None and newest > final.get("steps", newest) else final


def _newest_step(run_dir: Path) -> int | None:
    """The step of a run's newest step_N.pt, by its name (each save writes one, then last.pt: no
    checkpoint is read); None without one."""
    return max((int(p.stem[5:]) for p in run_dir.glob("step_*.pt") if p.stem[5:].isdigit()), default=None)


def run_in_turn(planned: list[Variant], shared: list[str], deadline: float | None = None) -> list[dict]:
    """Each variant's final report: read back, or trained one after the other in this process (resumed
    when it has checkpoints). The first that stops before its end ({"stopped", "step"}) stops the grid;
    one that fails with a user error leaves the others to train, then the grid fails naming it."""
    finals, failed, first = [], [], None
    for v in planned:
        try:
            final = v.final or train(*parse_args(variant_argv(v, shared, deadline=deadline)))
        except Exception as e:
            if not is_user_error(e):
                raise
            log = v.folder / "log.txt"
            failed.append(f"{v.name} ({log if log.is_file() else 'no log: its output is above'}): {describe(e)}")
            first = first or e
            continue
        finals.append(final)
        if "stopped" in final:
            break
    if failed:
        raise VariantError("; ".join(failed)) from first
    return finals


def run_at_once(planned: list[Variant], shared: list[str], jobs: int, logs: Path,
                deadline: float | None = None) -> list[dict]:
    """Each variant's final report, up to `jobs` trained at once in processes of their own; after a
    signal (SIGINT, SIGTERM) none is started, and the ones running stop as the signal tells them."""
    logs.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[2]),
                                                                    os.environ.get("PYTHONPATH")])))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    signalled: list[int] = []
    on_main = threading.current_thread() is threading.main_thread()  # only it can take signals
    previous = {s: signal.signal(s, lambda signum, frame: signalled.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    finals, running, failed = {}, {}, []
    queue = list(planned)
    try:
        while running or (queue and not signalled):
            while queue and len(running) < jobs and not signalled:
                v = queue.pop(0)
                finals[v.name] = v.final
                if v.final is None:
                    running[v.name] = _start(v, shared, env, logs / f"{v.folder.name}.txt", deadline)
            time.sleep(0.2)
            for name, (proc, run_dir, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if proc.returncode == 0 or (signalled and proc.returncode == 130):  # 130: stopped while starting
                    finals[name] = final_of(run_dir) or {"stopped": "a signal or --time-limit",
                                                         "step": _resume_step(run_dir)}
                    print(f"=== ablation {name}: {'stopped' if 'stopped' in finals[name] else 'finished'}", flush=True)
                else:
                    tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-12:]
                    failed.append(f"{name} (exit {proc.returncode}; {log}):\n" + "\n".join(tail))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed:
        raise VariantError("\n".join(failed))
    return [finals.get(v.name) or {"stopped": "a signal, before it started", "step": 0} for v in planned]


def _start(v: Variant, shared: list[str], env: dict, log: Path, deadline: float | None = None):
    """(the training process of one variant, its folder, its log); the log is appended to."""
    argv = variant_argv(v, shared, log, deadline)
    with open(log, "a", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-m", "scratchformer.train", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    return proc, v.folder, log


def _resume_step(run_dir: Path) -> int | str:
    """The step a stopped variant resumes from: its checkpoint's, as `train --resume` picks it (0: none)."""
    try:
        return load_resume_checkpoint(run_dir, "last")[1]["progress"]["step"] if any(run_dir.glob("*.pt")) else 0
    except (CheckpointError, ConfigError) as e:  # the grid's next command fails naming it
        return f"? ({e})"
