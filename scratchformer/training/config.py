"""TrainConfig: every training option, its default and its help, in one place.

The command line is generated from the fields (`build_parser`), `args.json` and the checkpoint's
``args`` are `TrainConfig.to_dict()`, and both load back with ``TrainConfig(**json.load(f))``.

Options whose default depends on the data say so in ``by_data``: a value for the synthetic
smoke task, for real data, and per task (a task's value wins over "real"). They stay None
until `resolved(task, synthetic)` fills them, once, when the data is known; an option given on
the command line always wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field

from .. import data as D
from ..cli import add_debug_flag
from ..compile import check_backend
from ..data.tokenizer import MIN_VOCAB
from ..model import PRESETS

KERNELS = ("auto", "eager", "torch", "triton")
# torch.compile(mode=...); "none" (as for --compile) turns off what a resumed run's checkpoint has on
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "none")
# What validation computes, per task: the names --best-metric may take. Decoding metrics (all but
# loss, ppl, accuracy) need --eval-decode-examples > 0.
METRICS = {
    "translation": ("loss", "ppl", "bleu", "chrf", "exact_match"),
    "summarization": ("loss", "ppl", "bleu", "chrf", "exact_match", "rouge1", "rouge2", "rougeL", "rougeLsum"),
    "classification": ("loss", "ppl", "accuracy"),
}
METRICS["extractive"] = METRICS["summarization"]  # loss and ppl: of the sentences' binary cross-entropy
TEACHER_FORCED = ("loss", "ppl", "accuracy")
# The model options set as the ModelConfig field of the same value (option -> field); unset (None): the preset's.
MODEL_FIELDS = dict(d_model="d_model", heads="n_heads", d_ff="d_ff", dropout="dropout", attn_dropout="attn_dropout",
                    ffn_dropout="ffn_dropout", word_dropout="word_dropout", activation="activation", norm="norm",
                    final_norm="final_norm", tie_embeddings="tie_embeddings")


class ConfigError(ValueError):
    """A training option (or a combination of options) that cannot work; the message names the flag."""


GROUPS = ("data", "tokenizer", "model", "optimisation", "evaluation, early stopping, checkpoints, logging")


def option(default=None, help=None, *, group: str, by_data: dict | None = None, cli: bool = True, **argparse_kw):
    """A TrainConfig field: its default, its --help line, its flag group, argparse extras
    (choices, nargs, metavar, const) and the data-dependent defaults (see the module docstring)."""
    assert group in GROUPS, group
    meta = dict(help=help, group=group, by_data=by_data or {}, cli=cli, argparse=argparse_kw)
    return field(default=default, metadata=meta)


# The fields of each group, in GROUPS order.
_data, _tok, _model, _optim, _run = (functools.partial(option, group=group) for group in GROUPS)


@dataclass
class TrainConfig:
    # data
    task: str | None = _data(help="task (default: from the dataset)", choices=D.TASKS)
    dataset: str = _data(default="synthetic", help="'synthetic' (embedded, no download), a name of a local folder "
                         "under $SCRATCHFORMER_DATA, ./data or ../shared/data, or a hub dataset: "
                         + ", ".join(sorted(D.HUB)))
    data: str | None = _data(help="local folder of train, validation, test files: .jsonl, .jsonl.gz, .jsonl.xz, "
                             ".tsv or .parquet", metavar="DIR")
    max_train_examples: int | None = _data(help="use only the first N training examples")
    max_valid_examples: int | None = _data(help="use only the first N validation examples")
    valid_fraction: float = _data(default=0.05, help="when the data has no validation split (IMDb), carve this "
                                  "seeded fraction of train")
    max_src_len: int | None = _data(help="source tokens kept (seq2seq: the first N-1 + EOS; a classifier: the "
                                    "first N; extractive: the marked sentences within N)", by_data=dict(
        synthetic=32, translation=128, summarization=512, classification=256, extractive=512))
    max_tgt_len: int | None = _data(help="target tokens kept (first N-1, then EOS)", by_data=dict(
        synthetic=32, translation=128, summarization=128, classification=2, extractive=2))
    synthetic_seed: int = _data(default=1234, help="seed of the synthetic corpus")
    num_workers: int = _data(default=0, help="DataLoader worker processes")
    # A model this small gains nothing from intra-op threads, and loses a lot on a busy CPU.
    threads: int | None = _data(help="torch intra-op CPU threads (None: torch's)", by_data=dict(synthetic=1))

    # tokenizer
    vocab_size: int | None = _tok(help="BPE vocabulary size", by_data=dict(synthetic=400, real=8000))
    separate_vocab: bool = _tok(default=False, help="separate source and target BPE vocabularies")
    tokenizer: list[str] | None = _tok(help="reuse tokenizer JSON file(s): one (shared) or two (source, target)",
                                       nargs="+", metavar="FILE")
    tokenizer_examples: int | None = _tok(help="train BPE on at most N training examples")
    bpe_dropout: float = _tok(default=0.0, help="BPE-dropout rate (0.1 in Provilkov et al. 2020): the training texts "
                              "segmented anew each epoch, each merge dropped with this probability")

    # model (None: the preset's value)
    preset: str | None = _model(help="model preset", choices=sorted(PRESETS), by_data=dict(
        synthetic="tiny", real="small", classification="classifier"))
    kernel: str = _model(default="auto", help="backend of the hot paths: auto = triton on CUDA (torch for a head "
                         "dim triton does not run), eager on CPU", choices=KERNELS)
    d_model: int | None = _model(help="model width (unset model options: the preset's)", by_data=dict(synthetic=64))
    heads: int | None = _model(help="attention heads", by_data=dict(synthetic=4))
    layers: int | None = _model(help="encoder and decoder layers (both)", by_data=dict(synthetic=2))
    encoder_layers: int | None = _model(help="encoder layers (over --layers)")
    decoder_layers: int | None = _model(help="decoder layers (over --layers)")
    d_ff: int | None = _model(help="FFN inner width", by_data=dict(synthetic=256))
    dropout: float | None = _model(help="dropout on embeddings and sublayer outputs (0.1 otherwise)",
                                  by_data=dict(synthetic=0.1))
    attn_dropout: float | None = _model(help="dropout on the attention probabilities")
    ffn_dropout: float | None = _model(help="dropout between the FFN's two projections (fairseq's activation dropout)")
    word_dropout: float | None = _model(help="word dropout: in training, each input token (source and decoder input; "
                                        "not a special one) replaced by <unk> with this probability (0.1-0.3 in "
                                        "Sennrich and Zhang 2019's low-resource NMT)")
    activation: str | None = _model(help="FFN activation (relu otherwise)", choices=("relu", "gelu"))
    norm: str | None = _model(help="residual LayerNorm placement", choices=("post", "pre"))
    final_norm: bool | None = _model(help="LayerNorm after the last encoder/decoder layer")
    tie_embeddings: str | None = _model(help="one matrix for: decoder = the target embedding and the output "
                                        "projection; all = those and the source embedding (one vocabulary); "
                                        "none otherwise",
                                        choices=("none", "decoder", "all"))
    no_pos_encoding: bool = _model(default=False, help="ablation: no positional encoding")
    copy: bool = _model(default=False, help="pointer-generator output layer: copy source tokens (See et al. 2017; "
                        "for summarization from scratch); needs a shared vocabulary")

    # optimisation
    epochs: int | None = _optim(help="passes over the training data (none when --max-steps is given alone: the "
                                "steps then bound the run)", by_data=dict(real=10))
    max_steps: int | None = _optim(help="stop after N optimizer steps", by_data=dict(synthetic=1500))
    time_budget: float | None = _optim(help="end training, as at its last step (final validation, report), once "
                                       "the run has trained this many seconds over all its sessions: a run sized in "
                                       "time (a GPU window); a cosine schedule still decays over --max-steps")
    batch_size: int | None = _optim(help="max sentences per batch", by_data=dict(synthetic=64))
    max_tokens: int | None = _optim(help="max padded tokens per batch (length-bucketed)", by_data=dict(
        real=4096, classification=16384))
    pad_multiple: int = _optim(default=1, help="pad each training batch's lengths up to a multiple of N "
                               "(tensor-core shapes; fewer batch shapes to compile or capture)")
    grad_accum: int = _optim(default=1, help="batches accumulated per optimizer step")
    lr: float | None = _optim(help="peak learning rate", by_data=dict(synthetic=2e-3, real=5e-4, classification=1e-3))
    schedule: str = _optim(default="inverse_sqrt", help="inverse_sqrt = Noam (linear warmup, then "
                           "lr*sqrt(warmup/step)); plateau halves the lr when the validation metric stalls",
                           choices=("inverse_sqrt", "cosine", "plateau", "constant"))
    warmup_steps: int | None = _optim(help="linear warmup to --lr (plateau: none unless given)", by_data=dict(
        synthetic=100, real=1000, classification=200))
    min_lr: float = _optim(default=0.0, help="floor of the cosine schedule (--schedule cosine)")
    plateau_patience: int = _optim(default=2, help="evaluations without gain tolerated: the next halves the lr "
                                   "(--schedule plateau)")
    weight_decay: float = _optim(default=0.01, help="AdamW decay (matrices only)")
    adam_betas: tuple[float, float] = _optim(default=(0.9, 0.98), help="AdamW betas", nargs=2, metavar=("B1", "B2"))
    adam_eps: float = _optim(default=1e-9, help="AdamW epsilon")
    label_smoothing: float = _optim(default=0.1, help="mass spread off the gold token or class")
    rdrop: float = _optim(default=0.0, help="R-Drop (Liang et al. 2021): each batch runs twice, each copy under its "
                          "own dropout, and the loss adds ALPHA/2 times the two outputs' symmetric KL per target "
                          "(the paper's IWSLT setting: 5); twice a step's compute and activations (0: off)",
                          metavar="ALPHA")
    clip_norm: float = _optim(default=1.0, help="gradient clipping norm (0: off)")
    ema: float = _optim(default=0.0, help="validate, save and predict with an exponential moving average of the "
                        "weights, decay D after each step (0.999, 0.9999; warmed up: min(D, (1 + step) / (10 + step)); "
                        "0: off)", metavar="D")
    compile: str | None = _optim(help="torch.compile the training step's model (dynamic shapes; backend: inductor "
                                 "when given alone, aot_eager traces without code generation; none: off, as a "
                                 "resumed run's may be)", nargs="?", const="inductor", metavar="BACKEND")
    compile_mode: str | None = _optim(help="torch.compile mode with --compile (inductor): reduce-overhead replays "
                                      "each batch shape's compiled graphs as CUDA graphs (GPU)", choices=COMPILE_MODES)
    cuda_graphs: bool | None = _optim(default=False, help="replay each batch shape's training step as a CUDA graph "
                                      "(no compiler, no host work per kernel): one GPU, bf16 or fp32")
    recompute_activations: bool | None = _optim(default=False, help="activation checkpointing: keep only each "
                                                "encoder and decoder layer's inputs and recompute the rest in the "
                                                "backward (same gradients; less activation memory for one more "
                                                "forward of the layers)")
    precision: str = _optim(default="auto", help="autocast dtype; auto = bf16 on GPUs that support it, fp32 on CPU",
                            choices=("auto", "fp32", "bf16", "fp16"))
    seed: int = _optim(default=0, help="seed of initialisation, batching and dropout")

    # evaluation, early stopping, checkpoints, logging
    eval_every: int | None = _run(help="validate every N steps (0: at the end of each epoch)", by_data=dict(
        synthetic=500, real=0))
    eval_decode_examples: int | None = _run(help="decode this many validation examples at each validation "
                                            "(BLEU etc.; 0: loss only, the final report decoding all)", by_data=dict(
                                                synthetic=300, real=500, classification=0))
    best_metric: str | None = _run(help="metric for best.pt, early stopping and plateau: loss, bleu, chrf, "
                                   "exact_match, rougeL, accuracy, ...", by_data=dict(
                                       synthetic="loss", real="loss", classification="accuracy"))
    patience: int = _run(default=0, help="early stopping: evaluations without gain (0: off)")
    beam_size: int = _run(default=4, help="beam size of the final evaluation (1: greedy only)")
    summary_sentences: int | None = _run(help="--task extractive: validation's summaries (best.pt, the final report) "
                                         "take at most K of the best-scored sentences (default 3)", metavar="K")
    summary_words: int | None = _run(help="--task extractive: and stop once they hold W words (default: no budget)",
                                     metavar="W")
    save_every: int = _run(default=0, help="write step_N.pt and last.pt every N steps (0: at validations)")
    keep_checkpoints: int = _run(default=3, help="step checkpoints kept, the newest (0: all)")
    time_limit: float | None = _run(help="stop training once the run's setup (data, tokenizers, model) and "
                                    "training have taken this many seconds, saving last.pt (no final evaluation); "
                                    "--resume continues: a long run in chunks of bounded commands")
    init_from: str | None = _run(help="a new run from the weights, architecture and tokenizers of a checkpoint or "
                                 "run folder (best.pt): fine-tuning, a curriculum's next phase", metavar="CKPT")
    resume: str | None = _run(help="continue from a checkpoint or run folder (default: OUT/last.pt; without --out, "
                              "runs/latest's), with its arguments",
                              nargs="?", const="last", metavar="CKPT")
    out: str | None = _run(help="run folder (default: a new runs/<date>-<time>, linked as runs/latest); one that "
                           "already holds a run is refused unless --resume or --overwrite")
    overwrite: bool = _run(default=False, help="replace the run already in --out (its checkpoints, logs, plots are "
                           "deleted first)")
    device: str | None = _run(help="cpu, cuda, cuda:1 ... (default: cuda if available, torchrun: cuda:LOCAL_RANK)")
    log_every: int = _run(default=100, help="log a train row every N steps")
    no_progress: bool = _run(default=False, help="no progress bar (it is drawn only when stderr is a terminal)")
    tensorboard: bool = _run(default=False, help="also log to TensorBoard (needs tensorboard)")
    attention_example: int = _run(default=0, help="validation example drawn in plots/attention.png")
    no_plots: bool = _run(default=False, help="no plots/ (curves, attention)")
    resume_path: str | None = _run(help="the checkpoint a resumed run continued from", cli=False)

    def __post_init__(self):
        self.adam_betas = tuple(self.adam_betas)  # JSON gives a list back
        self.compile, self.compile_mode = (None if v == "none" else v for v in (self.compile, self.compile_mode))
        check_config(self)

    def to_dict(self) -> dict:
        """JSON-ready (tuples as lists): args.json and the checkpoint's "args"."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From args.json or a checkpoint, also one written by an older version: keys it lacks take
        today's defaults, keys this version no longer knows are dropped."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def resolved(self, task: str, synthetic: bool) -> TrainConfig:
        """The data-dependent defaults filled in: values still None take the synthetic task's,
        or the task's, or real data's default. Values already set (given flags) stay. A run with
        --tokenizer has the vocabulary of its files: no --vocab-size."""
        fill = {}
        for f in dataclasses.fields(self):
            by = f.metadata["by_data"]
            if getattr(self, f.name) is None and by and not (f.name == "vocab_size" and self.tokenizer):
                fill[f.name] = by.get("synthetic") if synthetic else by.get(task, by.get("real"))
        if self.schedule == "plateau" and self.warmup_steps is None:
            fill["warmup_steps"] = 0  # it has none: args.json says so
        if self.max_steps is not None and self.epochs is None:
            fill["epochs"] = None  # --max-steps given alone bounds the run (real data's 10 epochs cut it short)
        return dataclasses.replace(self, **fill)


