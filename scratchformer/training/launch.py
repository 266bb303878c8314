"""Building a run: options checked, then the checkpoint (resume), device, data source, run folder,
logger, data, model and Trainer, in that order, so that nothing is written before the options and
the run folder are known to be good."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from .. import data as D
from .. import op_checks
from .. import ops as backends
from ..checkpoint import find_checkpoint, load_checkpoint, write_lines_atomic
from ..data.tokenizer import TokenizerPair
from ..device import describe, resolve_device
from ..model import PRESETS, ModelConfig, build_model, count_parameters
from .build import Examples, build_data, examples_id, load_examples, longest_position, model_config, model_config_for
from .config import METRICS, TEACHER_FORCED, ConfigError, TrainConfig, flag
from .distributed import Dist, setup_distributed
from .resume import check_init_from, load_resume_checkpoint, resumed
from .runs import (
    Logger,
    carry_best,
    fresh_run_folder,
    resume_folder,
    resumed_run_folder,
    resumes_elsewhere,
    summary_writer,
)


def create_trainer(cls, config: TrainConfig, given: frozenset[str]):
    """`cls(...)` (a Trainer) for a new run from `config`, or with --resume for the run in the
    checkpoint, continued exactly, or with --init-from a new run that starts from another run's
    model and tokenizers. `given`: the options set on the command line."""
    t0, ckpt, path, warning = time.time(), None, None, None
    if config.resume:
        folder = resume_folder(config.out, config.resume)
        path, ckpt, warning = load_resume_checkpoint(folder, config.resume)
        config = resumed(config, given, ckpt["args"], str(path), ckpt.get("config"))
        config = dataclasses.replace(config, out=str(folder))
    resuming, moved = ckpt is not None, path is not None and resumes_elsewhere(Path(config.out), path)
    config, init = _init_checkpoint(config, given)
    resolve_device(config.device)  # a clear error now, not torch's when the model moves
    source = D.resolve_source(config.dataset, config.data, config.task)
    config = config.resolved(source.task, source.kind == "synthetic")
    check_for_task(config, source.task)
    _check_encoder_only_options(config, source.task, given)
    dist_, device = setup_distributed(config.device)
    config = dataclasses.replace(config, precision=precision_for(config.precision, device))
    check_for_device(config, device.type, dist_.world)
    start = ckpt or init  # the run whose model and tokenizers this one keeps
    reused, examples, planned = _read_before_the_folder(config, source, start, given, device)
    _check_start(start, path, config, source.task, examples, dist_.world)
    # the last refusal is above: --overwrite clears an earlier run below, a new dated folder becomes runs/latest
    out = resumed_run_folder(config.out, dist_) if resuming and not moved else fresh_run_folder(
        config.out, config.overwrite, dist_, path)
    config = dataclasses.replace(config, out=str(out))
    if config.threads:
        torch.set_num_threads(config.threads)
    seed_everything(config.seed)
    log = _run_logger(out, config, dist_, ckpt["progress"] if resuming else None,
                      path.parent if moved else None)  # a run resumed into a new folder: its logs go on there
    if warning:
        log.info(warning)
    log.info(f"device {device}{f' x{dist_.world} (DDP)' if dist_.on else ''} | task {source.task} | data "
             f"{source.kind}:{source.folder or source.name} | precision {config.precision}")
    log.info(f"environment: {describe(device)}")  # which machine and software every figure below came from
    toks = TokenizerPair.from_dict(start["tokenizers"]) if start else reused
    if toks is not None:  # a resumed run's too: its files are the checkpoint's again if damaged
        dist_.on_main(lambda: toks.save(out))  # rank 0 writes; what it raises (a full disk), every rank raises
    if moved and not carry_best(path.parent, out, ckpt["progress"]["best_step"], dist_):
        ckpt["progress"].update(best=None, best_step=-1, bad_evals=0)  # this folder's best starts afresh
    data = build_data(config, source, out, dist_, log, toks, examples)
    mcfg = planned if start else model_config(config, data)  # a new run's: with its tokenizers' vocabulary sizes
    model = build_model(mcfg, device) if init is None else _initialised_model(mcfg, init, config, device, log)
    model.recompute_activations(config.recompute_activations)
    if dist_.on:  # the same initial weights on every rank (DDP checks), then a dropout stream of its own per rank
        torch.manual_seed(config.seed + dist_.rank)
    dist_.on_main(lambda: _write_configs(out, mcfg, config))  # rank 0 writes; what it raises, every rank raises
    log.info(f"model: {type(model).__name__} {count_parameters(model):,} parameters | preset {config.preset} | "
             f"d_model {mcfg.d_model} heads {mcfg.n_heads} layers {mcfg.n_encoder_layers}+{mcfg.n_decoder_layers} "
             f"d_ff {mcfg.d_ff} norm {mcfg.norm} pos_encoding {mcfg.pos_encoding}{' copy' * mcfg.copy} | kernel "
             f"{mcfg.kernel} -> {model.ops.name}{' | layers recomputed in the backward' * model.encoder.recompute}")
    trainer = cls(config, model, data, model_config=mcfg, out=out, device=device, log=log, dist=dist_, started=t0)
    if resuming:
        trainer.resume(ckpt)
    for line in _describe(trainer):
        log.info(line)
    log.info(f"set up in {time.time() - t0:.1f}s (data, tokenizers, model{', checkpoint' * resuming})")
    return trainer


def _write_configs(out: Path, mcfg: ModelConfig, config: TrainConfig) -> None:
    """The run folder's config.json (the model's) and args.json (the run's options)."""
    for name, written in (("config.json", mcfg), ("args.json", config)):
        write_lines_atomic(out / name, json.dumps(written.to_dict(), indent=2).splitlines())


def _describe(trainer) -> list[str]:
    """The log's lines on how the run trains: its batches, its steps and what bounds them (--max-steps or
    the epochs), its schedule; a warning where the warmup outlasts the run; why a resumed run has no
    step left (`_ended`)."""
    cfg, total = trainer.config, trainer.total_steps
    batching = " ".join(([f"max_tokens {cfg.max_tokens}"] if cfg.max_tokens else [])
                        + ([f"batch_size {cfg.batch_size}"] if cfg.batch_size else []))
    steps = f"{total} step{'s' * (total != 1)}"
    bound = "--max-steps" if total == cfg.max_steps else f"{trainer.epochs} epoch{'s' * (trainer.epochs != 1)}"
    lines = [f"training: {trainer.sampler.batches_per_epoch(0)} batches/epoch ({batching}, grad_accum "
             f"{cfg.grad_accum}), {steps} ({bound}){f' or {cfg.time_budget:g} s' if cfg.time_budget else ''}, "
             f"lr {cfg.lr:g} {cfg.schedule} warmup {cfg.warmup_steps}, label smoothing {cfg.label_smoothing}"
             f"{f', weights averaged (--ema {cfg.ema:g})' if cfg.ema else ''}"]
    if cfg.warmup_steps and cfg.warmup_steps > total:  # every schedule's warmup is linear: lr * step / warmup
        lines.append(f"warning: --warmup-steps {cfg.warmup_steps} outlasts the run's {steps}: the learning rate "
                     f"ends at {cfg.lr * total / cfg.warmup_steps:.3g}, never reaching --lr {cfg.lr:g}; give fewer "
                     "--warmup-steps or more steps")
    if ended := _ended(trainer):
        lines.append(f"nothing to train: the run ended at step {trainer.progress.step}, {ended}")
    return lines


def _ended(trainer) -> str | None:
    """Why a resumed run has no step left to take, with the option that would train it on; None if it has."""
    cfg, prog = trainer.config, trainer.progress
    if not prog.step:
        return None
    if cfg.max_steps is not None and prog.step >= cfg.max_steps:
        return f"--max-steps {cfg.max_steps} reached: give a larger --max-steps to train on"
    if trainer.epochs and prog.epoch >= trainer.epochs:
        return f"its {trainer.epochs} epochs done: give more --epochs to train on"
    if prog.stopped_early:
        return f"stopped early ({prog.bad_evals} evaluations without gain): give a larger --patience, or 0"
    if prog.out_of_time:
        return f"its --time-budget spent ({prog.seconds:.0f} s trained): give a larger --time-budget"
    return None


def _read_before_the_folder(config: TrainConfig, source: D.DataSource, start: dict | None, given: frozenset[str],
                            device: torch.device):
    """(the --tokenizer files' tokenizers or None, the examples, the model's config): read, and their
    errors raised, before the run folder is made or cleared: the files may be in the folder --overwrite
    (or a stopped run's reuse) clears, and a data error (a bad line, a label), a model size the model
    refuses or a backend that cannot run it on `device` (`ops.select`: a head dim triton's attention
    does not run, kernels that do not load) must leave an earlier run there as it was."""
    reused = TokenizerPair.load(config.tokenizer) if config.tokenizer and start is None else None
    examples = load_examples(config, source, given)
    if not config.no_plots and config.attention_example >= len(examples.valid):
        raise ConfigError(f"--attention-example {config.attention_example}: the validation split has "
                          f"{len(examples.valid)} examples (0 to {len(examples.valid) - 1})")
    if reused is not None:
        examples.notes.append(f"tokenizer: reused {', '.join(config.tokenizer)}")  # logged by build_data
    planned = _planned_model(config, source.task, start, given, examples, reused)
    backends.select(planned.kernel, device, planned.head_dim)  # its refusals, as building the model would raise
    return reused, examples, planned


def _planned_model(config: TrainConfig, task: str, start: dict | None, given: frozenset[str], examples: Examples,
                   reused: TokenizerPair | None) -> ModelConfig:
    """The model's config (its checks run): the checkpoint's a run starts from, with --kernel when given
    and, for --init-from, a max_len that admits this run's batches (`longest_position`); a new run's
    with the vocabulary sizes of its --tokenizer files, else the --vocab-size its tokenizer is trained
    to (a shared one: `check_config` refuses --copy and --tie-embeddings all with two), replaced by the
    trained sizes once the data is built."""
    if start is not None:
        mcfg = ModelConfig.from_dict({**start["config"], **({"kernel": config.kernel} if "kernel" in given else {})})
        return mcfg if config.resume else dataclasses.replace(mcfg, max_len=max(mcfg.max_len,
                                                                                longest_position(config)))
    vocab = (reused.src.vocab_size, reused.tgt.vocab_size) if reused is not None else (config.vocab_size,) * 2
    return model_config_for(config, task, vocab, examples.num_classes)


def _check_tokenizer_flags(config: TrainConfig, given: frozenset[str]) -> None:
    """--tokenizer reuses trained tokenizers, shared or not as its files are: the options for training
    one, given with it, would be ignored (and --vocab-size recorded in args.json as if it were true)."""
    unused = [flag(k) for k in ("vocab_size", "tokenizer_examples", "separate_vocab") if k in given]
    if config.tokenizer and not config.resume and unused:
        raise ConfigError(f"--tokenizer {' '.join(config.tokenizer)} reuses trained tokenizers (their vocabulary, one "
                          f"file shared, two separate): drop {', '.join(unused)}, which train{'s' * (len(unused) == 1)}"
                          " a new one")


# the schedules that read each schedule option (given for another, it would do nothing)
SCHEDULE_OPTIONS = {"min_lr": ("cosine",), "plateau_patience": ("plateau",)}


def _check_ignored_options(cfg: TrainConfig, given: frozenset[str]) -> None:
    """Options given that would do nothing, refused naming what makes them so: one of another schedule
    than the run's, --attention-example with --no-plots."""
    for name, schedules in SCHEDULE_OPTIONS.items():
        if name in given and cfg.schedule not in schedules:
            raise ConfigError(f"{flag(name)} is for --schedule {' or '.join(schedules)}; this run's is {cfg.schedule}: "
                              f"drop {flag(name)}, or choose such a schedule")
    if "attention_example" in given and cfg.no_plots:
        raise ConfigError("--attention-example picks the example plots/attention.png draws, and --no-plots draws "
                          "none: drop one")


# the options of a target sequence, its decoder and its decoding: an encoder-only task has no use for them
# (an extractive model decodes no tokens, but picks sentences for as many validation examples)
SEQ2SEQ_OPTIONS = ("max_tgt_len", "separate_vocab", "decoder_layers", "tie_embeddings", "beam_size",
                   "eval_decode_examples")


def _check_encoder_only_options(cfg: TrainConfig, task: str, given: frozenset[str]) -> None:
    if task not in D.ENCODER_ONLY:
        return
    unused = [flag(n) for n in SEQ2SEQ_OPTIONS if n in given and (task, n) != ("extractive", "eval_decode_examples")]
    unused += ["--tokenizer SRC TGT"] * (cfg.tokenizer is not None and len(cfg.tokenizer) == 2)
    if unused:
        model = "a classifier" if task == "classification" else "an extractive summarizer"
        one = len(unused) == 1
        raise ConfigError(f"{', '.join(unused)} {'is' if one else 'are'} for a target sequence, its decoder or its "
                          f"decoding; {model} has none: drop {'it' if one else 'them'}")


def _init_checkpoint(config: TrainConfig, given: frozenset[str]) -> tuple[TrainConfig, dict | None]:
    """--init-from: the config naming the checkpoint file, and that checkpoint; (config, None)
    without it, or when resuming (a resumed run has its weights in its own checkpoint). First the
    flags given beside what a run starts from (--init-from, --resume, --tokenizer) are checked."""
    _check_tokenizer_flags(config, given)
    _check_ignored_options(config, given)
    if config.resume and "init_from" in given:
        raise ConfigError("--init-from starts a new run from a checkpoint's weights and --resume continues a run: "
                          "give one")
    if not config.init_from or config.resume:
        return config, None
    path = find_checkpoint(config.init_from, prefer="best")
    check_init_from(given, str(path))
    init = load_checkpoint(path, require=("model", "config", "tokenizers", "task", "progress"))
    # the model's options and its tokenizers' size are the checkpoint run's: recorded so (args.json; they were
    # the data's defaults, another model's) and checked so (--rdrop against its dropout: unset, it passed)
    names = [f.name for f in dataclasses.fields(TrainConfig) if f.metadata["group"] == "model" and f.name != "kernel"]
    saved = init.get("args") or {}
    built = {name: saved[name] for name in (*names, "vocab_size", "separate_vocab") if name in saved}
    return dataclasses.replace(config, init_from=str(path), **built), init


def _initialised_model(mcfg: ModelConfig, init: dict, config: TrainConfig, device, log):
    """The --init-from model with its weights, for this run's data (its classes checked in `create_trainer`;
    its max_len, a guard, set by `_planned_model`)."""
    model = build_model(mcfg, device)
    model.load_state_dict(init["model"])
    log.info(f"initialised from {config.init_from} (its step {init['progress']['step']}): weights and tokenizers; "
             f"new optimizer and schedule")
    return model


def _check_start(start: dict | None, resumed: Path | None, config: TrainConfig, task: str, examples: Examples,
                 world: int) -> None:
    """The checkpoint a run starts from (--resume's file `resumed`, or --init-from's) against this
    run: its task and class count; resumed, its training and validation examples (`_check_examples`)
    and the number of processes that wrote it (one RNG state each): its place in the epoch counts batches
    of its examples per process, which another number would draw otherwise."""
    if start is None:
        return
    resuming, classes = resumed is not None, examples.num_classes
    named = f"--resume {resumed}" if resuming else f"--init-from {config.init_from}"
    if resuming:
        _check_examples(named, start, examples, config.data)
        _check_no_evaluation(Path(config.out))
    if start["task"] != task:
        raise ConfigError(f"{named} is a {start['task']} model; the data is {task}")
    if classes is not None and start["config"].get("num_classes") != classes:
        raise ConfigError(f"{named} classifies into {start['config'].get('num_classes')} classes; the data has "
                          f"{classes}")
    saved = len(start["rng"]) if resuming and isinstance(start["rng"], list) else 1
    if resuming and saved != world:
        how = f"torchrun --nproc_per_node {saved}" if saved > 1 else "one process (no torchrun)"
        raise ConfigError(f"{named} was written by {saved} process{'es' * (saved > 1)} and this run has {world}: "
                          f"its place in the epoch and its random streams are per process; resume with {how}, or "
                          "start a new run from its weights with --init-from")


def _check_no_evaluation(out: Path) -> None:
    """A resumed run's folder that holds evaluate's outputs on the validation split (of the stopped run,
    say) is refused: the final report writes its own predictions.validation.jsonl, which replaced
    evaluate's and left its metrics beside predictions they do not describe."""
    if (out / "predictions.validation.jsonl").exists() and (out / "metrics.validation.json").exists():
        raise ConfigError(f"{out} holds evaluate's predictions.validation.jsonl and metrics.validation.json: this "
                          f"run's final report writes its own predictions.validation.jsonl over them; move them "
                          f"out of the folder (or evaluate with --out DIR), then resume")


def _check_examples(named: str, ckpt: dict, examples: Examples, data: str | None) -> None:
    """A resumed run's examples against those its checkpoint records (`examples_id`; train's from
    2026-12-05, validation's from 2026-12-06): its place in the epoch counts batches of its training
    examples, and its best metric, which later validations are compared with, was measured on its
    validation examples. --data `data` may name another folder than the run's (moved there) whose
    examples are the same: it is recorded (args.json, the checkpoints' args and data) for what follows."""
    best, old = ckpt["args"].get("best_metric"), ckpt["args"].get("data")
    if data != old and ckpt.get("train_data") is None:
        raise ConfigError(f"{named}: --data {data} cannot replace the run's --data {old}: that checkpoint records no "
                          f"digest of the run's examples to check them against (it was written before 2026-12-05); "
                          f"give the folder its old place, or start a new run from its weights with --init-from")
    for split, key, now_examples, why in (
            ("training", "train_data", examples.train, "its place in the epoch counts batches of the old examples"),
            ("validation", "valid_data", examples.valid, f"its best {best} was measured on the old examples, and "
                                                         f"later validations would be compared with it")):
        saved = ckpt.get(key)
        if saved is not None and saved != (now := examples_id(now_examples)):
            how = "other contents" if saved["examples"] == now["examples"] else f"{now['examples']} examples"
            changed = (f"--data {data} holds other {split} examples than the run's --data {old}" if data != old else
                       f"the {split} data changed since that checkpoint")
            raise ConfigError(f"{named}: {changed} ({saved['examples']} examples then, {how} now); {why}. Restore "
                              f"them, or start a new run from its weights with --init-from")


def precision_for(precision: str, device: torch.device) -> str:
    """--precision on `device`: "auto" becomes bf16 on GPUs that have it, else fp32."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision != "fp32" and device.type != "cuda":
        raise ConfigError(f"--precision {precision} needs a GPU; give --precision fp32 on {device.type} (a resumed "
                          "run's too)")
    return precision


def _run_logger(out: Path, config: TrainConfig, dist_: Dist, progress: dict | None, history: Path | None) -> Logger:
    """The run's logger, rank 0's made on rank 0 (a resumed run's logs rewritten there: `Logger`), what
    it raises raised on every rank (`Dist.on_main`); the other ranks' log nothing."""
    made = []
    dist_.on_main(lambda: made.append(Logger(out, True, config.tensorboard, progress, history=history)))
    return made[0] if made else Logger(out, False)


def check_for_task(cfg: TrainConfig, task: str) -> None:
    """The checks that need the task (known from the data source, before any example is read)."""
    metric, names = cfg.best_metric, METRICS[task]
    if metric is not None and metric not in names:
        raise ConfigError(f"--best-metric {metric}: {task} validation computes {', '.join(names)}")
    if metric is not None and metric not in TEACHER_FORCED and not cfg.eval_decode_examples:
        raise ConfigError(f"--best-metric {metric} is a decoding metric: it needs --eval-decode-examples > 0")
    if task in D.ENCODER_ONLY and cfg.encoder_layers == 0:  # the classifier read its [CLS] alone: one answer
        raise ConfigError(f"--encoder-layers 0 makes no encoder; {task} reads its input through at least 1")
    if task in D.ENCODER_ONLY and cfg.copy:
        model = "a classifier" if task == "classification" else "an extractive summarizer"
        raise ConfigError(f"--copy is for sequence-to-sequence tasks; {model} has no target tokens to copy into")
    if task == "extractive" and cfg.bpe_dropout:
        raise ConfigError("--bpe-dropout resegments words each epoch; --task extractive encodes its marked sentences "
                          "once")
    for name in ("summary_sentences", "summary_words"):
        if task != "extractive" and getattr(cfg, name) is not None:
            raise ConfigError(f"{flag(name)} picks an extractive summarizer's sentences; {task} validation decodes")
    if task == "extractive" and cfg.rdrop:
        raise ConfigError(f"--rdrop {cfg.rdrop:g}: R-Drop here compares token or class distributions; an extractive "
                          f"summarizer scores sentences")
    if task == "extractive" and cfg.decoder_layers:
        raise ConfigError(f"--decoder-layers {cfg.decoder_layers}: --task extractive trains an encoder only")
    if task != "classification":
        if cfg.decoder_layers == 0 and task != "extractive":
            raise ConfigError(f"--decoder-layers 0 makes no decoder; {task} needs at least 1")
        if cfg.preset is not None and PRESETS[cfg.preset].get("num_classes"):
            raise ConfigError(f"--preset {cfg.preset} is a classifier; pick a seq2seq preset for {task}")


def check_for_device(cfg: TrainConfig, device_type: str, world: int) -> None:
    """The checks that need the device, the number of processes or the installed packages (known before
    the run folder is made)."""
    if cfg.tensorboard:
        summary_writer()
    if cfg.compile_mode == "reduce-overhead" and device_type != "cuda":  # inductor skips the graphs unsaid
        raise ConfigError(f"--compile-mode reduce-overhead replays CUDA graphs: it needs a GPU, and the device is "
                          f"{device_type}; drop it (--compile alone compiles the step), or give --compile-mode "
                          "default (a resumed run's)")
    if not cfg.cuda_graphs:
        return
    if device_type != "cuda":
        raise ConfigError(f"--cuda-graphs records CUDA graphs: it needs a GPU, and the device is {device_type}; "
                          f"drop it, or give --no-cuda-graphs (a resumed run's)")
    if cfg.precision == "fp16":
        raise ConfigError("--cuda-graphs with --precision fp16: its loss scaling reads on the host, every step, "
                          "whether the gradients are finite, which a graph cannot hold; use bf16 or fp32")
    if world > 1:
        raise ConfigError(f"--cuda-graphs steps one process; this is one of {world} (DDP): drop --cuda-graphs")
    if op_checks.DEBUG:
        raise ConfigError("--cuda-graphs with SCRATCHFORMER_DEBUG=1: its value checks (token ids, lengths) read "
                          "the batch on the host inside the step, which a graph cannot hold; unset "
                          "SCRATCHFORMER_DEBUG (--debug alone shows tracebacks) or drop --cuda-graphs")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
