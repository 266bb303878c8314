"""Train a Transformer (translation, summarization) or an encoder-only classifier.

    python -m scratchformer.train                          # synthetic smoke task, CPU, about a minute
    python -m scratchformer.train --dataset multi30k --preset small --max-tokens 4096 --out runs/m30k
    python -m scratchformer.train --data ../shared/data/samsum --max-src-len 512 --out runs/samsum
    python -m scratchformer.train --dataset imdb --out runs/imdb   # classification (validation carved from train)
    torchrun --nproc_per_node=2 -m scratchformer.train --dataset multi30k ...   # DistributedDataParallel
    python -m scratchformer.train --resume --out runs/m30k  # continue exactly where it stopped
    python -m scratchformer.train ablate ...                # the ablation grid (python -m scratchformer.ablate)

A user error (bad flag, data file, checkpoint, a full disk) ends the command with one line on
stderr and exit status 2; --debug (or SCRATCHFORMER_DEBUG=1) shows the traceback (`scratchformer.cli`).

A run folder (--out) holds config.json, args.json, the tokenizer(s), checkpoints (step_*.pt,
last.pt, best.pt), log.txt, metrics.jsonl, train.csv, valid.csv, metrics.final.json,
predictions.validation.jsonl and plots/. The recipe: AdamW (0.9, 0.98),
inverse-sqrt / cosine / plateau schedules with warmup, label smoothing (pad ignored), gradient
clipping and accumulation, bf16/fp16 autocast on GPU, early stopping, exact resume. The options
are the fields of `scratchformer.training.config.TrainConfig`; the loop is
`scratchformer.training.trainer.Trainer`.
"""

from __future__ import annotations

import sys

from . import cli
from .training import ablation
from .training.config import parse_args
from .training.trainer import train


def main(argv=None) -> dict | list[dict]:
    """Train; returns the final validation metrics (also the last lines printed)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["ablate"]:
        return ablation.main(argv[1:])
    config, given = parse_args(argv)
    return train(config, given)


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
