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
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from ..cli import add_debug_flag
from .config import ConfigError, parse_args
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
    p.add_argument("--out", default="runs/ablate", help="folder for the runs, ablation.json and ablation.png")
    p.add_argument("--variants", nargs="+", default=DEFAULT_GRID, metavar="NAME=FLAGS",
                   help="variants; default: " + "; ".join(DEFAULT_GRID))
    p.add_argument("--metric", help="metric of the bar chart (default: exact_match for seq2seq greedy, "
                   "accuracy for classification)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="shared train flags, after --")
    add_debug_flag(p)
    return p


def _final_metric(final: dict, metric: str | None) -> tuple[str, dict]:
    """Flatten the final report: greedy decoding scores at the top level."""
    flat = {k: v for k, v in final.items() if isinstance(v, (int, float))}
    flat.update(final.get("greedy", {}))
    if metric is None:
        metric = "accuracy" if "accuracy" in flat else ("exact_match" if "exact_match" in flat else "loss")
    return metric, flat


def variant_folders(out: Path, variants: list[str], shared: list[str]) -> list[tuple[str, str, Path]]:
    """(name, flags, run folder) per variant, all checked before the first run: NAME=FLAGS form,
    flags that parse into a valid config, and a name that makes a safe folder name inside `out`
    (letters, digits, '-', '_', '.'; not '.' or '..'; unique)."""
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
        parse_args([*shared, *shlex.split(flags), "--out", str(out / slug)])  # a bad flag: refused now
        planned.append((name, flags, out / slug))
    return planned


def run_grid(out: Path, variants: list[str], shared: list[str], metric: str | None = None) -> tuple[str, list[dict]]:
    """Train every variant into out/<name>/ (shared train flags, then the variant's), write
    out/ablation.json and out/ablation.png. Returns (the compared metric, one result per variant)."""
    from ..evaluation.plots import plot_ablation, read_metrics  # matplotlib: only when plotting

    results = []
    for name, flags, run_dir in variant_folders(out, variants, shared):
        final = _run_variant(name, flags, run_dir, shared)
        if "stopped" in final:
            print(f"=== ablation stopped in {name} at step {final['step']} ({final['stopped']}): run the same "
                  f"command again to continue")
            return metric or "", []
        metric, flat = _final_metric(final, metric)
        curve = [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if r.get("split") == "valid"]
        results.append({"name": name, "flags": flags, "final": flat, "curve": curve})
    summary = {"metric": metric, "shared": shared, "runs": results}
    (out / "ablation.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_ablation(results, metric, out / "ablation.png", title=f"ablations ({' '.join(shared) or 'defaults'})")
    return metric, results


def _run_variant(name: str, flags: str, run_dir: Path, shared: list[str]) -> dict:
    """One variant's final report: read back when its run finished earlier, else trained (resumed
    when it has checkpoints); {"stopped", "step"} when the run stopped before its end."""
    done = run_dir / "metrics.final.json"
    if done.is_file():
        print(f"=== ablation {name}: finished earlier, read back from {done}")
        return json.loads(done.read_text(encoding="utf-8"))
    resume = ["--resume"] if list(run_dir.glob("*.pt")) else []
    print(f"=== ablation {name}: {flags or '(shared flags only)'} -> {run_dir}{' (resumed)' if resume else ''}")
    return train(*parse_args([*resume, *shared, *shlex.split(flags), "--out", str(run_dir), "--no-progress"]))


def main(argv=None) -> list[dict]:
    """The ablate command (`python -m scratchformer.ablate`, also `python -m scratchformer.train ablate`)."""
    args = build_parser().parse_args(argv)
    shared = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    out = Path(args.out)
    metric, results = run_grid(out, args.variants, shared, args.metric)
    if not results:  # stopped: no summary yet
        return results
    print(f"\n{'variant':<20} {metric:>12} {'valid loss':>11}")
    for r in results:
        final = r["final"]
        print(f"{r['name']:<20} {final.get(metric, float('nan')):>12.2f} {final.get('loss', float('nan')):>11.4f}")
    print(f"wrote {out / 'ablation.json'} and {out / 'ablation.png'}")
    return results
