"""Training: `TrainConfig` (config.py) -> the run's parts (build.py: data, tokenizers, model) ->
`Trainer` (trainer.py: the loop), with optim.py (loss, AdamW, schedules), runs.py (run folder,
logger), distributed.py (DDP), checkpoint.py (files and RNG states), report.py (the final
evaluation) and ablation.py (grids of runs). This file imports nothing: importing one submodule
loads only what that submodule needs."""
