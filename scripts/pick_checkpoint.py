"""The checkpoint of a finished run that writes its test predictions: best.pt, or the average of the
run's last step checkpoints (RUN/averaged.pt, from `scratchformer.average`) when that scores higher
on validation under the same decoding. Prints the path; the scores and the choice go to stderr.

    python -m scratchformer.average RUN --last 5
    python -m scratchformer.evaluate --checkpoint RUN/averaged.pt --beam-size 4 --out RUN/averaged
    python scripts/pick_checkpoint.py RUN --decoding beam4      # -> RUN/averaged.pt or RUN/best.pt

best.pt's scores are the run's final report (RUN/metrics.final.json, every validation example),
the average's are `evaluate`'s (RUN/averaged/metrics.validation.json, every validation example too),
decoded the same way. The metric is the run's --best-metric, or the task's decoding
metric when that is the loss (BLEU, ROUGE-L, accuracy): the predictions are decoded, so they are
judged decoded. Without an averaged.pt and its scores, best.pt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DECODING_METRICS = ("accuracy", "rougeL", "bleu")  # the first in the scores: classification, summarization, translation
LOWER_IS_BETTER = ("loss", "ppl")


def pick(run: Path, decoding: str) -> tuple[Path, str]:
    """(the checkpoint, why)."""
    best, averaged = run / "best.pt", run / "averaged.pt"
    scores = run / "averaged" / "metrics.validation.json"
    if not (averaged.is_file() and scores.is_file()):
        return best, "no averaged.pt with validation scores"
    final = json.loads((run / "metrics.final.json").read_text())
    args = json.loads((run / "args.json").read_text())
    avg = json.loads(scores.read_text())
    if avg.get("decoding") != decoding or decoding not in final:
        raise SystemExit(f"error: {scores} decoded {avg.get('decoding')}; the final report has "
                         f"{', '.join(k for k, v in final.items() if isinstance(v, dict))}: give --decoding as both")
    metric = args.get("best_metric") or "loss"
    if metric in LOWER_IS_BETTER:
        metric = next((m for m in DECODING_METRICS if m in avg), metric)
    if metric not in avg or metric not in final[decoding]:
        raise SystemExit(f"error: {metric} is not in both {scores} and {run / 'metrics.final.json'} [{decoding}]")
    ours, theirs = avg[metric], final[decoding][metric]
    better = ours < theirs if metric in LOWER_IS_BETTER else ours > theirs
    why = f"validation {metric} ({decoding}): averaged.pt {ours:.2f}, best.pt {theirs:.2f}"
    return (averaged if better else best), why


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run folder (metrics.final.json)")
    p.add_argument("--decoding", default="beam4", help="greedy or beamN: the scores compared (default beam4)")
    args = p.parse_args(argv)
    path, why = pick(args.run, args.decoding)
    print(f"{path.name}: {why}", file=sys.stderr)
    print(path)
    return path


if __name__ == "__main__":
    main()
