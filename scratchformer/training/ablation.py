"""Ablation grids: train one run per variant with shared settings, then draw the comparison plot.

    python -m scratchformer.ablate --out runs/ablate                       # default grid, synthetic task
    python -m scratchformer.ablate --out runs/ab --variants "base=" "pre-ln=--norm pre" "1 head=--heads 1" \
        -- --dataset multi30k --max-steps 3000            # flags after -- go to every run
    python -m scratchformer.train ablate ...              # the same command

Each variant is ``NAME=FLAGS`` (train flags appended to the shared ones). Runs go to OUT/<name>/;
OUT/ablation.json holds every run's final metrics and validation-loss curve, OUT/ablation.png the
plot (final metric bars + validation loss curves). All is checked before the first run (`variant_folders`).

A grid continues where it stopped: run the same command again. A variant whose folder holds a
finished run (its metrics.final.json) is read back, one with checkpoints but no final report is
resumed, and a variant stopped by --time-limit (or Ctrl-C) stops the grid, which then writes no
summary, so a grid runs in bounded commands (a GPU machine's 10-minute calls). A run built with other
flags than today's is refused by name, but for one command's own (PER_COMMAND: --time-limit, ...); a
finished run given more --max-steps, --epochs or --time-budget trains on, as `train --resume` does.

--jobs N trains up to N variants at once, each a `python -m scratchformer.train` process of its own
writing its console to OUT/logs/NAME.txt: small models leave a GPU mostly idle (their steps are
host-bound), so several share one. The processes stay in the grid's process group, so Ctrl-C (or
`timeout -s INT`) reaches each once: each saves last.pt and stops, and the grid starts no other.
A variant that fails (any --jobs) leaves the others to train; the grid then fails naming it and its log.
The summary names the best variant by the compared metric (lowest loss or perplexity, else
highest): a search recipe predicts with that one (scripts/gpu/50_train.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import time
from pathlib import Path

from .. import data as D
from ..checkpoint import find_checkpoint, write_lines_atomic
from ..cli import add_debug_flag, shown
from .build import check_data_options
from .config import METRICS, ConfigError, TrainConfig, flag, parse_args
from .config import build_parser as train_parser
from .resume import ONE_COMMAND
from .variants import Variant, final_of, run_at_once, run_in_turn

DEFAULT_GRID = ["baseline=", "no-pos-encoding=--no-pos-encoding", "heads-1=--heads 1", "layers-1=--layers 1",
                "pre-norm=--norm pre", "grad-accum-2=--grad-accum 2"]
# The grid's own flags: each variant trains into OUT/NAME, resumed when it holds checkpoints.
GRID_FLAGS = ("out", "resume", "overwrite")
# Options of one command, not of the run it trains: a variant's earlier run is read back or resumed
# whatever they are now (a grid run in bounded commands gives each its own --time-limit).
PER_COMMAND = (*GRID_FLAGS, *ONE_COMMAND, "resume_path", "device", "threads", "num_workers", "log_every",
               "attention_example", "save_every", "keep_checkpoints")
# How long a run trains: a finished run given more trains on (as `train --resume` does); less is refused.
BUDGET = ("max_steps", "epochs", "time_budget")
# What the grid writes into OUT beside the variants' folders, by name: no variant may be named so.
SUMMARY, PLOT, LOGS = "ablation.json", "ablation.png", "logs"
GRID_FILES = {SUMMARY: "summary", PLOT: "plot", LOGS: "console logs (--jobs)"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.ablate",
                                description="Run an ablation grid of training runs and plot the comparison.")
    p.add_argument("--out", default="runs/ablate",
                   help="folder for the runs, ablation.json and ablation.png (default: runs/ablate)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_GRID, metavar="NAME=FLAGS",
                   help="variants; default: " + "; ".join(DEFAULT_GRID))
    p.add_argument("--metric", help="metric of the bar chart and of the best variant (default: the shared "
                   "--best-metric; else accuracy for classification, rougeLsum for summaries, greedy exact_match for "
                   "translation)")
    p.add_argument("--jobs", type=int, default=1,
                   help="variants trained at once, each in a process of its own (default: 1)")
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="shared train flags, after --")
    add_debug_flag(p)
    return p


def _final_metric(final: dict, metric: str | None) -> tuple[str, dict]:
    """Flatten the final report: greedy decoding's scores (an extractive run's one decoding, its
    picks) at the top level."""
    flat = {k: v for k, v in final.items() if isinstance(v, (int, float))}
    decodings = {k: v for k, v in final.items() if isinstance(v, dict) and k != "scorers"}  # not the signatures
    flat.update(decodings.get("greedy") or next(iter(decodings.values()), {}))
    if metric is None:  # a summary is never word for word its reference: exact_match 0 for every variant
        metric = next(m for m in ("accuracy", "rougeLsum", "exact_match", "loss") if m in flat or m == "loss")
    return metric, flat


def variant_folders(out: Path, variants: list[str], shared: list[str], metric: str | None = None) -> list[Variant]:
    """The grid's variants, all checked before the first run: NAME=FLAGS form; flags that parse into a
    valid config, not the grid's own (--out, --resume, --overwrite), an error named by its variant; a
    name that makes a safe folder name inside `out` (letters, digits, '-', '_', '.'; not '.' or '..';
    unique; none the grid writes itself, GRID_FILES); one task, or a `metric` each variant's task computes;
    no summary of another grid in `out`; and a run in a variant's folder built with today's flags."""
    _check_given("the shared flags (after --)", shared)
    checked, seen = [], {}
    for spec in variants:
        name, flags, folder = _name_and_folder(spec, out, seen)
        checked.append((name, flags, folder, *_variant_config(name, flags, shared, folder)))
    _check_metric({name: task for name, _, _, _, task in checked}, metric)
    _check_summary(out / SUMMARY, {folder.name for _, _, folder, _, _ in checked})
    return [Variant(name, flags, folder, _earlier_run(name, folder, config))
            for name, flags, folder, config, _ in checked]


def _name_and_folder(spec: str, out: Path, seen: dict[str, str]) -> tuple[str, str, Path]:
    """(name, flags, run folder) of a NAME=FLAGS variant; `seen`: the folder names taken so far."""
    if "=" not in spec:
        raise ConfigError(f"variant {spec!r} must look like NAME=FLAGS (FLAGS may be empty)")
    name, flags = spec.split("=", 1)
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")
    if not slug:
        raise ConfigError(f"variant name {name!r} makes no folder name: use letters, digits, '-', '_' or '.'")
    if len(slug) > 251:  # a file name's 255 bytes, with its console log's ".txt" (--jobs)
        raise ConfigError(f"variant name {name[:20]!r}... makes a folder name of {len(slug)} characters: at most 251")
    if slug in GRID_FILES:
        raise ConfigError(f"variant name {name!r} makes the folder {out / slug}, where the grid writes its "
                          f"{GRID_FILES[slug]}: name it otherwise")
    if slug in seen:
        raise ConfigError(f"variants {seen[slug]!r} and {name!r} would share the folder {out / slug}")
    seen[slug] = name
    return name, flags, out / slug


def _check_given(where: str, argv: list[str]) -> None:
    """Refuse train flags that do not parse, and the grid's own, naming `where` they were given
    (train's parser would print its whole usage and name no variant)."""
    parser = train_parser()

    def error(message: str):
        raise ConfigError(f"{where}: {message}")

    parser.error = error
    own = [flag(k) for k in GRID_FLAGS if k in vars(parser.parse_args(argv))]
    if own:
        raise ConfigError(f"{where}: drop {', '.join(own)}: the grid trains each variant into OUT/NAME (ablate's "
                          f"--out, before --), resumed when it holds checkpoints")


def _variant_config(name: str, flags: str, shared: list[str], folder: Path) -> tuple[TrainConfig, str]:
    """(its config as its run's args.json records it, its task); an error is named by the variant, one
    of its data's too: a local folder's first training record is read as its task's (a variant with
    another --task, or a folder without that task's fields, stopped only when the grid reached it)."""
    try:
        argv = shlex.split(flags)
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"variant {name!r}: {e} in {flags!r}") from None
    _check_given(f"variant {name!r}", argv)
    try:
        config, given = parse_args([*shared, *argv, "--out", str(folder)])
        source = D.resolve_source(config.dataset, config.data, config.task)
        check_data_options(source, given)  # refused when training reached it, after the variants before it ran
        config = dataclasses.replace(config.resolved(source.task, source.kind == "synthetic"), task=source.task)
        if source.kind == "local":  # the hub's is read when training (a download)
            D.load_split(source, "train", limit=1)
    except ValueError as e:  # ConfigError, DataError
        raise ConfigError(f"variant {name!r}: {e}") from e
    return config, source.task


