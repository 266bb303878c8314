"""Ablation grids: train one run per variant with shared settings, then draw the comparison plot.

    python -m scratchformer.ablate --out runs/ablate                       # default grid, synthetic task
    python -m scratchformer.ablate --out runs/ab --variants "base=" "pre-ln=--norm pre" "1 head=--heads 1" \
        -- --dataset multi30k --max-steps 3000            # flags after -- go to every run
    python -m scratchformer.train ablate ...              # the same command

Each variant is ``NAME=FLAGS`` (train flags appended to the shared ones). Runs go to OUT/<name>/;
OUT/ablation.json holds every run's final metrics and validation-loss curve, OUT/ablation.png the
plot (final metric bars + validation loss curves).

A grid continues where it stopped: run the same command again. A variant whose folder holds a
finished run (its metrics.final.json) is read back, one with checkpoints but no final report is
resumed, and a variant stopped by --time-limit (or Ctrl-C) stops the grid, which then writes no
summary, so a grid runs in bounded commands (a GPU machine's 10-minute calls).

--jobs N trains up to N variants at once, each a `python -m scratchformer.train` process of its own
writing its console to OUT/logs/NAME.txt: small models leave a GPU mostly idle (their steps are
host-bound), so several share one. The processes stay in the grid's process group, so Ctrl-C (or
`timeout -s INT`) reaches each once: each saves last.pt and stops, and the grid starts no other.
A variant that fails leaves the others running; the grid then names it and shows its log's end.
The summary names the best variant by the compared metric (lowest loss or perplexity, else
highest): a search recipe predicts with that one (scripts/gpu/50_train.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .. import data as D
from ..checkpoint import write_lines_atomic
from ..cli import add_debug_flag
from .config import METRICS, ConfigError, TrainConfig, parse_args
from .resume import fixed_changes
from .trainer import train

DEFAULT_GRID = [
    "baseline=",
    "no-pos-encoding=--no-pos-encoding",
    "heads-1=--heads 1",
    "layers-1=--layers 1",
    "pre-norm=--norm pre",
    "grad-accum-2=--grad-accum 2",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.ablate",
                                description="Run an ablation grid of training runs and plot the comparison.")
    p.add_argument("--out", default="runs/ablate",
                   help="folder for the runs, ablation.json and ablation.png (default: runs/ablate)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_GRID, metavar="NAME=FLAGS",
                   help="variants; default: " + "; ".join(DEFAULT_GRID))
    p.add_argument("--metric", help="metric of the bar chart and of the best variant (default: exact_match "
                   "for seq2seq greedy, accuracy for classification)")
    p.add_argument("--jobs", type=int, default=1,
                   help="variants trained at once, each in a process of its own (default: 1)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="shared train flags, after --")
    add_debug_flag(p)
    return p


def _final_metric(final: dict, metric: str | None) -> tuple[str, dict]:
    """Flatten the final report: greedy decoding's scores (an extractive run's one decoding, its
    picks) at the top level."""
    flat = {k: v for k, v in final.items() if isinstance(v, (int, float))}
    decodings = {k: v for k, v in final.items() if isinstance(v, dict)}
    flat.update(decodings.get("greedy") or next(iter(decodings.values()), {}))
    if metric is None:
        metric = "accuracy" if "accuracy" in flat else ("exact_match" if "exact_match" in flat else "loss")
    return metric, flat


def variant_folders(out: Path, variants: list[str], shared: list[str],
                    metric: str | None = None) -> list[tuple[str, str, Path]]:
    """(name, flags, run folder) per variant, all checked before the first run: NAME=FLAGS form,
    flags that parse into a valid config, a name that makes a safe folder name inside `out`
    (letters, digits, '-', '_', '.'; not '.' or '..'; unique), and a `metric` its task computes."""
    planned, seen = [], {}
    for spec in variants:
        if "=" not in spec:
            raise ConfigError(f"variant {spec!r} must look like NAME=FLAGS (FLAGS may be empty)")
        name, flags = spec.split("=", 1)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
        if not slug:
            raise ConfigError(f"variant name {name!r} makes no folder name: use letters, digits, '-', '_' or '.'")
        if slug in seen:
            raise ConfigError(f"variants {seen[slug]!r} and {name!r} would share the folder {out / slug}")
        seen[slug] = name
        cfg, _ = parse_args([*shared, *shlex.split(flags), "--out", str(out / slug)])  # a bad flag: refused now
        if metric is not None:
            task = cfg.task or D.resolve_source(cfg.dataset, cfg.data).task
            if metric not in METRICS[task]:
                raise ConfigError(f"--metric {metric}: variant {name!r} trains {task}, whose final report has "
                                  f"{', '.join(METRICS[task])}")
        planned.append((name, flags, out / slug))
    return planned


def run_grid(out: Path, variants: list[str], shared: list[str], metric: str | None = None,
             jobs: int = 1) -> tuple[str, list[dict]]:
    """Train every variant into out/<name>/ (shared train flags, then the variant's), `jobs` at once,
    write out/ablation.json and out/ablation.png. Returns (the compared metric, one result per
    variant); no results when a variant stopped before its end."""
    from ..evaluation.plots import plot_ablation, read_metrics  # matplotlib: only when plotting

    planned = variant_folders(out, variants, shared, metric)
    finals = _run_in_turn(planned, shared) if jobs == 1 else _run_at_once(planned, shared, jobs, out / "logs")
    stopped = [(name, final) for (name, _, _), final in zip(planned, finals) if "stopped" in final]
    if stopped:
        for name, final in stopped:
            print(f"=== ablation stopped in {name} at step {final['step']} ({final['stopped']}): run the same "
                  f"command again to continue")
        return metric or "", []
    results = []
    for (name, flags, run_dir), final in zip(planned, finals):
        metric, flat = _final_metric(final, metric)
        curve = [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r.get("split") == "valid"]
        results.append({"name": name, "folder": run_dir.name, "flags": flags, "final": flat, "curve": curve})
    summary = {"metric": metric, "shared": shared, "best": best_variant(results, metric), "runs": results}
    write_lines_atomic(out / "ablation.json", json.dumps(summary, indent=2).splitlines())  # a kill: the old one kept
    plot_ablation(results, metric, out / "ablation.png", title=f"ablations ({' '.join(shared) or 'defaults'})")
    return metric, results


def best_variant(results: list[dict], metric: str) -> str | None:
    """The folder of the variant with the best `metric`: the lowest loss or perplexity, else the highest;
    None when no variant has a number for it (every run diverged: not the first one by default)."""
    lower = metric in ("loss", "ppl")
    def score(r):
        value = r["final"].get(metric, math.nan)
        return math.inf if math.isnan(value) else (value if lower else -value)
    best = min(results, key=score)
    return best["folder"] if score(best) != math.inf else None


def _variant_argv(name: str, flags: str, run_dir: Path, shared: list[str], log: Path | None = None) -> list[str]:
    """One variant's train flags, announced: resumed when its folder holds checkpoints."""
    resume = ["--resume"] if list(run_dir.glob("*.pt")) else []
    print(f"=== ablation {name}: {flags or '(shared flags only)'} -> {run_dir}{' (resumed)' if resume else ''}"
          f"{f', log {log}' if log else ''}", flush=True)
    return [*resume, *shared, *shlex.split(flags), "--out", str(run_dir), "--no-progress"]


def _final(run_dir: Path) -> dict | None:
    """A finished run's final report (metrics.final.json); None before its end."""
    done = run_dir / "metrics.final.json"
    return json.loads(done.read_text(encoding="utf-8")) if done.is_file() else None


def _read_back(name: str, flags: str, run_dir: Path, shared: list[str]) -> dict | None:
    """A variant's final report when its folder holds a finished run of today's flags; None before
    its end. A finished run built otherwise (a model, data or seed flag given now with another value,
    as --resume refuses them) is refused by name: its report is not this variant's."""
    final = _final(run_dir)
    if final is None:
        return None
    if (run_dir / "args.json").is_file():
        config, given = parse_args([*shared, *shlex.split(flags), "--out", str(run_dir)])
        changed = fixed_changes(config, given, TrainConfig.from_dict(json.loads((run_dir / "args.json").read_text())))
        if changed:
            raise ConfigError(f"ablation {name}: {run_dir} holds a finished run built otherwise: {'; '.join(changed)}; "
                              f"give the grid another --out, or remove {run_dir} to train the variant again")
    print(f"=== ablation {name}: finished earlier, read back from {run_dir / 'metrics.final.json'}")
    return final


def _run_in_turn(planned: list[tuple[str, str, Path]], shared: list[str]) -> list[dict]:
    """Each variant's final report, trained one after the other in this process (resumed when it has
    checkpoints); the first that stops before its end ({"stopped", "step"}) stops the grid."""
    finals = []
    for name, flags, run_dir in planned:
        final = _read_back(name, flags, run_dir, shared)
        if final is None:
            final = train(*parse_args(_variant_argv(name, flags, run_dir, shared)))
        finals.append(final)
        if "stopped" in final:
            break
    return finals


def _run_at_once(planned: list[tuple[str, str, Path]], shared: list[str], jobs: int, logs: Path) -> list[dict]:
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
                name, flags, run_dir = queue.pop(0)
                finals[name] = _read_back(name, flags, run_dir, shared)
                if finals[name] is None:
                    running[name] = _start(name, flags, run_dir, shared, env, logs / f"{run_dir.name}.txt")
            time.sleep(0.2)
            for name, (proc, run_dir, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                if proc.returncode == 0 or (signalled and proc.returncode == 130):  # 130: stopped while starting
                    finals[name] = _final(run_dir) or {"stopped": "a signal or --time-limit",
                                                       "step": _last_step(run_dir)}
                    print(f"=== ablation {name}: {'stopped' if 'stopped' in finals[name] else 'finished'}", flush=True)
                else:
                    failed.append(f"{name} (exit {proc.returncode}; {log}):\n{_tail(log)}")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failed:
        raise RuntimeError("ablation variants failed: " + "\n".join(failed))
    not_started = {"stopped": "a signal, before it started", "step": 0}
    return [finals.get(name) or not_started for name, _, _ in planned]


def _start(name: str, flags: str, run_dir: Path, shared: list[str], env: dict, log: Path):
    """(the training process of one variant, its folder, its log); the log is appended to."""
    argv = _variant_argv(name, flags, run_dir, shared, log)
    with open(log, "a", encoding="utf-8") as f:
        proc = subprocess.Popen([sys.executable, "-m", "scratchformer.train", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env)
    return proc, run_dir, log


def _tail(log: Path, lines: int = 12) -> str:
    return "\n".join(log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _last_step(run_dir: Path) -> int:
    from ..evaluation.plots import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    return max((r.get("step", 0) for r in records), default=0)


def main(argv=None) -> list[dict]:
    """The ablate command (`python -m scratchformer.ablate`, also `python -m scratchformer.train ablate`)."""
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be at least 1")
    shared = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    out = Path(args.out)
    metric, results = run_grid(out, args.variants, shared, args.metric, args.jobs)
    if not results:  # stopped: no summary yet
        return results
    print(f"\n{'variant':<20} {metric:>12} {'valid loss':>11}")
    for r in results:
        final = r["final"]
        print(f"{r['name']:<20} {final.get(metric, float('nan')):>12.2f} {final.get('loss', float('nan')):>11.4f}")
    print(f"wrote {out / 'ablation.json'} and {out / 'ablation.png'}")
    return results
