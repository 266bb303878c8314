"""The checkpoint of a finished run that writes its test predictions, and the length penalty it
decodes them with: best.pt, or the average of the run's last step checkpoints (averaged.pt, from
`scratchformer.average`), whichever scores higher on validation, at the penalty of its best score.
Prints the path and the penalty (tab-separated); the scores and the choice go to stderr. An
ensemble scored beside them (RUN/ensemble, `evaluate --checkpoint A B ... --out RUN/ensemble`:
several runs' checkpoints as one model) is a candidate too, after the two on a tie; picked, its
members' paths are printed, space-separated, where the one path would be.

    python -m scratchformer.average RUN --last 5
    python -m scratchformer.evaluate --checkpoint RUN/best.pt --beam-size 4 --out RUN/best
    python -m scratchformer.evaluate --checkpoint RUN/averaged.pt --beam-size 4 --out RUN/averaged
    python -m scratchformer.evaluate --checkpoint RUN/averaged.pt --beam-size 4 --length-penalty 1.3 \
        --out RUN/averaged-lp1.3            # optional: any NAME-lpX beside NAME is a candidate too
    python scripts/pick_checkpoint.py RUN   # -> "RUN/averaged.pt<TAB>1.3", say

Each candidate RUN/NAME.pt is scored by RUN/NAME/metrics.validation.json and by every
RUN/NAME-lpX/metrics.validation.json (the same decoding but for the length penalty X). All of them
must have decoded the same examples the same way (beam, n-gram blocking, minimum length; only the
length penalty may differ), as the test predictions will be. The metric is the run's --best-metric,
or the decoding metric when that is the loss (accuracy, ROUGE-Lsum, BLEU): the predictions are decoded,
so they are judged decoded. A tie keeps best.pt, and the decoding without a tuned penalty; a run
without scores for both checkpoints keeps best.pt (and prints no penalty). A folder that holds only
one of the two, neither the other's file nor its scores (an unfinished GPU run's average, brought
back alone: scripts/gpu/finish_on_cpu.sh), picks among that one's scores, as does one whose other
checkpoint's scoring failed (RUN/NAME.failed, which scripts/gpu/50_train.sh leaves: its scores at other
penalties aside, it is no candidate; it counted as one unscored, and the pick fell back to best.pt
without the tuned penalty, or to the best.pt whose scoring had failed).

Refused, as one `error:` line naming the folder or file and exit status 2 (scripts/gpu/50_train.sh
then decodes with best.pt; finish_on_cpu.sh stops): a run that is not a folder; one whose pick
would be a best.pt that is not there; a scores file that is not JSON; an args.json that is missing
or not JSON; a candidate scored without the metric; candidates scored differently.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scratchformer import cli
from scratchformer.data.files import read_json

CHECKPOINTS = ("best", "averaged")  # in order of preference on a tie
ENSEMBLE = "ensemble"  # after them
# the first in the scores: classification, summarization, translation
DECODING_METRICS = ("accuracy", "rougeLsum", "bleu")
LOWER_IS_BETTER = ("loss", "ppl")
SAME = ("n", "decoding", "no_repeat_ngram", "min_len")  # what the candidates' scores must share
UNSET = {"min_len": 0, "length_penalty": 1.0, "no_repeat_ngram": 0}  # scores written before evaluate had these flags
SCORES = "metrics.validation.json"


class PickError(ValueError):
    """A run folder no checkpoint can be picked from; the message names the folder or file
    (one `error:` line, exit status 2: `scratchformer.cli`)."""


def checkpoint_of(name: str) -> str:
    """The checkpoint a scores folder decoded: best-lp1.3 -> best."""
    return name.split("-lp")[0]


def members(run: Path, name: str, scores: dict) -> list[Path]:
    """The checkpoint files a scores folder decoded: RUN/NAME.pt, or an ensemble's members."""
    if checkpoint_of(name) != ENSEMBLE:
        return [run / f"{checkpoint_of(name)}.pt"]
    listed = scores.get("checkpoint", [])
    if not isinstance(listed, list) or not all(isinstance(m, dict) and isinstance(m.get("path"), str) for m in listed):
        raise PickError(f"{run / name / SCORES}: its \"checkpoint\" is not the list of an ensemble's members "
                        "({\"path\": ...} each)")
    return [Path(m["path"]) for m in listed]