# ---------------------------------------------------------------------------------------------
# Checks: every option before any work (data, tokenizer, run folder)
# ---------------------------------------------------------------------------------------------

# The smallest value an integer option may take (None, where allowed, means unset: never 0).
_AT_LEAST = dict(
    max_train_examples=1, max_valid_examples=1, max_src_len=2, max_tgt_len=2, num_workers=0, threads=1,
    vocab_size=MIN_VOCAB, tokenizer_examples=1, d_model=2, heads=1, layers=1, encoder_layers=0, decoder_layers=0,
    d_ff=1, epochs=1, max_steps=1, batch_size=1, max_tokens=1, grad_accum=1, warmup_steps=0, plateau_patience=0,
    eval_every=0, eval_decode_examples=0, patience=0, beam_size=1, save_every=0, keep_checkpoints=0, log_every=1,
    attention_example=0, pad_multiple=1, summary_sentences=1, summary_words=1, seed=0, synthetic_seed=0,
)
# Float options: (lowest, highest, whether the highest is allowed); all must be finite.
_RANGES = {
    **dict.fromkeys(("valid_fraction", "dropout", "attn_dropout", "ffn_dropout", "word_dropout", "label_smoothing",
                     "bpe_dropout", "ema"), (0.0, 1.0, False)),
    **dict.fromkeys(("lr", "min_lr", "weight_decay", "adam_eps", "clip_norm", "time_limit", "time_budget", "rdrop"),
                    (0.0, math.inf, False)),
}
_AT_MOST = dict(threads=1024)  # 100,000 threads: the tokenizers' thread pool panicked, then the process crashed
_POSITIVE = ("lr", "adam_eps", "valid_fraction", "time_limit", "time_budget")  # these may not be 0 either


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_config(cfg: TrainConfig) -> None:
    """Refuse options that cannot work, naming the flag (ConfigError). Runs whenever a TrainConfig
    is made (parse_args, args.json, resume), so before any data is read or folder written: each
    value, then the values together, a resume's once merged with the run's (`resume.resumed`: the
    command line alone lacks the run's options). The checks that need the task or the device: `launch`."""
    _check_values(cfg)
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues a run and --overwrite replaces it: give one")
    if not (cfg.resume and cfg.resume_path is None):
        _check_combinations(cfg)