def _check_metric(tasks: dict[str, str], metric: str | None) -> None:
    """The compared metric is in every variant's final report: `metric` in each task's; by default (a
    task's own: accuracy, exact_match) one task, or a classifier's NaN exact_match would lose to any."""
    if metric is None and len(set(tasks.values())) > 1:
        common = [m for m in METRICS[next(iter(tasks.values()))] if all(m in METRICS[t] for t in tasks.values())]
        raise ConfigError(f"the variants train different tasks ({', '.join(f'{n!r}: {t}' for n, t in tasks.items())})"
                          f": give --metric, one that every task reports ({', '.join(common)})")
    for name, task in tasks.items():
        if metric is not None and metric not in METRICS[task]:
            raise ConfigError(f"--metric {metric}: variant {name!r} trains {task}, whose final report has "
                              f"{', '.join(METRICS[task])}")


def _check_summary(path: Path, folders: set[str]) -> None:
    """Refuse to replace another grid's summary: one with a variant this grid lacks (its run stays)."""
    if not path.is_file():
        return
    try:
        runs = {r["folder"]: r["name"] for r in json.loads(path.read_text(encoding="utf-8"))["runs"]}
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a grid's summary ({e}): give the grid another --out") from e
    lacking = [name for folder, name in runs.items() if folder not in folders]
    if lacking:
        raise ConfigError(f"{path} is the summary of another grid, with {', '.join(map(repr, lacking))}, which "
                          f"this one lacks and would replace: give this grid another --out, or name those "
                          f"variants too (their finished runs are read back)")


