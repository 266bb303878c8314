"""The checkpoint of a finished run that writes its test predictions: best.pt, or the average of the
run's last step checkpoints (averaged.pt, from `scratchformer.average`) when that scores higher on
validation. Prints the path; the scores and the choice go to stderr.

    python -m scratchformer.average RUN --last 5
    python -m scratchformer.evaluate --checkpoint RUN/best.pt --beam-size 4 --out RUN/best
    python -m scratchformer.evaluate --checkpoint RUN/averaged.pt --beam-size 4 --out RUN/averaged
    python scripts/pick_checkpoint.py RUN      # -> RUN/averaged.pt or RUN/best.pt

Each candidate RUN/NAME.pt is scored by RUN/NAME/metrics.validation.json, and all of them must have
decoded the same examples the same way (beam, length penalty, n-gram blocking, minimum length), as the test
predictions will be. The metric is the run's --best-metric, or the decoding metric when that is the
loss (accuracy, ROUGE-L, BLEU): the predictions are decoded, so they are judged decoded. A tie keeps
best.pt; a run without scores for the average keeps best.pt.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CANDIDATES = ("best", "averaged")  # in order of preference on a tie
DECODING_METRICS = ("accuracy", "rougeL", "bleu")  # the first in the scores: classification, summarization, translation
LOWER_IS_BETTER = ("loss", "ppl")
SAME = ("n", "decoding", "length_penalty", "no_repeat_ngram", "min_len")  # what the candidates' scores must share
UNSET = {"min_len": 0}  # scores written before evaluate had --min-len


def pick(run: Path) -> tuple[Path, str]:
    """(the checkpoint, why)."""
    scores = {name: json.loads((run / name / "metrics.validation.json").read_text()) for name in CANDIDATES
              if (run / f"{name}.pt").is_file() and (run / name / "metrics.validation.json").is_file()}
    if "best" not in scores or len(scores) < 2:
        return run / "best.pt", f"validation scores for {', '.join(scores) or 'none'} of {', '.join(CANDIDATES)}"
    differ = [k for k in SAME if len({json.dumps(s.get(k, UNSET.get(k))) for s in scores.values()}) > 1]
    if differ:
        raise SystemExit(f"error: the candidates of {run} were scored differently ({', '.join(differ)}): score them "
                         "with the same evaluate flags")
    metric = json.loads((run / "args.json").read_text()).get("best_metric") or "loss"
    if metric in LOWER_IS_BETTER:
        metric = next((m for m in DECODING_METRICS if m in scores["best"]), metric)
    sign = -1 if metric in LOWER_IS_BETTER else 1
    name = max(CANDIDATES, key=lambda c: (sign * scores[c][metric], -CANDIDATES.index(c)))
    shown = ", ".join(f"{c}.pt {scores[c][metric]:.2f}" for c in CANDIDATES)
    return run / f"{name}.pt", f"validation {metric} ({scores['best'].get('decoding')}): {shown}"


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run folder")
    args = p.parse_args(argv)
    path, why = pick(args.run)
    print(f"{path.name}: {why}", file=sys.stderr)
    print(path)
    return path


if __name__ == "__main__":
    main()
