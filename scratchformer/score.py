"""Score given outputs: each (source, target) pair's log-probability under a trained checkpoint
(`evaluation.scoring`): fairseq's --score-reference, Sockeye's score, Marian's scorer.

    python -m scratchformer.score --checkpoint runs/m30k --input ../shared/data/multi30k/validation.jsonl.gz
    python -m scratchformer.score --checkpoint runs/m30k --input pairs.jsonl --output scores.jsonl
    python -m scratchformer.score --checkpoint runs/fwd runs/fwd2 --input pairs.tsv    # an ensemble's scores

Input: a data file of pairs as training reads them (`.jsonl` (`.gz`, `.xz`), `.tsv`, `.parquet`; the
task's fields: src/tgt, document/summary). Output: one JSON line per pair, in input order,
``{"id", "score", "log_prob", "tokens"}`` (id: the record's, else its 1-based place), on stdout or
written atomically to --output; a summary (pairs, tokens, the mean log-probability of a token and its
perplexity) on stderr. score = log_prob / tokens ** --length-penalty, generate's scale: scoring
generate's output gives the score its --json printed (an output that ended with EOS, of an input
generate did not cut: a hypothesis stopped at its cap was scored without an EOS). A user error is
one line on stderr and exit status 2; --debug keeps the traceback.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import cli
from . import data as D
from .checkpoint import is_checkpoint, output_file_refusal, write_lines_atomic
from .device import resolve_device
from .evaluation.evaluate import AUTOCAST_DTYPES
from .evaluation.loading import load_models
from .evaluation.options import MAX_LENGTH_PENALTY, OptionError, check_options
from .evaluation.scoring import check_task, encode_pairs, score_pairs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.score",
                                description="Score (source, target) pairs: each target's log-probability under a "
                                "trained checkpoint.")
    p.add_argument("--checkpoint", required=True, nargs="+", metavar="CKPT",
                   help="checkpoint file, or a run folder (uses its best.pt); several: an ensemble, scored by the "
                   "mean of their probabilities")
    p.add_argument("--input", required=True, metavar="FILE",
                   help="the pairs: .jsonl(.gz/.xz), .tsv or .parquet records with the task's fields")
    p.add_argument("--output", metavar="SCORES.jsonl", help="write the scores here, atomically (default: stdout)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--length-penalty", type=float, default=1.0,
                   help="score = log_prob / tokens ** this (default: 1, the mean log-probability; 0: the sum)")
    p.add_argument("--max-tokens", type=int, default=4096, help="token budget per batch (default: 4096)")
    p.add_argument("--batch-size", type=int, help="at most this many pairs per batch")
    p.add_argument("--precision", choices=tuple(AUTOCAST_DTYPES), default="fp32", help="autocast dtype (default: fp32)")
    p.add_argument("--device", help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--kernel", choices=("auto", "eager", "torch", "triton"), help="override the backend")
    cli.add_debug_flag(p)
    return p


def check_args(args) -> Path | None:
    """Refuse what no checkpoint can take, before any work; returns --output as a Path (None: stdout)."""
    check_options(max_tokens=args.max_tokens, batch_size=args.batch_size)
    if not abs(args.length_penalty) <= MAX_LENGTH_PENALTY:  # NaN fails too; past it tokens ** it overflowed
        raise OptionError(f"--length-penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}] "
                          f"(tokens ** it divides a score), got {args.length_penalty}")
    args.device = resolve_device(args.device)
    if args.output is None:
        return None
    output = Path(args.output)
    if (refusal := output_file_refusal(output, "the scores", "scores.jsonl")) is not None:
        raise cli.UsageError(refusal)
    if output.resolve() == Path(args.input).resolve():
        raise cli.UsageError(f"--output {output} is the --input: write the scores elsewhere")
    if is_checkpoint(output):  # even with --overwrite: the model would be lost
        raise cli.UsageError(f"--output {output} is a checkpoint: write the scores elsewhere")
    if output.exists() and not args.overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it, or another --output")
    return output


def main(argv=None) -> list[dict]:
    args = build_parser().parse_args(argv)
    output = check_args(args)
    model, toks, ckpt = load_models(args.checkpoint, args.device, args.kernel)
    check_task(ckpt["task"])  # before the file is read as another task's
    examples = D.read_split(args.input, ckpt["task"])  # DataError: file and line
    dataset = encode_pairs(examples, ckpt["task"], toks, model.cfg.max_len - 1, source=args.input)
    scores = score_pairs(model, dataset, device=args.device, length_penalty=args.length_penalty,
                         max_tokens=args.max_tokens, batch_size=args.batch_size, precision=args.precision)
    records = [{"id": e.id if e.id is not None else n, **s} for n, (e, s) in enumerate(zip(examples, scores), 1)]
    lines = (json.dumps(r, ensure_ascii=False) for r in records)
    if output is not None:
        write_lines_atomic(output, lines)
    else:
        for line in lines:
            print(line)
    log_prob, tokens = sum(r["log_prob"] for r in records), sum(r["tokens"] for r in records)
    print(f"{output or '<stdout>'}: {len(records)} pairs, {tokens} target tokens, mean log-probability "
          f"{log_prob / tokens:.4f} a token (perplexity {math.exp(-log_prob / tokens):.3f})", file=sys.stderr)
    return records


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
