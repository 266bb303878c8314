"""What a continued run may change: --resume (the checkpoint's config, with the options given now
that may change) and --init-from (the checkpoint's architecture and tokenizers); and which
checkpoint --resume continues (`load_resume_checkpoint`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..checkpoint import RESUME_KEYS, CheckpointError, find_checkpoint, load_checkpoint, step_checkpoints
from ..cli import shown
from ..locks import holder
from .config import MODEL_FIELDS, TEACHER_FORCED, ConfigError, TrainConfig, flag
from .runs import IN_USE, LOCK, RunFolderError, resumes_elsewhere

# What a resumed run cannot change: the data and its encoding, the tokenizer, the model, the
# batching (the epoch position is counted in batches), the seed (the batch order), the optimizer's
# and plateau schedule's settings (restored from the checkpoint), the metric its best is in and the
# validation examples it is measured on (--max-valid-examples; the examples' digest: `launch`). --data
# may name the run's data folder moved elsewhere: `launch` checks its examples against the checkpoint's digests.
# Everything else may change (--max-steps, --time-budget, --epochs, --lr, --warmup-steps, --min-lr, evaluation,
# checkpoint and logging flags, --device, --kernel, --precision, --compile, --recompute-activations, --ema:
# a run given it anew starts its average at the resumed weights).
FIXED_ON_RESUME = (
    "task", "dataset", "max_train_examples", "max_valid_examples", "valid_fraction", "max_src_len",
    "max_tgt_len", "synthetic_seed",
    "vocab_size", "separate_vocab", "tokenizer", "tokenizer_examples", "bpe_dropout", "preset", "d_model", "heads",
    "layers", "encoder_layers", "decoder_layers", "d_ff", "dropout", "attn_dropout", "ffn_dropout", "word_dropout",
    "activation", "norm", "final_norm", "tie_embeddings", "no_pos_encoding", "copy", "batch_size", "max_tokens",
    "pad_multiple", "schedule", "plateau_patience", "weight_decay", "adam_betas", "adam_eps", "seed", "best_metric",
)
# A command's own options: a resume takes them as given, not from the run (the --time-limit that paused
# a run paused every resume of it, and no value turned it off; a --tensorboard run could not be resumed
# where the package is missing; a --no-plots run had no plots after any resume of it).
ONE_COMMAND = ("time_limit", "tensorboard", "no_progress", "no_plots")
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


def resumed(config: TrainConfig, given: frozenset[str], saved: dict, resume_path: str,
            built: dict | None = None) -> TrainConfig:
    """A resumed run's config: the checkpoint's, except the options given now (and --resume) and
    ONE_COMMAND's (as given now, or their defaults); its --out is the caller's to set (the folder it
    resumes in). An option in FIXED_ON_RESUME given with another value than the run's (for a model
    option the run left unset, the value its model was `built` with: the checkpoint's config) is
    refused by name."""
    own = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in ONE_COMMAND}
    base = TrainConfig.from_dict({**saved, **own, "overwrite": False, "resume": config.resume})
    changed = fixed_changes(config, given, base, built)
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


def fixed_changes(config: TrainConfig, given: frozenset[str], run: TrainConfig, built: dict | None = None) -> list[str]:
    """The options of FIXED_ON_RESUME (and FIXED_FOR_A_DECODED_BEST, for a run whose best metric is a
    decoding one; --data, for a run of a named dataset) given in `config` with another value than `run`'s,
    each as "--flag NEW (the run has OLD)". A model option the run left unset (its preset's value) has the
    value of the model `built` (a ModelConfig's dict; `--dropout 0.1` was refused, "the run has unset")."""
    fixed = FIXED_ON_RESUME + (FIXED_FOR_A_DECODED_BEST if run.best_metric not in TEACHER_FORCED else ()) + (
        ("data",) if run.data is None else ())  # a run's folder may move; a run without one gets none
    had = {k: getattr(run, k) for k in fixed}
    for k, value in _built_options(built or {}).items():
        if had.get(k, 0) is None and value is not None:
            had[k] = value
    return [f"{flag(k)} {shown(getattr(config, k))} (the run has {shown(had[k])}"
            f"{f'; its best {run.best_metric} depends on it' * (k in FIXED_FOR_A_DECODED_BEST)})"
            for k in fixed if k in given and getattr(config, k) != had[k]]


def _built_options(built: dict) -> dict:
    """The model options a ModelConfig's dict (`built`) was made with, by option name (--layers: its
    encoder's and decoder's count when they are one, an encoder-only model's alone)."""
    options = {k: built[key] for k, key in MODEL_FIELDS.items() if key in built}
    enc, dec = built.get("n_encoder_layers"), built.get("n_decoder_layers")
    options.update(encoder_layers=enc, decoder_layers=dec, layers=enc if dec in (0, enc) else None)
    return options


def load_resume_checkpoint(folder: Path, resume: str) -> tuple[Path, dict, str | None]:
    """(the checkpoint --resume continues, its contents, a warning or None). When last.pt, or the
    best.pt of a folder without one, is unreadable (truncated, corrupt), or older than a step_*.pt
    beside it (a save cut between the two: the step file is written first; a run killed before its
    first last.pt), the newest intact step_*.pt of its folder stands in, with a warning naming both.
    A checkpoint named on the command line that is unreadable is refused (CheckpointError), and so
    is continuing in place from a named one older than a step checkpoint of its folder
    (RunFolderError): the two histories would mix, and pruning keep the other's newer files."""
    try:
        path = find_checkpoint(folder if resume == "last" else resume, prefer="last")
    except CheckpointError:  # none: a run training there now (`holder` probes its lock) has saved none yet
        if (pid := holder(folder / LOCK)) is not None:
            raise RunFolderError(IN_USE.format(folder, pid)) from None
        raise
    # a checkpoint the user named, taken as it is (else the newest state of the folder is wanted)
    pinned = path.name != "last.pt" and resume != "last" and Path(resume).is_file()
    try:
        ckpt, error = load_checkpoint(path, require=RESUME_KEYS), None
    except CheckpointError as e:
        if pinned:
            raise
        ckpt, error = None, e
    later = step_checkpoints(path.parent, after=ckpt["progress"]["step"] if ckpt else None)
    if ckpt is not None and (not later or (pinned and resumes_elsewhere(folder, path))):
        return path, ckpt, None
    if ckpt is not None and pinned:
        raise RunFolderError(f"--resume {path} goes back to step {ckpt['progress']['step']} of the run in "
                             f"{path.parent}, which went on to {', '.join(p.name for p in later)}; continuing there "
                             f"would mix the two histories: resume into a new folder with --out (the run in "
                             f"{path.parent} is left as it is)")
    why = f"is unreadable ({error})" if ckpt is None else (
        f"is at step {ckpt['progress']['step']}, before {later[-1].name}"
        + (" (a save cut between the two)" if path.name == "last.pt" else ""))
    for step in reversed(later):
        try:
            found = load_checkpoint(step, require=RESUME_KEYS)
        except CheckpointError:
            continue
        return step, found, f"warning: {path} {why}; resuming from {step}, the newest intact step checkpoint"
    if ckpt is not None:  # the later step files are unreadable: last.pt is the newest intact state
        return path, ckpt, None
    raise CheckpointError(f"{error}; no intact step_*.pt in {path.parent} to resume from instead")
