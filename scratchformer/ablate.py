"""Ablation grid: train one run per variant with shared settings, then draw the comparison plot.

    python -m scratchformer.ablate --out runs/ablate                       # default grid, synthetic task
    python -m scratchformer.ablate --out runs/ab --variants "base=" "pre-ln=--norm pre" "1 head=--heads 1" \\
        -- --dataset multi30k --max-steps 3000            # flags after -- go to every run
    python -m scratchformer.train ablate ...              # the same command

Each variant is ``NAME=FLAGS`` (train flags appended to the shared ones). Runs go to OUT/<name>/;
OUT/ablation.json holds every run's final metrics and validation-loss curve, OUT/ablation.png the
plot (final metric bars + validation loss curves). The grid is `scratchformer.training.ablation`.
A user error is one line on stderr and exit status 2; --debug (before --) keeps the traceback.
"""

from __future__ import annotations

import sys

from . import cli
from .training.ablation import main

__all__ = ["main", "run"]


def run(argv=None) -> int:
    """The command line: `main`, a user error as one line and exit status 2 (`cli.run`; --debug keeps the traceback)."""
    return cli.run(main, argv)


if __name__ == "__main__":
    sys.exit(run())
