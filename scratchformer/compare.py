"""Compare systems on the same examples: each one's score, its difference from the first (the
baseline) with a 95% interval, and the p-value of a paired bootstrap (`evaluation.significance`;
sacrebleu's ``--paired-bs`` for BLEU and chrF, the same test for ROUGE and accuracy), with the exact
McNemar test beside it for accuracy and exact match.

    python -m scratchformer.compare runs/beam/predictions.validation.jsonl runs/mbr/predictions.validation.jsonl
    python -m scratchformer.compare A.jsonl B.jsonl C.jsonl --metric rouge1 rouge2 rougeLsum
    python -m scratchformer.compare A.jsonl B.jsonl --samples 10000 --json comparison.json

Input: `evaluate`'s predictions files (``predictions.<split>.jsonl``: one ``{"id", "reference",
"prediction"}`` per example), one per system, of the same examples. Rows are matched by id; files
whose ids or references differ are refused. Metrics (--metric): bleu, chrf, rouge1, rouge2, rougeL,
rougeLsum, accuracy, exact_match, or rouge for rouge1 rouge2 rougeLsum; by default accuracy for
labels and bleu chrf for texts. A user error is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from . import cli
from .checkpoint import is_checkpoint, output_file_refusal, write_lines_atomic
from .data.files import DataError, display_name, read_json_lines
from .evaluation.significance import BINARY, METRICS, SEED, mcnemar, paired_bootstrap, statistics

ROUGE = ("rouge1", "rouge2", "rougeLsum")
NAMES = {"bleu": "BLEU", "chrf": "chrF", "rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeL": "ROUGE-L",
         "rougeLsum": "ROUGE-Lsum", "accuracy": "accuracy", "exact_match": "exact match"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.compare",
                                description="Paired bootstrap comparison of systems' outputs for the same examples; "
                                "the first file is the baseline.")
    p.add_argument("predictions", nargs="+", metavar="PREDICTIONS.jsonl",
                   help="evaluate's predictions files, one per system, the baseline first")
    p.add_argument("--metric", nargs="+", choices=(*METRICS, "rouge"), metavar="METRIC",
                   help=f"{', '.join(METRICS)}, or rouge (= {' '.join(ROUGE)}); default: accuracy for labels, "
                   "bleu chrf for texts")
    p.add_argument("--samples", type=int, default=1000, help="bootstrap resamples (default: 1000, as sacrebleu)")
    p.add_argument("--seed", type=int, default=SEED, help=f"the resamples' seed (default: {SEED}, as sacrebleu)")
    p.add_argument("--json", metavar="FILE", help="also write every figure here, atomically, as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json file")
    cli.add_debug_flag(p)
    return p


def read_predictions(path: str) -> dict[str, tuple[object, object]]:
    """{id: (reference, prediction)} of an evaluate predictions file; DataError names the file and line."""
    name, rows = display_name(path), {}
    for lineno, row in read_json_lines(path):
        missing = [k for k in ("id", "reference", "prediction") if not isinstance(row, dict) or k not in row]
        if missing:
            raise DataError(f"{name}:{lineno}: no {', '.join(repr(k) for k in missing)}: compare reads evaluate's "
                            "predictions files (id, reference, prediction), which score a split with references")
        rid = str(row["id"])
        if rid in rows:
            raise DataError(f"{name}:{lineno}: id {rid!r} again; each example once")
        rows[rid] = row["reference"], row["prediction"]
    if not rows:
        raise DataError(f"{name}: no predictions")
    return rows


def _aligned(paths: list[str]) -> tuple[list, list[list]]:
    """(references, each system's predictions), in the baseline's order; refused unless every file
    holds the same ids with the same references."""
    base = read_predictions(paths[0])
    refs, systems = [r for r, _ in base.values()], [[p for _, p in base.values()]]
    for path in paths[1:]:
        rows = read_predictions(path)
        if rows.keys() != base.keys():
            extra, lost = sorted(rows.keys() - base.keys()), sorted(base.keys() - rows.keys())
            raise DataError(f"{display_name(path)}: not the examples of {display_name(paths[0])} ({len(rows)} "
                            f"against {len(base)}; " + (f"id {extra[0]!r} only here" if extra else
                                                        f"id {lost[0]!r} missing") + ")")
        for rid, (ref, _) in base.items():
            if rows[rid][0] != ref:
                raise DataError(f"{display_name(path)}: id {rid!r} has another reference than in "
                                f"{display_name(paths[0])}: not the same split")
        systems.append([rows[rid][1] for rid in base])
    return refs, systems


def _is_label(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _metrics(args, refs: list, systems: list[list]) -> list[str]:
    """The metrics to compare, --metric's or the default for what the baseline predicts (class ids:
    accuracy; texts: bleu chrf); refused where a metric does not score those, or where a reference or
    a system's prediction is of the other kind."""
    labels = all(map(_is_label, systems[0]))
    kind = "class ids" if labels else "texts"
    for what, path, values in (("references", args.predictions[0], refs),
                               *(("predictions", p, s) for p, s in zip(args.predictions, systems))):
        if not all(_is_label(v) if labels else isinstance(v, str) for v in values):
            raise DataError(f"{display_name(path)}: its {what} are not all {kind}, as the baseline's predictions are")
    chosen = args.metric or (["accuracy"] if labels else ["bleu", "chrf"])
    chosen = list(dict.fromkeys(m for c in chosen for m in (ROUGE if c == "rouge" else (c,))))
    for m in chosen:
        if (m == "accuracy") != labels:
            raise cli.UsageError(f"--metric {m} does not score {kind}, which {display_name(args.predictions[0])} "
                                 "predicts" + ("; use --metric accuracy" if labels else ""))
    return chosen