def _check_values(cfg: TrainConfig) -> None:
    for name, lo in _AT_LEAST.items():
        v, hi = getattr(cfg, name), _AT_MOST.get(name, math.inf)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            raise ConfigError(f"{flag(name)} must be an integer >= {lo}{f' and <= {hi}' * (hi < math.inf)}, got {v!r}"
                              + (" (leave it out for no limit)" if name in ("max_steps", "max_train_examples",
                                                                            "max_valid_examples", "epochs") else ""))
    for name, (lo, hi, hi_ok) in _RANGES.items():
        v = getattr(cfg, name)
        if v is None:
            continue
        strict = name in _POSITIVE
        bad = not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo or (strict and v == lo)
        if bad or v > hi or (v == hi and not hi_ok):
            span = f"{'(' if strict else '['}{lo:g}, {hi:g}{']' if hi_ok else ')'}"
            raise ConfigError(f"{flag(name)} must be a finite number in {span}, got {v!r}")
    if len(cfg.adam_betas) != 2 or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in cfg.adam_betas):
        raise ConfigError(f"--adam-betas must be two numbers in [0, 1), got {list(cfg.adam_betas)}")
    for f in dataclasses.fields(cfg):
        choices, v = f.metadata["argparse"].get("choices"), getattr(cfg, f.name)
        if choices and v is not None and v not in choices:
            raise ConfigError(f"{flag(f.name)} {v!r} is not one of {', '.join(map(str, choices))}")
    if cfg.d_model is not None and cfg.d_model % 2:
        raise ConfigError(f"--d-model must be even (sinusoidal positions), got {cfg.d_model}")
    if cfg.tokenizer is not None and len(cfg.tokenizer) not in (1, 2):
        raise ConfigError(f"--tokenizer takes one file (shared) or two (source, target), got {len(cfg.tokenizer)}")
    if cfg.compile:
        check_backend(cfg.compile, ConfigError)


