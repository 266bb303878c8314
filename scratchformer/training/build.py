"""A run's parts from its TrainConfig: the data, the tokenizers, the model (new, or from a checkpoint)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

from .. import data as D
from ..data.tokenizer import BPETokenizer, TokenizerPair
from ..model import PRESETS, ModelConfig, get_config
from .config import MODEL_FIELDS, ConfigError, TrainConfig, flag
from .distributed import Dist
from .runs import Logger


@dataclass
class TrainData:
    """The examples and their encodings, and what the model needs to know of them."""

    source: D.DataSource
    train_examples: list[D.Example]
    valid_examples: list[D.Example]
    tokenizers: TokenizerPair
    train_set: D.EncodedDataset
    valid_set: D.EncodedDataset
    num_classes: int | None  # classification only

    @property
    def task(self) -> str:
        return self.source.task

    @cached_property
    def train_id(self) -> dict:
        """What a checkpoint records of its training examples, for a resume to check: `examples_id`."""
        return examples_id(self.train_examples)

    @cached_property
    def valid_id(self) -> dict:
        """And of its validation examples, which its best metric is measured on."""
        return examples_id(self.valid_examples)


def examples_id(examples: list[D.Example]) -> dict:
    """Their number and a digest of their contents, in order: a resumed run's place in its epoch
    counts batches of its training examples, which another set would draw differently, and its best
    metric is measured on its validation examples."""
    h = hashlib.blake2b(digest_size=16)
    for e in examples:
        h.update(repr((e.src, e.tgt, e.id)).encode())
    return {"examples": len(examples), "digest": h.hexdigest()}


def check_data_options(source: D.DataSource, given: frozenset[str]) -> None:
    """--synthetic-seed for data that is not the synthetic task, --valid-fraction for data with a validation
    split of its own (a hub dataset's is known only when asked for): refused, they would do nothing."""
    if "synthetic_seed" in given and source.kind != "synthetic":
        raise ConfigError(f"--synthetic-seed draws the synthetic task's corpus; this run reads {source.name}: drop it")
    if "valid_fraction" in given and source.kind != "hub" and D.has_split(source, "validation"):
        raise ConfigError(f"--valid-fraction carves validation examples from train for data that has none; "
                          f"{source.name} has a validation split of its own: drop it")


def load_data(cfg: TrainConfig, source: D.DataSource, log: Logger) -> tuple[list[D.Example], list[D.Example]]:
    """Train and validation examples (validation carved from train when the data has none)."""
    seed_kw = dict(synthetic_seed=cfg.synthetic_seed)
    if source.folder:  # the file of each split (train.jsonl, or train.jsonl.gz, ...)
        files = (D.find_split_file(Path(source.folder), split) for split in ("train", "validation"))
        log.info(f"{source.name}: reading {', '.join(str(f) for f in files if f is not None)}")
    train = D.load_split(source, "train", cfg.max_train_examples, **seed_kw)
    valid = _own_validation(source, cfg.max_valid_examples, **seed_kw)
    if valid is None:
        train, valid = D.carve_validation(train, cfg.valid_fraction, cfg.seed, _split_file(source, "train"))
        log.info(f"{source.name} has no validation split: carved {len(valid)} examples "
                 f"({cfg.valid_fraction:.0%}, seed {cfg.seed}) from train")
        valid = valid[: cfg.max_valid_examples]
    return train, valid


def _own_validation(source: D.DataSource, limit: int | None, **kw) -> list[D.Example] | None:
    """The data's own validation split; None when it has none (a hub dataset says so when asked for it)."""
    if not D.has_split(source, "validation"):
        return None
    try:
        return D.load_split(source, "validation", limit, **kw)
    except D.DataError:
        if source.kind != "hub":
            raise
        return None


def run_split(source: D.DataSource, split: str, cfg: TrainConfig, limit: int | None = None,
              members: tuple[TrainConfig, ...] = ()) -> list[D.Example]:
    """The examples of `split` as the run saw them: the synthetic corpus of its seed, and a
    validation split carved from train (IMDb, local or on the hub) carved the same way again.
    `members`: an ensemble's other runs, which must have seen those examples too (a DataError
    names what differs): carved with another seed, one member's validation is another's training."""
    if source.kind == "synthetic":
        _same_split(split, cfg, members, ("synthetic_seed",), "draws its synthetic corpus")
        return D.load_split(source, split, limit, synthetic_seed=cfg.synthetic_seed)
    if split == "validation" and cfg.valid_fraction:
        own = _own_validation(source, limit)
        if own is not None:
            return own
        _same_split(split, cfg, members, ("valid_fraction", "seed", "max_train_examples"),
                    "carves its validation examples from train")
        train = D.load_split(source, "train", cfg.max_train_examples)
        return D.carve_validation(train, cfg.valid_fraction, cfg.seed, _split_file(source, "train"))[1][:limit]
    return D.load_split(source, split, limit)


def _same_split(split: str, cfg: TrainConfig, members: tuple[TrainConfig, ...], fields: tuple[str, ...],
                what: str) -> None:
    for other in members:
        differ = [f"{flag(f)} {getattr(cfg, f)} and {getattr(other, f)}" for f in fields
                  if getattr(other, f) != getattr(cfg, f)]
        if differ:
            raise D.DataError(f"the ensemble's models saw different {split} examples: each run {what} by its own "
                              f"{', '.join(differ)}, so one's {split} examples are another's training: score each "
                              f"model alone, or the ensemble on a split of the data's own")


def make_tokenizers(cfg: TrainConfig, task: str, train: list[D.Example], out: Path, dist_: Dist,
                    log: Logger) -> TokenizerPair:
    """Trained by rank 0 on the training examples and saved into the run folder, then read from its
    files by the other ranks (what rank 0 raised, a full disk say, each rank raises: `Dist.on_main`).
    A run's reused (--tokenizer) or resumed tokenizers are `build_data`'s `tokenizers` instead."""
    trained = None

    def on_rank_0() -> list[Path]:
        nonlocal trained
        trained = _train_tokenizers(cfg, task, train, log)
        return trained.save(out)
    paths = dist_.on_main(on_rank_0)  # the files rank 0 wrote: one (a shared vocabulary) or two
    return trained if dist_.main else TokenizerPair.load(paths)


def _train_tokenizers(cfg: TrainConfig, task: str, train: list[D.Example], log: Logger) -> TokenizerPair:
    texts = train[: cfg.tokenizer_examples] if cfg.tokenizer_examples else train
    t0 = time.time()
    if cfg.separate_vocab and task not in D.ENCODER_ONLY:
        toks = TokenizerPair(BPETokenizer.train(D.texts_for_tokenizer(texts, "src"), cfg.vocab_size),
                             BPETokenizer.train(D.texts_for_tokenizer(texts, "tgt"), cfg.vocab_size))
    else:
        side = "src" if task in D.ENCODER_ONLY else "both"
        toks = TokenizerPair(BPETokenizer.train(D.texts_for_tokenizer(texts, side), cfg.vocab_size))
    log.info(f"tokenizer: trained byte-level BPE on {len(texts)} examples in {time.time() - t0:.1f}s "
             f"(vocab {toks.src.vocab_size}{'' if toks.shared else f' / {toks.tgt.vocab_size}'}, "
             f"{'shared' if toks.shared else 'separate'})")
    return toks


class Examples(NamedTuple):
    """A run's examples as `load_examples` reads them, before the run folder is made or cleared."""

    train: list[D.Example]
    valid: list[D.Example]
    num_classes: int | None  # a classifier's, every label checked
    notes: list[str]  # the lines to log about them


def load_examples(cfg: TrainConfig, source: D.DataSource, given: frozenset[str] = frozenset()) -> Examples:
    """The examples of both splits and the classifier's class count: what a data error stops, read
    before the run folder is made or cleared; the data options `given` that would do nothing refused first."""
    check_data_options(source, given)
    notes: list[str] = []
    train_ex, valid_ex = load_data(cfg, source, SimpleNamespace(info=notes.append))
    num_classes = class_count(source, train_ex, valid_ex) if source.task == "classification" else None
    return Examples(train_ex, valid_ex, num_classes, notes)


def build_data(cfg: TrainConfig, source: D.DataSource, out: Path, dist_: Dist, log: Logger,
               tokenizers: TokenizerPair | None = None, examples: Examples | None = None) -> TrainData:
    """Examples (`load_examples`, unless given), tokenizers (given: --tokenizer's, a resumed or
    --init-from run's; else made: `make_tokenizers`) and encodings of both splits."""
    task = source.task
    train_ex, valid_ex, num_classes, notes = load_examples(cfg, source) if examples is None else examples
    for note in notes:
        log.info(note)
    toks = make_tokenizers(cfg, task, train_ex, out, dist_, log) if tokenizers is None else tokenizers
    if cfg.bpe_dropout:
        t0 = time.time()
        train_set = D.ResegmentedDataset(train_ex, task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len,
                                         p=cfg.bpe_dropout, seed=cfg.seed)
        st = train_set.truncation(0)
        log.info(f"BPE-dropout {cfg.bpe_dropout:g}: {D.SAMPLES_PER_WORD} segmentations of each of "
                 f"{train_set.distinct_words()} distinct training words drawn in {time.time() - t0:.1f}s; each "
                 f"epoch, each occurrence takes one of its word's (first epoch: "
                 f"{int(train_set.src.lengths().sum())} source tokens)")
    else:
        train_set, st = D.encode_examples(train_ex, task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len)
    policy = {"extractive": "sentences in order, each led by a marker, while they fit in max_src_len tokens",
              "classification": "keep the first max_src_len tokens (the model adds its [CLS])"}.get(
        task, "keep the first max_src_len-1 source tokens + EOS, the first max_tgt_len-1 target tokens")
    log.info(f"train: {st} (policy: {policy})")
    valid_set, sv = D.encode_examples(valid_ex, task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len)
    log.info(f"valid: {sv}")
    return TrainData(source, train_ex, valid_ex, toks, train_set, valid_set, num_classes)


def class_count(source: D.DataSource, train: list[D.Example], valid: list[D.Example]) -> int:
    """The classifier's number of classes, every label checked first (a DataError naming the file,
    the example and the label): against the source's label set (meta.json's, a hub dataset's) when
    it has one, else against the observed training labels, which must fill at least half of 0..max
    (so one stray label of 100,000,000 is refused, not made into a 100M-class head)."""
    names = source.labels
    if names:
        where = Path(source.folder) / "meta.json" if source.folder else f"hub dataset {source.name}"
        allowed, rule = set(names), f"the labels of {where} are {', '.join(map(str, sorted(names)))}"
    else:
        seen = {e.tgt for e in train if isinstance(e.tgt, int) and e.tgt >= 0}
        allowed = set(range(max(2, 2 * len(seen))))
        rule = (f"without a label list in meta.json the labels must be 0..N-1 with at least half of them in the "
                f"training data ({len(seen)} distinct seen, so at most {max(allowed)})")
    for split, examples in (("train", train), ("validation", valid)):
        for i, e in enumerate(examples):
            if e.tgt not in allowed or isinstance(e.tgt, bool):
                shown = f" (id {e.id})" if e.id is not None else ""
                raise D.DataError(f"{_split_file(source, split)}, example {i + 1}{shown}: label {e.tgt!r} is not a "
                                  f"known class: {rule}")
    return max(2, max(names) + 1 if names else max(e.tgt for e in train + valid) + 1)


def _split_file(source: D.DataSource, split: str) -> str:
    """Where a split's examples came from, for messages (a carved validation split: the train file)."""
    if source.folder:
        found = D.find_split_file(Path(source.folder), split) or D.find_split_file(Path(source.folder), "train")
        return str(found or source.folder)
    return f"{source.kind} dataset {source.name} ({split})"


def model_config(cfg: TrainConfig, data: TrainData) -> ModelConfig:
    """The model's config: the preset, with the model options that were set."""
    toks = data.tokenizers
    return model_config_for(cfg, data.task, (toks.src.vocab_size, toks.tgt.vocab_size), data.num_classes)


def model_config_for(cfg: TrainConfig, task: str, vocab: tuple[int, int], num_classes: int | None) -> ModelConfig:
    """`model_config` for a task, (source, target) vocabulary sizes and class count: also before the
    tokenizers are trained (`launch`, with the sizes they are trained to), so that what the model
    refuses is refused before the run folder is touched."""
    over = dict(src_vocab_size=vocab[0], tgt_vocab_size=vocab[1], kernel=cfg.kernel)
    over.update({key: getattr(cfg, name) for name, key in MODEL_FIELDS.items() if getattr(cfg, name) is not None})
    if cfg.layers is not None:
        over["n_encoder_layers"] = over["n_decoder_layers"] = cfg.layers
    if cfg.encoder_layers is not None:
        over["n_encoder_layers"] = cfg.encoder_layers
    if cfg.decoder_layers is not None:
        over["n_decoder_layers"] = cfg.decoder_layers
    if cfg.no_pos_encoding:
        over["pos_encoding"] = False
    if cfg.copy:
        over["copy"] = True
    if task == "classification":
        over["n_decoder_layers"], over["num_classes"] = 0, num_classes
        over.pop("tgt_vocab_size")
    else:
        if PRESETS[cfg.preset].get("num_classes"):
            raise ConfigError(f"preset {cfg.preset!r} is a classifier; pick a seq2seq preset for {task}")
        over["num_classes"] = None
    if task == "extractive":  # a seq2seq preset's encoder
        over["n_decoder_layers"], over["extractive"] = 0, True
        over.pop("tgt_vocab_size")
    over["max_len"] = max(PRESETS[cfg.preset].get("max_len", 4096), longest_position(cfg))
    return get_config(cfg.preset, **over)


def longest_position(cfg: TrainConfig) -> int:
    """The max_len a model needs for this run's batches: the longest source or target, padded up to
    --pad-multiple as collate pads it, plus one (BOS, or a classifier's [CLS])."""
    return max(D.round_up(cfg.max_src_len, cfg.pad_multiple), D.round_up(cfg.max_tgt_len, cfg.pad_multiple)) + 1
