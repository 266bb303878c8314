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
import typing
from dataclasses import dataclass, field

from .. import data as D
from ..model import PRESETS

KERNELS = ("auto", "eager", "torch", "triton")
GROUPS = ("data", "tokenizer", "model", "optimisation", "evaluation, early stopping, checkpoints, logging")


def option(default=None, help=None, *, group: str, by_data: dict | None = None, cli: bool = True, **argparse_kw):
    """A TrainConfig field: its default, its --help line, its flag group, argparse extras
    (choices, nargs, metavar, const) and the data-dependent defaults (see the module docstring)."""
    assert group in GROUPS, group
    meta = dict(help=help, group=group, by_data=by_data or {}, cli=cli, argparse=argparse_kw)
    return field(default=default, metadata=meta)


def _data(**kw):
    return option(group="data", **kw)


def _tok(**kw):
    return option(group="tokenizer", **kw)


def _model(**kw):
    return option(group="model", **kw)


def _optim(**kw):
    return option(group="optimisation", **kw)


def _run(**kw):
    return option(group=GROUPS[-1], **kw)


@dataclass
class TrainConfig:
    # data
    task: str | None = _data(help="task (default: from the dataset)", choices=D.TASKS)
    dataset: str = _data(default="synthetic", help="'synthetic' (embedded, no download), a name of a local folder "
                         "under $SCRATCHFORMER_DATA, ./data or ../shared/data, or a hub dataset: "
                         + ", ".join(sorted(D.HUB)))
    data: str | None = _data(help="local folder of {train,validation,test}.{jsonl,jsonl.gz,tsv,parquet}", metavar="DIR")
    max_train_examples: int | None = _data(help="use only the first N training examples")
    max_valid_examples: int | None = _data(help="use only the first N validation examples")
    valid_fraction: float = _data(default=0.05, help="when the data has no validation split (IMDb), carve this "
                                  "seeded fraction of train")
    max_src_len: int | None = _data(help="source tokens kept (first N-1 + EOS)", by_data=dict(
        synthetic=32, translation=128, summarization=512, classification=256))
    max_tgt_len: int | None = _data(help="target tokens kept (first N-1, then EOS)", by_data=dict(
        synthetic=32, translation=128, summarization=128, classification=2))
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

    # model (None: the preset's value)
    preset: str | None = _model(help="model preset", choices=sorted(PRESETS), by_data=dict(
        synthetic="tiny", real="small", classification="classifier"))
    kernel: str = _model(default="auto", help="backend of the hot paths: auto = triton on CUDA, eager on CPU",
                         choices=KERNELS)
    d_model: int | None = _model(by_data=dict(synthetic=64))
    heads: int | None = _model(help="attention heads", by_data=dict(synthetic=4))
    layers: int | None = _model(help="encoder and decoder layers (both)", by_data=dict(synthetic=2))
    encoder_layers: int | None = _model()
    decoder_layers: int | None = _model()
    d_ff: int | None = _model(by_data=dict(synthetic=256))
    dropout: float | None = _model(by_data=dict(synthetic=0.1))
    attn_dropout: float | None = _model()
    activation: str | None = _model(choices=("relu", "gelu"))
    norm: str | None = _model(help="residual LayerNorm placement", choices=("post", "pre"))
    final_norm: bool | None = _model(help="LayerNorm after the last encoder/decoder layer")
    tie_embeddings: str | None = _model(choices=("none", "decoder", "all"))
    no_pos_encoding: bool = _model(default=False, help="ablation: no positional encoding")

    # optimisation
    epochs: int | None = _optim(help="passes over the training data (None: by --max-steps)", by_data=dict(real=10))
    max_steps: int | None = _optim(help="stop after N optimizer steps", by_data=dict(synthetic=1500))
    batch_size: int | None = _optim(help="max sentences per batch", by_data=dict(synthetic=64))
    max_tokens: int | None = _optim(help="max padded tokens per batch (length-bucketed)", by_data=dict(
        real=4096, classification=16384))
    grad_accum: int = _optim(default=1, help="batches accumulated per optimizer step")
    lr: float | None = _optim(help="peak learning rate", by_data=dict(synthetic=2e-3, real=5e-4, classification=1e-3))
    schedule: str = _optim(default="inverse_sqrt", help="inverse_sqrt = Noam (linear warmup, then "
                           "lr*sqrt(warmup/step)); plateau halves the lr when the validation metric stalls",
                           choices=("inverse_sqrt", "cosine", "plateau", "constant"))
    warmup_steps: int | None = _optim(by_data=dict(synthetic=100, real=1000, classification=200))
    min_lr: float = _optim(default=0.0, help="floor of the cosine schedule")
    plateau_patience: int = _optim(default=2, help="evaluations without gain before halving")
    weight_decay: float = _optim(default=0.01, help="AdamW decay (matrices only)")
    adam_betas: tuple[float, float] = _optim(default=(0.9, 0.98), nargs=2)
    adam_eps: float = _optim(default=1e-9)
    label_smoothing: float = _optim(default=0.1)
    clip_norm: float = _optim(default=1.0, help="gradient clipping norm (0: off)")
    compile: str | None = _optim(help="torch.compile the training step's model (dynamic shapes; backend: inductor "
                                 "when given alone, aot_eager traces without code generation)", nargs="?",
                                 const="inductor", metavar="BACKEND")
    precision: str = _optim(default="auto", help="autocast dtype; auto = bf16 on GPUs that support it, fp32 on CPU",
                            choices=("auto", "fp32", "bf16", "fp16"))
    seed: int = _optim(default=0)

    # evaluation, early stopping, checkpoints, logging
    eval_every: int | None = _run(help="validate every N steps (0: at the end of each epoch)", by_data=dict(
        synthetic=500, real=0))
    eval_decode_examples: int | None = _run(help="decode this many validation examples at each validation "
                                            "(BLEU etc.; 0: loss only)", by_data=dict(
                                                synthetic=300, real=500, classification=0))
    best_metric: str | None = _run(help="metric for best.pt, early stopping and plateau: loss, bleu, chrf, "
                                   "exact_match, rougeL, accuracy, ...", by_data=dict(
                                       synthetic="loss", real="loss", classification="accuracy"))
    patience: int = _run(default=0, help="early stopping: evaluations without gain (0: off)")
    beam_size: int = _run(default=4, help="beam size of the final evaluation (1: greedy only)")
    save_every: int = _run(default=0, help="write step_N.pt and last.pt every N steps (0: at validations)")
    keep_checkpoints: int = _run(default=3, help="step checkpoints kept")
    resume: str | None = _run(help="continue from a checkpoint (default: OUT/last.pt), with its arguments",
                              nargs="?", const="last", metavar="CKPT")
    out: str | None = _run(help="run folder (default: a new runs/<date>-<time>, linked as runs/latest); one that "
                           "already holds a run is refused unless --resume or --overwrite")
    overwrite: bool = _run(default=False, help="replace the run already in --out (its checkpoints, logs, plots are "
                           "deleted first)")
    device: str | None = _run(help="cpu, cuda, cuda:1 ... (default: cuda if available, torchrun: cuda:LOCAL_RANK)")
    log_every: int = _run(default=100, help="log a train row every N steps")
    no_progress: bool = _run(default=False, help="no progress bar")
    tensorboard: bool = _run(default=False, help="also log to TensorBoard (needs tensorboard)")
    attention_example: int = _run(default=0, help="validation example drawn in plots/attention.png")
    no_plots: bool = _run(default=False)
    resume_path: str | None = _run(help="the checkpoint a resumed run continued from", cli=False)

    def __post_init__(self):
        self.adam_betas = tuple(self.adam_betas)  # JSON gives a list back

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
        or the task's, or real data's default. Values already set (given flags) stay."""
        fill = {}
        for f in dataclasses.fields(self):
            by = f.metadata["by_data"]
            if getattr(self, f.name) is None and by:
                fill[f.name] = by.get("synthetic") if synthetic else by.get(task, by.get("real"))
        return dataclasses.replace(self, **fill)


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
        "classifier. With no arguments: the embedded synthetic task (English number words -> German, "
        "reversed) on CPU, in a few minutes.",
        epilog="Ablation grids: python -m scratchformer.ablate --help (or: python -m scratchformer.train ablate ...). "
        "Evaluate: python -m scratchformer.evaluate; generate: python -m scratchformer.generate.",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.metadata["cli"]:
            _add_flag(groups[f.metadata["group"]], f, hints[f.name])
    return p


def parse_args(argv=None) -> tuple[TrainConfig, frozenset[str]]:
    """(the config, the names of the options given on the command line). With --resume the
    checkpoint's config is the base and only the given options override it."""
    given = vars(build_parser().parse_args(argv))
    return TrainConfig(**given), frozenset(given)


def resumed(config: TrainConfig, given: frozenset[str], saved: dict, resume_path: str) -> TrainConfig:
    """A resumed run's config: the checkpoint's, except the options given now (and --resume/--out)."""
    base = TrainConfig.from_dict(saved)
    now = {k: getattr(config, k) for k in given | {"resume", "out"}}
    return dataclasses.replace(base, **now, resume_path=resume_path)