def _check_combinations(cfg: TrainConfig) -> None:
    if cfg.d_model is not None and cfg.heads is not None and cfg.d_model % cfg.heads:
        raise ConfigError(f"--d-model {cfg.d_model} is not divisible by --heads {cfg.heads}")
    if cfg.data is not None and cfg.dataset != "synthetic":
        raise ConfigError(f"--data {cfg.data} and --dataset {cfg.dataset} both name the data: give one")
    if cfg.compile_mode is not None and cfg.compile != "inductor":
        raise ConfigError(f"--compile-mode {cfg.compile_mode} is an inductor mode: it needs --compile (inductor), "
                          + (f"got --compile {cfg.compile}" if cfg.compile else "which is not given")
                          + " (--compile-mode none: none)")
    if cfg.max_tokens is not None and cfg.pad_multiple > cfg.max_tokens:  # every batch one example, over the budget
        raise ConfigError(f"--pad-multiple {cfg.pad_multiple} pads every batch past --max-tokens {cfg.max_tokens}")
    if cfg.cuda_graphs and cfg.compile:
        raise ConfigError(f"--cuda-graphs captures the uncompiled step; --compile {cfg.compile} compiles it: give one "
                          "(--compile none: not compiled)")
    if cfg.cuda_graphs and cfg.recompute_activations:
        raise ConfigError("--recompute-activations sets the RNG state back for each layer's recomputation, which a "
                          "CUDA graph capture may refuse (not yet checked on a GPU): give one of it and --cuda-graphs")
    if cfg.rdrop and cfg.dropout == 0 and not cfg.attn_dropout and not cfg.ffn_dropout and not cfg.word_dropout:
        raise ConfigError(f"--rdrop {cfg.rdrop:g} compares two dropout masks; with --dropout 0 (and no attention, "
                          f"FFN or word dropout) both copies are the same")
    if cfg.min_lr is not None and cfg.lr is not None and cfg.min_lr > cfg.lr:
        raise ConfigError(f"--min-lr {cfg.min_lr:g} is the floor the schedule decays to from --lr {cfg.lr:g}: it "
                          f"cannot be above it")
    separate = ("--separate-vocab" if cfg.separate_vocab else
                "the second --tokenizer" if cfg.tokenizer is not None and len(cfg.tokenizer) == 2 else None)
    for needs, why in ((cfg.copy, "--copy copies source tokens into the target"),
                       (cfg.tie_embeddings == "all", "--tie-embeddings all gives a source token and the target token "
                                                     "of the same id one embedding")):
        if needs and separate:  # (equal sizes of two vocabularies made a model that mixed their tokens up)
            raise ConfigError(f"{why}: it needs one shared vocabulary (drop {separate})")