def candidates(run: Path) -> dict[str, dict]:
    """Scores by folder name, in order of preference on a tie: best, averaged, then best-lpX and
    averaged-lpX, then the ensemble's; only those whose checkpoints are there (an ensemble's missing
    members are named in a warning). A scores file that is not a JSON object is refused, naming it."""
    names = [*CHECKPOINTS, *(f.name for c in CHECKPOINTS for f in sorted(run.glob(f"{c}-lp*"))),
             ENSEMBLE, *(f.name for f in sorted(run.glob(f"{ENSEMBLE}-lp*")))]
    scored = {name: read_json(run / name / SCORES) for name in names if (run / name / SCORES).is_file()}
    kept = {}
    for name, s in scored.items():
        found = members(run, name, s)
        if found and all(p.is_file() for p in found):
            kept[name] = s
        elif checkpoint_of(name) == ENSEMBLE:  # its members' paths as evaluate was given them: from where it ran
            gone = ", ".join(str(p) for p in found if not p.is_file())
            print(f"warning: {run / name / SCORES} scores an ensemble whose checkpoints are not there (from "
                  f"{Path.cwd()}): {gone}; it is no candidate", file=sys.stderr)
    return kept


def metric_of(run: Path, scores: dict[str, dict], first: str) -> str:
    """The metric the candidates are judged by (see the module docstring); PickError naming the
    file when args.json is not there or a candidate's scores lack the metric."""
    if not (run / "args.json").is_file():
        raise PickError(f"{run / 'args.json'}: no such file (the run's training arguments: its --best-metric "
                        "picks the checkpoint)")
    metric = read_json(run / "args.json").get("best_metric") or "loss"
    if metric in LOWER_IS_BETTER:
        metric = next((m for m in DECODING_METRICS if m in scores[first]), metric)
    for name, s in scores.items():
        if not isinstance(s.get(metric), (int, float)) or isinstance(s.get(metric), bool):
            raise PickError(f"{run / name / SCORES}: no {metric} score, which the run's args.json picks by: "
                            f"score {name} again with an evaluate that reports it, or remove the folder")
    return metric


def pick(run: Path) -> tuple[list[Path], float | None, str]:
    """(the checkpoint, or an ensemble's, the length penalty to decode with or None, why). PickError
    for a run that is not a folder, or whose pick would be a checkpoint that is not there."""
    if not run.is_dir():
        raise PickError(f"{run}: {'a file, not a' if run.exists() else 'no such'} run folder")
    # a checkpoint whose scoring failed (RUN/NAME.failed, 50_train.sh: out of memory, say) is no candidate
    failed = {c for c in CHECKPOINTS if (run / f"{c}.failed").exists()}
    scores = {name: s for name, s in candidates(run).items() if checkpoint_of(name) not in failed}
    present = [c for c in CHECKPOINTS if c not in failed and ((run / f"{c}.pt").is_file() or (run / c).is_dir())]
    if not present or not set(present) <= scores.keys():
        have = f"validation scores for {', '.join(scores) or 'none'} of {', '.join(CHECKPOINTS)}"
        if not (run / "best.pt").is_file():  # what a run without scores for both keeps
            raise PickError(f"{run}: no best.pt, and {have}: score each checkpoint there (evaluate --out RUN/NAME)")
        return [run / "best.pt"], None, have
    differ = [k for k in SAME if len({json.dumps(s.get(k, UNSET.get(k))) for s in scores.values()}) > 1]
    if differ:
        raise PickError(f"the candidates of {run} were scored differently ({', '.join(differ)}): score them "
                        "with the same evaluate flags")
    metric = metric_of(run, scores, present[0])
    sign = -1 if metric in LOWER_IS_BETTER else 1
    name = max(scores, key=lambda c: sign * scores[c][metric])  # the first of equals: candidates' order
    length_penalty = float(scores[name].get("length_penalty", UNSET["length_penalty"]))
    shown = ", ".join(f"{c} {s[metric]:.2f}" for c, s in scores.items())
    return members(run, name, scores[name]), length_penalty, \
        f"validation {metric} ({scores[present[0]].get('decoding')}): {shown}; length penalty {length_penalty:g}"


def main(argv=None) -> tuple[list[Path], float | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a finished run folder")
    cli.add_debug_flag(p)
    args = p.parse_args(argv)
    paths, length_penalty, why = pick(args.run)
    name = paths[0].name if len(paths) == 1 else f"an ensemble of {len(paths)}"
    print(f"{name}: {why}", file=sys.stderr)
    picked = " ".join(map(str, paths))
    print(picked if length_penalty is None else f"{picked}\t{length_penalty:g}")
    return paths, length_penalty


if __name__ == "__main__":
    sys.exit(cli.run(main))