def check_args(args) -> Path | None:
    if len(args.predictions) < 2:
        raise cli.UsageError("compare needs two predictions files or more: the baseline, then the systems")
    if len(set(map(str, map(Path, args.predictions)))) < len(args.predictions):
        raise cli.UsageError("a predictions file is given twice")
    if args.samples < 1:
        raise cli.UsageError(f"--samples must be >= 1, got {args.samples}")
    if not 0 <= args.seed < 2**32:
        raise cli.UsageError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.json is None:
        return None
    out = Path(args.json)
    if out.resolve() in {Path(p).resolve() for p in args.predictions}:
        raise cli.UsageError(f"--json {out} is one of the predictions files to compare: write elsewhere")
    if (refusal := output_file_refusal(out, "the comparison", "comparison.json", "--json")) is not None:
        raise cli.UsageError(refusal)
    if is_checkpoint(out):  # even with --overwrite: the model would be lost
        raise cli.UsageError(f"--json {out} is a checkpoint: write the comparison elsewhere")
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{out} exists; pass --overwrite to replace it, or another --json")
    return out


def _p(p: float) -> str:
    return f"{p:.4f}{' *' if p < 0.05 else '  '}"


def table(paths: list[str], results: dict[str, list], n: int, samples: int, seed: int) -> str:
    """A block per metric, a row per system: its score, the bootstrap's mean ± 95% CI, and for a system
    its difference from the baseline with its 95% interval and p (* below 0.05)."""
    width = max(len(p) for p in paths)
    lines = [f"{n} examples; paired bootstrap, {samples} resamples, seed {seed}"]
    for metric, rows in results.items():
        exact = metric in BINARY
        head = f"{'score':>7}  {'mean ± 95% CI':>15}  {'vs baseline [95% interval]':>28}  p" + (
            "       McNemar p" if exact else "")
        lines += ["", f"{NAMES[metric]:<{width}}  {head}"]
        for path, c in zip(paths, rows):
            versus = "(baseline)" if path == paths[0] else (
                f"{c.difference:+.2f} [{c.difference_interval[0]:+.2f}, {c.difference_interval[1]:+.2f}]")
            p = "" if path == paths[0] else _p(c.p) + (f"  {_p(c.p_mcnemar)}" if exact else "")
            lines.append(f"{path:<{width}}  {c.score:>7.2f}  {c.mean:>7.2f} ± {c.ci:<5.2f}  {versus:>28}  {p}".rstrip())
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    out = check_args(args)
    refs, systems = _aligned(args.predictions)
    metrics = _metrics(args, refs, systems)
    per_system = [statistics(metrics, preds, refs) for preds in systems]
    results = {}
    for metric in metrics:
        stats = [s[metric] for s in per_system]
        base, others = paired_bootstrap(stats[0], stats[1:], args.samples, args.seed)
        if metric in BINARY:
            for s, c in zip(stats[1:], others):
                c.p_mcnemar = mcnemar(stats[0], s)
        results[metric] = [base, *others]
    print(table(args.predictions, results, len(refs), args.samples, args.seed))
    report = {"examples": len(refs), "samples": args.samples, "seed": args.seed, "baseline": args.predictions[0],
              "systems": {path: {m: asdict(rows[i]) for m, rows in results.items()}
                          for i, path in enumerate(args.predictions)}}
    if out is not None:
        write_lines_atomic(out, [json.dumps(report, indent=2)])
    return report


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