# ---------------------------------------------------------------------------------------------
# The command line, generated from the fields
# ---------------------------------------------------------------------------------------------


def _default_text(f: dataclasses.Field) -> str:
    by = f.metadata["by_data"]
    if by:
        return " (default: " + ", ".join(f"{v} {k}" + (" data" if k == "real" else "") for k, v in by.items()) + ")"
    if f.default is None or f.default is False:
        return ""
    shown = " ".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
    return f" (default: {shown})"


def _add_flag(group, f: dataclasses.Field, hint) -> None:
    kw = dict(f.metadata["argparse"], default=argparse.SUPPRESS)  # given flags only: defaults come from the class
    help_ = ((f.metadata["help"] or "") + _default_text(f)).strip()
    kw["help"] = help_.replace("%", "%%") or None
    if hint is bool:
        kw["action"] = "store_true"
    elif hint == bool | None:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        scalar = typing.get_args(args[0])[0] if typing.get_origin(args[0]) in (list, tuple) else args[0]
        if scalar is not str:
            kw["type"] = scalar
    group.add_argument("--" + f.name.replace("_", "-"), **kw)


def build_parser() -> argparse.ArgumentParser:
    """The train command line: one flag per TrainConfig field, in field order, grouped."""
    p = argparse.ArgumentParser(
        prog="python -m scratchformer.train",
        description="Train an encoder-decoder Transformer (translation, summarization) or an encoder-only "
        "classifier or extractive summarizer (--task extractive). With no arguments: the embedded synthetic task "
        "(English number words -> German, reversed) on CPU, in about a minute.",
        epilog="Ablation grids: python -m scratchformer.ablate --help (or: python -m scratchformer.train ablate ...). "
        "Evaluate: python -m scratchformer.evaluate; generate: python -m scratchformer.generate.",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["cli"]:
            _add_flag(groups[f.metadata["group"]], f, hints[f.name])
    add_debug_flag(p)  # taken off by cli.run before parsing; listed for --help
    return p


def parse_args(argv=None) -> tuple[TrainConfig, frozenset[str]]:
    """(the config, the names of the options given on the command line). With --resume the
    checkpoint's config is the base and only the given options override it."""
    given = vars(build_parser().parse_args(argv))
    given.pop("debug")
    return TrainConfig(**given), frozenset(given)
