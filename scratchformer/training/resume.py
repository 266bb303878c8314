"""What a continued run may change: --resume (the checkpoint's config, with the options given now
that may change) and --init-from (the checkpoint's architecture and tokenizers)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..cli import shown
from .config import TEACHER_FORCED, ConfigError, TrainConfig, flag

# What a resumed run cannot change: the data and its encoding, the tokenizer, the model, the
# batching (the epoch position is counted in batches), the seed (the batch order), the optimizer's
# and plateau schedule's settings (restored from the checkpoint), the metric its best is in and the
# validation examples it is measured on (--max-valid-examples; the examples' digest: `launch`). --data
# may name the run's data folder moved elsewhere: `launch` checks its examples against the checkpoint's digests.
# Everything else may change (--max-steps, --time-budget, --epochs, --lr, --warmup-steps, --min-lr, evaluation,
# checkpoint and logging flags, --device, --kernel, --precision, --compile, --recompute-activations).
FIXED_ON_RESUME = (
    "task", "dataset", "max_train_examples", "max_valid_examples", "valid_fraction", "max_src_len",
    "max_tgt_len", "synthetic_seed",
    "vocab_size", "separate_vocab", "tokenizer", "tokenizer_examples", "bpe_dropout", "preset", "d_model", "heads",
    "layers", "encoder_layers", "decoder_layers", "d_ff", "dropout", "attn_dropout", "ffn_dropout", "word_dropout",
    "activation", "norm", "final_norm", "tie_embeddings", "no_pos_encoding", "copy", "batch_size", "max_tokens",
    "pad_multiple", "schedule", "plateau_patience", "weight_decay", "adam_betas", "adam_eps", "seed", "best_metric",
)
# And where the best metric is a decoding one (BLEU, ROUGE, ...): the examples decoded and an extractive
# summary's size, which its value depends on (a teacher-forced best, the loss, does not).
FIXED_FOR_A_DECODED_BEST = ("eval_decode_examples", "summary_sentences", "summary_words")


def check_init_from(given: frozenset[str], init_path: str) -> None:
    """--init-from takes the architecture and tokenizers of its checkpoint: every model and tokenizer
    option but the backend (--kernel) given with it is refused by name."""
    taken = [flag(f.name) for f in dataclasses.fields(TrainConfig)
             if f.name in given and f.metadata["group"] in ("model", "tokenizer") and f.name != "kernel"]
    if taken:
        raise ConfigError(f"--init-from {init_path} builds the model and tokenizers of that run: drop "
                          f"{', '.join(taken)} (only --kernel may change)")


def resumed(config: TrainConfig, given: frozenset[str], saved: dict, resume_path: str) -> TrainConfig:
    """A resumed run's config: the checkpoint's, except the options given now (and --resume); its
    --out is the caller's to set (the folder it resumes in). An option in FIXED_ON_RESUME given with
    another value than the run's is refused by name."""
    base = TrainConfig.from_dict({**saved, "overwrite": False, "resume": config.resume})
    changed = fixed_changes(config, given, base)
    if changed:
        raise ConfigError(f"--resume continues the run of {resume_path} as it was built: {'; '.join(changed)} "
                          f"cannot change; drop {'it' if len(changed) == 1 else 'them'}, or start a new run "
                          f"(another --out, or --overwrite)")
    if "data" not in given and base.data is not None and not Path(base.data).is_dir():
        raise ConfigError(f"--resume continues the run of {resume_path} on its --data {base.data}, which is not "
                          f"there: if that folder moved, give --data with its new place (its examples are checked "
                          f"against those the checkpoint records)")
    if "lr" in given and base.schedule == "plateau" and config.lr != base.lr:
        raise ConfigError(f"--lr cannot change when resuming a --schedule plateau run (its lr, halved on plateaus, "
                          f"continues from the checkpoint); the run has --lr {base.lr:g}")
    now = {k: getattr(config, k) for k in given | {"resume"}}
    return dataclasses.replace(base, **now, resume_path=resume_path)


def fixed_changes(config: TrainConfig, given: frozenset[str], run: TrainConfig) -> list[str]:
    """The options of FIXED_ON_RESUME (and FIXED_FOR_A_DECODED_BEST, for a run whose best metric is a
    decoding one; --data, for a run of a named dataset) given in `config` with another value than `run`'s,
    each as "--flag NEW (the run has OLD)"."""
    fixed = FIXED_ON_RESUME + (FIXED_FOR_A_DECODED_BEST if run.best_metric not in TEACHER_FORCED else ()) + (
        ("data",) if run.data is None else ())  # a run's folder may move; a run without one gets none
    return [f"{flag(k)} {shown(getattr(config, k))} (the run has {shown(getattr(run, k))}"
            f"{f'; its best {run.best_metric} depends on it' * (k in FIXED_FOR_A_DECODED_BEST)})"
            for k in fixed if k in given and getattr(config, k) != getattr(run, k)]
