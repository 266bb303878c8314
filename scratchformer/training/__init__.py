"""Training: `TrainConfig` (config.py) -> the run's parts (build.py: data, tokenizers, model) ->
`Trainer` (trainer.py: the loop), with optim.py (loss, AdamW, schedules), runs.py (run folder,
logger), distributed.py (DDP), checkpoint.py (files and RNG states), report.py (the final
evaluation) and ablation.py (grids of runs). Import the submodules; this file imports nothing,
so `scratchformer.training.checkpoint` stays cheap for the evaluation command."""
