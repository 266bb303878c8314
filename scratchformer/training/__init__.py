"""Training: `TrainConfig` (config.py) -> the run's parts (build.py: data, tokenizers, model) ->
`Trainer` (trainer.py: the loop), with optim.py (loss, AdamW, schedules), runs.py (run folder,
logger), distributed.py (DDP), report.py (the final evaluation) and ablation.py (grids of runs, whose
variants variants.py runs); checkpoint files and RNG states are `scratchformer/checkpoint.py` (the
run format, shared with evaluation). This file imports nothing: importing one submodule loads only what that submodule
needs."""