def _earlier_run(name: str, folder: Path, config: TrainConfig) -> dict | None:
    """The report of the variant's finished run, read back; None to train it (no run yet, one stopped,
    or a finished one given more --max-steps, --epochs or --time-budget: it trains on). A run built
    otherwise than `config` is refused by name (until 2026-12-05 read back beside today's flags)."""
    if not (folder / "args.json").is_file():
        return None
    run = TrainConfig.from_dict(json.loads((folder / "args.json").read_text(encoding="utf-8")))
    if run.task is None and (run.dataset, run.data) == (config.dataset, config.data):
        run = dataclasses.replace(run, task=D.resolve_source(run.dataset, run.data).task)  # as `config`'s
    final = final_of(folder)
    changed = _changes(config, run, finished=final is not None)
    if changed:
        raise ConfigError(f"ablation {name}: {folder} holds a {'stopped' if final is None else 'finished'} run "
                          f"built otherwise: {'; '.join(changed)}; give the grid another --out, or remove {folder} "
                          f"to train the variant again")
    if final is None:
        return None
    more = [f"{flag(k)} {shown(getattr(config, k))}" for k in BUDGET if getattr(config, k) != getattr(run, k)]
    print(f"=== ablation {name}: finished earlier, " + (f"trains on to {', '.join(more)}" if more else
                                                        f"read back from {folder / 'metrics.final.json'}"))
    return None if more else final


