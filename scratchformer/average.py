"""Average the weights of a run's checkpoints into one checkpoint (`checkpoint.average_checkpoints`).

    python -m scratchformer.average runs/multi30k --last 5          # -> runs/multi30k/averaged.pt
    python -m scratchformer.average runs/a/step_0004000.pt runs/a/step_0004500.pt --output avg.pt
    python -m scratchformer.evaluate --checkpoint runs/multi30k/averaged.pt --beam-size 4

The Transformer's results average a run's last 5 (base) or 20 (big) checkpoints, written minutes
apart: train with --save-every and --keep-checkpoints N to keep them. The average evaluates,
generates and starts a run (train --init-from) like any checkpoint; it has no optimizer state, so
it does not resume one. The output is written atomically and never over an existing file unless
--overwrite. A user error is one line on stderr and exit status 2; --debug keeps the traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from . import cli
from .checkpoint import average_checkpoints, output_file_refusal, save_checkpoint, step_checkpoints

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m scratchformer.average",
                                description="Average the weights of checkpoints of one run into one checkpoint.")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT",
                   help="checkpoint files of one run, or its run folder with --last N")
    p.add_argument("--last", type=int, metavar="N", help="the run folder's newest N step checkpoints (step_*.pt)")
    p.add_argument("--output", help="the averaged checkpoint (default: averaged.pt in the folder of the newest)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="store the averaged weights in this dtype (bf16: half "
                   "the bytes of fp32; a model loads them into its own; default: the checkpoints')")
    cli.add_debug_flag(p)
    return p


def inputs(args) -> list[Path]:
    """The checkpoint files to average (UsageError for a flag combination that names none)."""
    if args.last is None:
        paths = [Path(c) for c in args.checkpoints]
        folders = [str(p) for p in paths if p.is_dir()]
        if folders:
            raise cli.UsageError(f"{folders[0]} is a folder: give --last N to average its newest N step checkpoints")
    else:
        if len(args.checkpoints) != 1 or not Path(args.checkpoints[0]).is_dir():
            raise cli.UsageError(f"--last takes one run folder, got {' '.join(args.checkpoints)}")
        if args.last < 1:
            raise cli.UsageError(f"--last must be >= 1, got {args.last}")
        steps = step_checkpoints(args.checkpoints[0])
        if len(steps) < args.last:
            raise cli.UsageError(f"--last {args.last}: {args.checkpoints[0]} holds {len(steps)} step checkpoints "
                                 f"(a run keeps its newest --keep-checkpoints, one each --save-every steps: average "
                                 f"fewer, or train with more of them kept, or longer)")
        paths = steps[-args.last:]
    if len({p.resolve() for p in paths}) < len(paths):
        raise cli.UsageError("a checkpoint is given twice: each counts once in the average")
    return paths


def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    paths = inputs(args)
    folders = {p.resolve().parent for p in paths}  # of several, the newest's is known once they are read
    output = Path(args.output) if args.output else paths[-1].parent / "averaged.pt" if len(folders) == 1 else None
    if output is not None:
        check_output(output, paths, args.overwrite)
    averaged = average_checkpoints(paths, DTYPES.get(args.dtype))
    if output is None:  # the last given of the step whose progress the average took
        newest = [i for i, a in enumerate(averaged["averaged_from"]) if a["step"] == averaged["progress"]["step"]]
        output = paths[newest[-1]].parent / "averaged.pt"
        check_output(output, paths, args.overwrite)
    save_checkpoint(output, averaged)
    steps = ", ".join(str(a["step"]) for a in averaged["averaged_from"])
    print(f"{output}: the average of {len(paths)} checkpoints (steps {steps})", file=sys.stderr)
    return output


def check_output(output: Path, paths: list[Path], overwrite: bool) -> None:
    """Refuse an --output that is one of `paths`, a folder, under a file, or taken (without --overwrite)."""
    if output.resolve() in {p.resolve() for p in paths}:
        raise cli.UsageError(f"--output {output} is one of the checkpoints to average: write elsewhere")
    if (refusal := output_file_refusal(output, "the checkpoint", "averaged.pt")) is not None:
        raise cli.UsageError(refusal)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} exists; pass --overwrite to replace it, or another --output")


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