def _changes(config: TrainConfig, run: TrainConfig, finished: bool) -> list[str]:
    """Today's options that differ from the run's, each as "--flag NOW (the run has THEN)": all but those
    of one command (PER_COMMAND), an "auto" --precision (the device's), and a budget (BUDGET) but a
    finished run's cut short (a larger one trains on; a stopped run takes any, as --resume does)."""
    changed = []
    for k in (f.name for f in dataclasses.fields(TrainConfig)):
        now, then = getattr(config, k), getattr(run, k)
        if k == "init_from" and now is not None and now != then:
            now = str(find_checkpoint(now, prefer="best"))  # the run records the checkpoint file
        if now == then or k in PER_COMMAND or (k == "precision" and now == "auto"):
            continue
        if k in BUDGET and not (finished and now is not None and (then is None or now < then)):
            continue
        changed.append(f"{flag(k)} {shown(now)} (the run has {shown(then)})")
    return changed


def run_grid(out: Path, variants: list[str], shared: list[str], metric: str | None = None,
             jobs: int = 1) -> tuple[str, list[dict]]:
    """Train every variant into out/<name>/ (shared train flags, then the variant's), `jobs` at once,
    write out/ablation.json and out/ablation.png. Returns (the compared metric, one result per
    variant); no results when a variant stopped before its end."""
    from ..evaluation.plots import plot_ablation, read_metrics  # matplotlib: only when plotting

    _check_given("the shared flags (after --)", shared)
    given = parse_args(shared)[0]
    metric = metric or given.best_metric  # the runs' own choice of best.pt, when the shared flags make one
    planned = variant_folders(out, variants, shared, metric)
    limit = given.time_limit  # the grid command's: each variant is given what is left of it
    deadline = time.monotonic() + limit if limit else None
    finals = (run_in_turn(planned, shared, deadline) if jobs == 1
              else run_at_once(planned, shared, jobs, out / LOGS, deadline))
    stopped = [(v.name, final) for v, final in zip(planned, finals) if "stopped" in final]
    if stopped:
        for name, final in stopped:
            print(f"=== ablation stopped in {name} at step {final['step']} ({final['stopped']}): run the same "
                  f"command again to continue")
        return metric or "", []
    results = []
    for v, final in zip(planned, finals):
        metric, flat = _final_metric(final, metric)
        curve = [(r["step"], r["loss"]) for r in read_metrics(v.folder / "metrics.jsonl") if r.get("split") == "valid"]
        results.append({"name": v.name, "folder": v.folder.name, "flags": v.flags, "final": flat, "curve": curve})
    summary = {"metric": metric, "shared": shared, "best": best_variant(results, metric), "runs": results}
    write_lines_atomic(out / SUMMARY, json.dumps(summary, indent=2).splitlines())  # a kill: the old one kept
    plot_ablation(results, metric, out / PLOT, title=f"ablations ({' '.join(shared) or 'defaults'})")
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


def main(argv=None) -> list[dict]:
    """The ablate command (`python -m scratchformer.ablate`, also `python -m scratchformer.train ablate`)."""
    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each train ended the process group the next one rejoined: a hang
        raise ConfigError("ablate runs its variants in this process one after another (or --jobs N processes of its "
                          "own), not in torchrun's processes: run it without torchrun, or each variant as "
                          "`torchrun ... -m scratchformer.train FLAGS --out OUT/NAME`")
    shared = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    out = Path(args.out)
    metric, results = run_grid(out, args.variants, shared, args.metric, args.jobs)
    if not results:  # stopped: no summary yet
        return results
    print(f"\n{'variant':<20} {metric:>12} {'valid loss':>11}")
    for r in results:
        final = r["final"]
        print(f"{r['name']:<20} {final.get(metric, float('nan')):>12.2f} {final.get('loss', float('nan')):>11.4f}")
    print(f"wrote {out / SUMMARY} and {out / PLOT}")
    return results
