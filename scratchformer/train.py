"""Train a Transformer (translation, summarization) or an encoder-only classifier.

    python -m scratchformer.train                          # synthetic smoke task, CPU, a few minutes
    python -m scratchformer.train --dataset multi30k --preset small --max-tokens 4096 --out runs/m30k
    python -m scratchformer.train --data ../shared/data/samsum --max-src-len 512 --out runs/samsum
    python -m scratchformer.train --dataset imdb --out runs/imdb   # classification (validation carved from train)
    torchrun --nproc_per_node=2 -m scratchformer.train --dataset multi30k ...   # DistributedDataParallel
    python -m scratchformer.train --resume --out runs/m30k  # continue exactly where it stopped

A run folder (--out) holds config.json, args.json, the tokenizer(s), checkpoints (step_*.pt,
last.pt, best.pt), metrics.jsonl, train.csv, valid.csv and plots/. The recipe: AdamW (0.9, 0.98),
inverse-sqrt / cosine / plateau schedules with warmup, label smoothing (pad ignored), gradient
clipping and accumulation, bf16/fp16 autocast on GPU, early stopping, exact resume.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from . import data as D
from . import metrics as M
from .checkpoint import (find_checkpoint, load_checkpoint, prune_checkpoints, rng_state,
                         save_checkpoint, set_rng_state)
from .config import PAD_ID, PRESETS, ModelConfig, get_config
from .evaluate import (attention_map, autocast_for, eval_loader, format_metrics, predict_labels, predict_seq2seq,
                       teacher_forced)
from .model import build_model, count_parameters
from .data.tokenizer import BPETokenizer, TokenizerPair

# Defaults that depend on the data: the synthetic smoke task must learn in a few CPU minutes.
SYNTHETIC_DEFAULTS = dict(
    preset="tiny", d_model=64, heads=4, layers=2, d_ff=256, dropout=0.1,
    vocab_size=400, max_src_len=32, max_tgt_len=32, batch_size=64, max_tokens=None, epochs=None,
    max_steps=1500, lr=2e-3, warmup_steps=100, eval_every=500, log_every=100, eval_decode_examples=300,
    threads=1,  # a model this small gains nothing from intra-op threads, and loses a lot on a busy CPU
)
REAL_DEFAULTS = dict(
    preset="small", vocab_size=8000, max_tokens=4096, batch_size=None, epochs=10, max_steps=None,
    lr=5e-4, warmup_steps=1000, eval_every=0, log_every=100, eval_decode_examples=500,
)
TASK_DEFAULTS = {
    "translation": dict(max_src_len=128, max_tgt_len=128),
    "summarization": dict(max_src_len=512, max_tgt_len=128),
    "classification": dict(preset="classifier", max_src_len=256, max_tgt_len=2, lr=1e-3, warmup_steps=200,
                           max_tokens=16384, eval_decode_examples=0),
}
HIGHER_IS_BETTER = {"bleu", "chrf", "exact_match", "accuracy", "rouge1", "rouge2", "rougeL", "rougeLsum"}


# ---------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scratchformer.train",
        description="Train an encoder-decoder Transformer (translation, summarization) or an encoder-only "
        "classifier. With no arguments: the embedded synthetic task (English number words -> German, "
        "reversed) on CPU, in a few minutes.",
        epilog="Ablation grids: python -m scratchformer.ablate --help (or: python -m scratchformer.train ablate ...). "
        "Evaluate: python -m scratchformer.evaluate; generate: python -m scratchformer.generate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--task", choices=D.TASKS, help="task (default: from the dataset)")
    g.add_argument("--dataset", default="synthetic",
                   help="'synthetic' (embedded, no download), a name of a local folder under "
                   "$SCRATCHFORMER_DATA, ./data or ../shared/data, or a hub dataset: " + ", ".join(sorted(D.HUB)))
    g.add_argument("--data", metavar="DIR", help="local folder of {train,validation,test}.{jsonl,jsonl.gz,tsv,parquet}")
    g.add_argument("--max-train-examples", type=int, help="use only the first N training examples")
    g.add_argument("--max-valid-examples", type=int, help="use only the first N validation examples")
    g.add_argument("--valid-fraction", type=float, default=0.05,
                   help="when the data has no validation split (IMDb), carve this seeded fraction of train")
    g.add_argument("--max-src-len", type=int, help="source tokens kept (first N-1 + EOS); default by task")
    g.add_argument("--max-tgt-len", type=int, help="target tokens kept (first N-1, then EOS); default by task")
    g.add_argument("--synthetic-seed", type=int, default=1234, help="seed of the synthetic corpus")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    g.add_argument("--threads", type=int, help="torch intra-op CPU threads (default: torch's; synthetic: 1)")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default: 400 synthetic, 8000 otherwise)")
    g.add_argument("--separate-vocab", action="store_true", help="separate source and target BPE vocabularies")
    g.add_argument("--tokenizer", nargs="+", metavar="FILE",
                   help="reuse tokenizer JSON file(s): one (shared) or two (source, target)")
    g.add_argument("--tokenizer-examples", type=int, help="train BPE on at most N training examples")

    g = p.add_argument_group("model")
    g.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: tiny-ish for synthetic, "
                   "small for seq2seq data, classifier for classification)")
    g.add_argument("--kernel", choices=("auto", "eager", "torch", "triton"), default="auto",
                   help="backend of the hot paths: auto = triton on CUDA, eager on CPU")
    g.add_argument("--d-model", type=int)
    g.add_argument("--heads", type=int, help="attention heads")
    g.add_argument("--layers", type=int, help="encoder and decoder layers (both)")
    g.add_argument("--encoder-layers", type=int)
    g.add_argument("--decoder-layers", type=int)
    g.add_argument("--d-ff", type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--attn-dropout", type=float)
    g.add_argument("--activation", choices=("relu", "gelu"))
    g.add_argument("--norm", choices=("post", "pre"), help="residual LayerNorm placement")
    g.add_argument("--final-norm", action=argparse.BooleanOptionalAction, default=None,
                   help="LayerNorm after the last encoder/decoder layer")
    g.add_argument("--tie-embeddings", choices=("none", "decoder", "all"))
    g.add_argument("--no-pos-encoding", action="store_true", help="ablation: no positional encoding")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, help="passes over the training data (default: 10; synthetic: by steps)")
    g.add_argument("--max-steps", type=int, help="stop after N optimizer steps")
    g.add_argument("--batch-size", type=int, help="max sentences per batch")
    g.add_argument("--max-tokens", type=int, help="max padded tokens per batch (length-bucketed)")
    g.add_argument("--grad-accum", type=int, default=1, help="batches accumulated per optimizer step")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--schedule", choices=("inverse_sqrt", "cosine", "plateau", "constant"), default="inverse_sqrt",
                   help="inverse_sqrt = Noam (linear warmup, then lr*sqrt(warmup/step)); plateau halves the lr "
                   "when the validation metric stalls")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--min-lr", type=float, default=0.0, help="floor of the cosine schedule")
    g.add_argument("--plateau-patience", type=int, default=2, help="evaluations without gain before halving")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay (matrices only)")
    g.add_argument("--adam-betas", type=float, nargs=2, default=(0.9, 0.98))
    g.add_argument("--adam-eps", type=float, default=1e-9)
    g.add_argument("--label-smoothing", type=float, default=0.1)
    g.add_argument("--clip-norm", type=float, default=1.0, help="gradient clipping norm (0: off)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="autocast dtype; auto = bf16 on GPUs that support it, fp32 on CPU")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("evaluation, early stopping, checkpoints, logging")
    g.add_argument("--eval-every", type=int, help="validate every N steps (0: at the end of each epoch)")
    g.add_argument("--eval-decode-examples", type=int,
                   help="decode this many validation examples at each validation (BLEU etc.; 0: loss only)")
    g.add_argument("--best-metric", help="metric for best.pt, early stopping and plateau: loss (default), "
                   "bleu, chrf, exact_match, rougeL, accuracy, ...")
    g.add_argument("--patience", type=int, default=0, help="early stopping: evaluations without gain (0: off)")
    g.add_argument("--beam-size", type=int, default=4, help="beam size of the final evaluation (1: greedy only)")
    g.add_argument("--save-every", type=int, default=0, help="write step_N.pt and last.pt every N steps (0: at validations)")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="step checkpoints kept")
    g.add_argument("--resume", nargs="?", const="last", metavar="CKPT",
                   help="continue from a checkpoint (default: OUT/last.pt), with its arguments")
    g.add_argument("--out", help="run folder (default: a new runs/<date>-<time>, linked as runs/latest); "
                   "one that already holds a run is refused unless --resume or --overwrite")
    g.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (its checkpoints, logs, plots are deleted first)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available, torchrun: cuda:LOCAL_RANK)")
    g.add_argument("--log-every", type=int, help="log a train row every N steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard (needs tensorboard)")
    g.add_argument("--attention-example", type=int, default=0, help="validation example drawn in plots/attention.png")
    g.add_argument("--no-plots", action="store_true")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse; with --resume, the checkpoint's arguments are the base and only flags given now override."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.explicit = _explicit_flags(parser, argv)
    return args


def _explicit_flags(parser, argv) -> set[str]:
    """The dests of the flags actually given (parsing again with every default suppressed)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for a, d in saved:
            a.default = d


def fill_defaults(args, task: str, synthetic: bool) -> None:
    """Fill data-dependent defaults (None) in place; explicit flags always win."""
    defaults = dict(SYNTHETIC_DEFAULTS if synthetic else REAL_DEFAULTS)
    if not synthetic:
        defaults.update(TASK_DEFAULTS[task])
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.batch_size is None and args.max_tokens is None:
        args.max_tokens = 4096
    if args.best_metric is None:
        args.best_metric = "accuracy" if task == "classification" else "loss"


# ---------------------------------------------------------------------------------------------
# Loss and schedules
# ---------------------------------------------------------------------------------------------


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int = PAD_ID):
    """Summed label-smoothed cross-entropy and summed NLL over non-pad targets.

    logits (N, V), target (N,). The smoothed target puts 1 - eps on the gold token and spreads
    eps evenly over the V - 2 other tokens that are neither gold nor PAD (PAD is never a target;
    annotated-transformer's LabelSmoothing). Positions whose target is PAD are ignored.
    Returns (loss_sum, nll_sum), fp32 scalars.
    """
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    keep = target != pad_id
    lprobs, target = lprobs[keep], target[keep]
    nll = -lprobs.gather(-1, target[:, None]).squeeze(-1)  # (N,)
    if epsilon == 0.0:
        return nll.sum(), nll.sum()
    V = lprobs.shape[-1]
    others = -(lprobs.sum(-1) - lprobs[:, pad_id]) - nll  # -sum of log p over non-gold, non-pad tokens
    loss = (1.0 - epsilon) * nll + epsilon / (V - 2) * others
    return loss.sum(), nll.sum()


class InverseSqrt:
    """Linear warmup to the peak, then peak * sqrt(warmup / step): the Noam schedule of the paper
    (lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)) with the peak as a free parameter."""

    def __init__(self, warmup: int):
        self.warmup = max(1, warmup)

    def __call__(self, step: int) -> float:  # step: 0-based count of optimizer steps taken
        s = step + 1
        return min(s / self.warmup, math.sqrt(self.warmup / s))


class WarmupCosine:
    """Linear warmup, then cosine decay from the peak to min_ratio * peak at total steps."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0):
        self.warmup, self.total, self.min_ratio = max(1, warmup), max(1, total), min_ratio

    def __call__(self, step: int) -> float:
        s = step + 1
        if s <= self.warmup:
            return s / self.warmup
        t = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class Constant:
    def __init__(self, warmup: int):
        self.warmup = max(1, warmup)

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup)


def build_scheduler(optimizer, name: str, *, warmup: int, total: int, min_lr: float = 0.0, peak: float = 1.0,
                    metric_mode: str = "min", patience: int = 2):
    """LambdaLR (inverse_sqrt, cosine, constant) stepped per optimizer step, or ReduceLROnPlateau
    (plateau) stepped per validation with the best metric."""
    if name == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode=metric_mode, factor=0.5, patience=patience)
    fn = {"inverse_sqrt": lambda: InverseSqrt(warmup), "constant": lambda: Constant(warmup),
          "cosine": lambda: WarmupCosine(warmup, total, min_lr / peak if peak else 0.0)}[name]()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def build_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.98), eps: float = 1e-9, fused: bool = False):
    """AdamW; weight decay on matrices only (not biases, LayerNorm gains, the [CLS] vector)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **({"fused": True} if fused else {}))


# ---------------------------------------------------------------------------------------------
# Distributed, device, logging
# ---------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def on(self) -> bool:
        return self.world > 1

    def barrier(self):
        if self.on:
            dist.barrier()


def setup_distributed(device_flag: str | None) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: NCCL on GPUs, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        dev = torch.device(device_flag or ("cuda" if torch.cuda.is_available() else "cpu"))
        return Dist(), dev
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and (device_flag is None or device_flag.startswith("cuda"))
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    return Dist(rank, world, local_rank), dev


class Logger:
    """Rank-0 logging: console (through tqdm), log.txt, metrics.jsonl, train.csv / valid.csv,
    optionally TensorBoard."""

    def __init__(self, out: Path, enabled: bool, tensorboard: bool = False, resume_step: int | None = None):
        self.out, self.enabled = out, enabled
        self.tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            self._truncate_after(resume_step)
        self.log_file = open(out / "log.txt", "a", encoding="utf-8")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise SystemExit(f"--tensorboard needs the tensorboard package ({e})") from None
            self.tb = SummaryWriter(str(out / "tb"))

    def _truncate_after(self, step: int) -> None:
        """On resume, drop rows the interrupted run logged after its last checkpoint."""
        p = self.out / "metrics.jsonl"
        if p.exists():
            rows = [json.loads(x) for x in p.read_text(encoding="utf-8").splitlines() if x.strip()]
            keep = [r for r in rows if r.get("step", 0) <= step or r.get("split") not in ("train", "valid")]
            p.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
        for name in ("train.csv", "valid.csv"):
            p = self.out / name
            if p.exists():
                lines = p.read_text(encoding="utf-8").splitlines()
                if lines:
                    head = lines[0].split(",")
                    i = head.index("step") if "step" in head else None
                    keep = [lines[0]] + [x for x in lines[1:] if i is None or int(x.split(",")[i]) <= step]
                    p.write_text("\n".join(keep) + "\n", encoding="utf-8")

    def info(self, msg: str) -> None:
        if self.enabled:
            tqdm.write(msg)
            self.log_file.write(msg + "\n")
            self.log_file.flush()

    def row(self, row: dict) -> None:
        if not self.enabled:
            return
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        split = row.get("split")
        if split in ("train", "valid"):
            p = self.out / f"{split}.csv"
            new = not p.exists() or p.stat().st_size == 0
            flat = {k: v for k, v in row.items() if isinstance(v, (int, float, str))}
            fields = list(flat) if new else p.open(encoding="utf-8").readline().strip().split(",")
            with open(p, "a", encoding="utf-8", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                if new:
                    w.writeheader()
                w.writerow(flat)
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self.tb.add_scalar(f"{split}/{k}", v, row.get("step", 0))

    def close(self):
        if self.enabled:
            self.log_file.close()
            if self.tb is not None:
                self.tb.close()


# ---------------------------------------------------------------------------------------------
# Data and model setup
# ---------------------------------------------------------------------------------------------


def load_data(args, source: D.DataSource, log: Logger):
    """Train and validation examples (validation carved from train when the data has none)."""
    seed_kw = dict(synthetic_seed=args.synthetic_seed)
    train = D.load_split(source, "train", args.max_train_examples, **seed_kw)
    if D.has_split(source, "validation"):
        try:
            valid = D.load_split(source, "validation", args.max_valid_examples, **seed_kw)
        except D.DataError as e:
            if source.kind != "hub":
                raise
            log.info(f"no validation split on the hub ({e}); carving {args.valid_fraction:.0%} of train")
            train, valid = D.carve_validation(train, args.valid_fraction, args.seed)
    else:
        train, valid = D.carve_validation(train, args.valid_fraction, args.seed)
        log.info(f"{source.name} has no validation split: carved {len(valid)} examples "
                 f"({args.valid_fraction:.0%}, seed {args.seed}) from train")
        valid = valid[: args.max_valid_examples]
    return train, valid


def make_tokenizers(args, task: str, train: list[D.Example], out: Path, dist_: Dist, log: Logger) -> TokenizerPair:
    if args.tokenizer:
        toks = TokenizerPair.load(args.tokenizer)
        log.info(f"tokenizer: reused {', '.join(args.tokenizer)}")
    elif dist_.main:
        texts = train[: args.tokenizer_examples] if args.tokenizer_examples else train
        t0 = time.time()
        if args.separate_vocab and task != "classification":
            toks = TokenizerPair(BPETokenizer.train(D.texts_for_tokenizer(texts, "src"), args.vocab_size),
                                 BPETokenizer.train(D.texts_for_tokenizer(texts, "tgt"), args.vocab_size))
        else:
            side = "src" if task == "classification" else "both"
            toks = TokenizerPair(BPETokenizer.train(D.texts_for_tokenizer(texts, side), args.vocab_size))
        log.info(f"tokenizer: trained byte-level BPE on {len(texts)} examples in {time.time() - t0:.1f}s "
                 f"(vocab {toks.src.vocab_size}{'' if toks.shared else f' / {toks.tgt.vocab_size}'}, "
                 f"{'shared' if toks.shared else 'separate'})")
    if dist_.on:
        # Rank 0 trained it; everyone uses the same file.
        if dist_.main and not args.tokenizer:
            toks.save(out)
        dist_.barrier()
        if not dist_.main and not args.tokenizer:
            files = ["tokenizer.json"] if (out / "tokenizer.json").exists() else ["tokenizer.src.json", "tokenizer.tgt.json"]
            toks = TokenizerPair.load([out / f for f in files])
    if dist_.main:
        toks.save(out)
    return toks


def model_config(args, task: str, toks: TokenizerPair, num_classes: int | None) -> ModelConfig:
    over = dict(src_vocab_size=toks.src.vocab_size, tgt_vocab_size=toks.tgt.vocab_size, kernel=args.kernel)
    names = dict(d_model="d_model", heads="n_heads", d_ff="d_ff", dropout="dropout", attn_dropout="attn_dropout",
                 activation="activation", norm="norm", final_norm="final_norm", tie_embeddings="tie_embeddings")
    for flag, key in names.items():
        if getattr(args, flag, None) is not None:
            over[key] = getattr(args, flag)
    if args.layers is not None:
        over["n_encoder_layers"] = over["n_decoder_layers"] = args.layers
    if args.encoder_layers is not None:
        over["n_encoder_layers"] = args.encoder_layers
    if args.decoder_layers is not None:
        over["n_decoder_layers"] = args.decoder_layers
    if args.no_pos_encoding:
        over["pos_encoding"] = False
    if task == "classification":
        over["n_decoder_layers"], over["num_classes"] = 0, num_classes
        over.pop("tgt_vocab_size")
    else:
        if PRESETS[args.preset].get("num_classes"):
            raise SystemExit(f"preset {args.preset!r} is a classifier; pick a seq2seq preset for {task}")
        over["num_classes"] = None
    over["max_len"] = max(PRESETS[args.preset].get("max_len", 4096), args.max_src_len + 1, args.max_tgt_len + 1)
    return get_config(args.preset, **over)


def _jsonable(args) -> dict:
    out = {}
    for k, v in vars(args).items():
        if k == "explicit":
            continue
        out[k] = list(v) if isinstance(v, tuple) else v
    return out


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate(model, valid_set, toks, args, device, precision: str, decode_n: int, beam_size: int = 1) -> dict:
    """Teacher-forced loss/perplexity on the whole validation set, plus decoding metrics (or
    accuracy) on its first `decode_n` examples."""
    res = teacher_forced(model, eval_loader(valid_set, max_tokens=max(args.max_tokens or 0, 4096)), device, precision)
    if valid_set.task != "classification" and decode_n > 0:
        n = min(decode_n, len(valid_set))
        subset = D.EncodedDataset(valid_set.src[:n], valid_set.tgt[:n], valid_set.task)
        hyps = predict_seq2seq(model, subset, toks.tgt, device=device, max_tgt_len=args.max_tgt_len,
                               beam_size=beam_size, precision=precision)
        refs = valid_set.refs[:n]
        res.update(M.seq2seq_scores(hyps, refs, valid_set.task))
        res["hyps"] = hyps
    return res


def is_better(metric: str, new: float, best: float | None) -> bool:
    if best is None:
        return True
    return new > best if metric in HIGHER_IS_BETTER else new < best


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


@dataclass
class Progress:
    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch: int = 0  # batches of this epoch consumed
    best: float | None = None
    best_step: int = -1
    bad_evals: int = 0
    stopped_early: bool = False
    tokens: int = 0

    def to_dict(self):
        return dict(self.__dict__)


def main(argv=None) -> dict:
    """Train; returns the final validation metrics (also the last lines printed)."""
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "ablate":
        from . import ablate

        return ablate.main(argv[1:])
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)  # --threads is for this run, not for the caller's process


RUNS_DIR = Path("runs")
# What a training run writes into its folder: `train` itself, and `evaluate --checkpoint RUN`
# (metrics.<split>.json, predictions.<split>.jsonl, attention.<split>.<i>.png).
RUN_FILE_PATTERNS = ("last.pt", "best.pt", "step_*.pt", "log.txt", "metrics.*", "train.csv", "valid.csv",
                     "predictions.*.jsonl", "attention.*.png", "config.json", "args.json", "tokenizer*.json")
RUN_SUBDIRS = ("plots", "tb")


def run_files(out: Path) -> list[str]:
    """The files of an earlier run in `out`, checkpoints first (empty when there is none)."""
    if not out.is_dir():
        return []
    found = (p.name for pattern in RUN_FILE_PATTERNS for p in sorted(out.glob(pattern)) if p.is_file())
    return list(dict.fromkeys(found))


def _fresh_run_folder(args, dist_: Dist) -> Path:
    """The folder of a new (not resumed) run. Never writes into an earlier run unless told to:
    an explicit --out holding a run is refused (or, with --overwrite, emptied of that run's
    files first); without --out every run gets its own runs/<date>-<time>, and runs/latest is
    pointed at it. Rank 0 decides; the barrier / broadcast keep the other ranks from seeing a
    folder rank 0 has already started writing."""
    if args.out is not None:
        out = Path(args.out)
        held = run_files(out)
        if held and not args.overwrite:
            shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
            raise SystemExit(f"--out {out} already holds a training run ({shown}); pass --resume to continue "
                             f"it, --overwrite to replace it, or another --out")
        if held and dist_.main:
            import shutil

            for name in held:
                (out / name).unlink()
            for sub in RUN_SUBDIRS:
                shutil.rmtree(out / sub, ignore_errors=True)
        dist_.barrier()
        return out
    name = [None]
    if dist_.main:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name[0] = next(n for n in [stamp] + [f"{stamp}-{i}" for i in range(2, 1000)] if not run_files(RUNS_DIR / n))
        out = RUNS_DIR / name[0]
        out.mkdir(parents=True, exist_ok=True)
        latest, tmp = RUNS_DIR / "latest", RUNS_DIR / f".latest.{os.getpid()}"
        try:  # atomic: a new link renamed over the old one
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(out.name, target_is_directory=True)
            os.replace(tmp, latest)
        except OSError:  # no symlinks here, or runs/latest is a real folder: leave it alone
            tmp.unlink(missing_ok=True)
    if dist_.on:
        dist.broadcast_object_list(name, src=0)
    args.out = str(RUNS_DIR / name[0])
    return Path(args.out)


def _train(args) -> dict:
    # --resume without --out continues the newest run (runs/latest).
    out = Path(args.out) if args.out is not None else RUNS_DIR / "latest"

    resume_ckpt = None
    if args.resume:
        path = find_checkpoint(out if args.resume == "last" else args.resume, prefer="last")
        resume_ckpt = load_checkpoint(path)
        saved = resume_ckpt["args"]
        for k, v in saved.items():  # the run's own arguments, except flags given now
            if k not in args.explicit and k not in ("resume", "out"):
                setattr(args, k, tuple(v) if k == "adam_betas" else v)
        args.resume_path = str(path)

    dist_, device = setup_distributed(args.device)
    if resume_ckpt is None:
        out = _fresh_run_folder(args, dist_)
    else:
        out = Path(os.path.realpath(out)) if args.out is None else out
        args.out = str(out)
    source = D.resolve_source(args.dataset, args.data, args.task)
    task = source.task
    fill_defaults(args, task, source.kind == "synthetic")
    if args.precision == "auto":
        args.precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if args.precision != "fp32" and device.type != "cuda":
        raise SystemExit(f"--precision {args.precision} needs a GPU; use fp32 on {device.type}")

    if args.threads:
        torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    resume_step = resume_ckpt["progress"]["step"] if resume_ckpt else None
    log = Logger(out, dist_.main, args.tensorboard, resume_step)
    log.info(f"device {device}{f' x{dist_.world} (DDP)' if dist_.on else ''} | task {task} | data "
             f"{source.kind}:{source.folder or source.name} | precision {args.precision}")

    # Data and tokenizers.
    train_ex, valid_ex = load_data(args, source, log)
    if resume_ckpt is not None:
        toks = TokenizerPair.from_dict(resume_ckpt["tokenizers"])
    else:
        toks = make_tokenizers(args, task, train_ex, out, dist_, log)
    train_set, st = D.encode_examples(train_ex, task, toks.src, toks.tgt, args.max_src_len, args.max_tgt_len)
    log.info(f"train: {st} (policy: keep the first max_src_len-1 source tokens + EOS, the first "
             f"max_tgt_len-1 target tokens)")
    valid_set, sv = D.encode_examples(valid_ex, task, toks.src, toks.tgt, args.max_src_len, args.max_tgt_len)
    log.info(f"valid: {sv}")
    num_classes = None
    if task == "classification":
        num_classes = max(2, max(int(e.tgt) for e in train_ex) + 1, max(int(e.tgt) for e in valid_ex) + 1)

    # Model, optimizer, schedule.
    if resume_ckpt is not None:
        cfg = ModelConfig.from_dict(resume_ckpt["config"])
        if "kernel" in args.explicit:
            cfg.kernel = args.kernel
    else:
        cfg = model_config(args, task, toks, num_classes)
    model = build_model(cfg).to(device)
    if dist_.main:
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
        (out / "args.json").write_text(json.dumps(_jsonable(args), indent=2) + "\n", encoding="utf-8")
    log.info(f"model: {type(model).__name__} {count_parameters(model):,} parameters | preset {args.preset} | "
             f"d_model {cfg.d_model} heads {cfg.n_heads} layers {cfg.n_encoder_layers}+{cfg.n_decoder_layers} "
             f"d_ff {cfg.d_ff} norm {cfg.norm} pos_encoding {cfg.pos_encoding} | kernel "
             f"{cfg.kernel} -> {model.kernel_for(device) if hasattr(model, 'kernel_for') else cfg.kernel}")
    net = model
    if dist_.on:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = D.BucketBatchSampler(train_set.lengths(), batch_size=args.batch_size, max_tokens=args.max_tokens,
                                   shuffle=True, seed=args.seed, num_replicas=dist_.world, rank=dist_.rank)
    # A private generator: DataLoader draws its base seed from it, not from the global RNG, so
    # creating an iterator mid-epoch on resume leaves dropout's random stream unchanged.
    loader = torch.utils.data.DataLoader(train_set, batch_sampler=sampler, collate_fn=D.collate,
                                         num_workers=args.num_workers, pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(args.seed))
    steps_per_epoch = math.ceil(sampler.batches_per_epoch(0) / args.grad_accum)
    total_steps = args.max_steps or steps_per_epoch * (args.epochs or 1)
    if args.epochs and args.max_steps:
        total_steps = min(args.max_steps, steps_per_epoch * args.epochs)
    optimizer = build_optimizer(model, args.lr, args.weight_decay, args.adam_betas, args.adam_eps,
                                fused=device.type == "cuda")
    metric_mode = "max" if args.best_metric in HIGHER_IS_BETTER else "min"
    scheduler = build_scheduler(optimizer, args.schedule, warmup=args.warmup_steps, total=total_steps,
                                min_lr=args.min_lr, peak=args.lr, metric_mode=metric_mode, patience=args.plateau_patience)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    prog = Progress()
    if resume_ckpt is not None:
        model.load_state_dict(resume_ckpt["model"])
        optimizer.load_state_dict(resume_ckpt["optimizer"])
        scheduler.load_state_dict(resume_ckpt["scheduler"])
        if resume_ckpt.get("scaler"):
            scaler.load_state_dict(resume_ckpt["scaler"])
        prog = Progress(**resume_ckpt["progress"])
        rng = resume_ckpt["rng"]
        set_rng_state(rng[dist_.rank] if isinstance(rng, list) and dist_.rank < len(rng) else rng)
        log.info(f"resumed from {args.resume_path}: step {prog.step}, epoch {prog.epoch + 1}, batch {prog.batch}")
    log.info(f"training: {sampler.batches_per_epoch(0)} batches/epoch ({'max_tokens ' + str(args.max_tokens) if args.max_tokens else ''}"
             f"{' ' if args.max_tokens and args.batch_size else ''}{'batch_size ' + str(args.batch_size) if args.batch_size else ''}"
             f", grad_accum {args.grad_accum}), {total_steps} steps, lr {args.lr:g} {args.schedule} warmup {args.warmup_steps}, "
             f"label smoothing {args.label_smoothing}")

    def checkpoint_state() -> dict:
        return {
            "version": 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict() if scaler.is_enabled() else {},
            "rng": _gather_rng(dist_), "progress": prog.to_dict(), "config": cfg.to_dict(),
            "args": _jsonable(args), "data": source.to_dict(), "tokenizers": toks.to_dict(),
            "task": task, "num_classes": num_classes,
        }

    state = {"validated": -1, "saved": -1}  # steps of the last validation / step checkpoint

    def save(kind: str) -> None:
        ckpt = checkpoint_state()  # every rank takes part (RNG gather); rank 0 writes
        if kind == "step":
            state["saved"] = prog.step
        if not dist_.main:
            return
        if kind == "best":
            save_checkpoint(out / "best.pt", ckpt)
            return
        save_checkpoint(out / f"step_{prog.step:07d}.pt", ckpt)
        save_checkpoint(out / "last.pt", ckpt)
        prune_checkpoints(out, args.keep_checkpoints)

    def run_validation() -> dict:
        res = {}
        state["validated"] = prog.step
        if dist_.main:
            res = validate(model, valid_set, toks, args, device, args.precision, args.eval_decode_examples)
            res.pop("hyps", None)
            log.row({"split": "valid", "step": prog.step, "epoch": prog.epoch + 1, **res})
            log.info(f"valid step {prog.step}: {format_metrics(res)}")
            metric = res.get(args.best_metric)
            if metric is None:
                raise SystemExit(f"--best-metric {args.best_metric} is not computed here; have {sorted(res)}")
            if is_better(args.best_metric, metric, prog.best):
                prog.best, prog.best_step, prog.bad_evals = metric, prog.step, 0
            else:
                prog.bad_evals += 1
            if args.patience and prog.bad_evals >= args.patience:
                prog.stopped_early = True
                log.info(f"early stopping: {args.best_metric} did not improve for {args.patience} evaluations "
                         f"(best {prog.best:.4f} at step {prog.best_step})")
        _sync_progress(prog, dist_)
        if args.schedule == "plateau":
            scheduler.step(prog.best if prog.best is not None else 0.0)
        if prog.best_step == prog.step:
            save("best")
        model.train()
        return res

    # The loop: groups of grad_accum batches, one optimizer step per group.
    model.train()
    bar = tqdm(total=total_steps, initial=prog.step, disable=not dist_.main or args.no_progress, desc="train",
               dynamic_ncols=True, mininterval=0.5)
    window = dict(loss=0.0, nll=0.0, tokens=0, t0=time.time())
    t_start = time.time()
    done = prog.step >= total_steps or prog.stopped_early
    while not done:
        if args.epochs and prog.epoch >= args.epochs:
            break
        sampler.set_epoch(prog.epoch, start=prog.batch)
        batches = iter(loader)
        while True:
            group = list(islice(batches, args.grad_accum))
            if not group:
                break
            loss_sum, nll_sum, ntok = _train_step(net, group, task, device, args, scaler, optimizer, dist_)
            gnorm = _optimizer_step(model, optimizer, scaler, args.clip_norm)
            if args.schedule != "plateau":
                scheduler.step()
            prog.step += 1
            prog.batch += len(group)
            prog.tokens += ntok
            window["loss"] += loss_sum
            window["nll"] += nll_sum
            window["tokens"] += ntok
            lr = optimizer.param_groups[0]["lr"]
            if prog.step % args.log_every == 0 or prog.step == 1:
                dt = max(1e-9, time.time() - window["t0"])
                row = {"split": "train", "step": prog.step, "epoch": prog.epoch + 1,
                       "loss": window["loss"] / max(1, window["tokens"]), "nll": window["nll"] / max(1, window["tokens"]),
                       "lr": lr, "grad_norm": gnorm, "tokens_per_s": window["tokens"] * dist_.world / dt}
                log.row(row)
                unit = "ex" if task == "classification" else "tok"
                bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{lr:.2e}", **{f"{unit}/s": f"{row['tokens_per_s']:.0f}"})
                log.info(f"step {prog.step:>6} | epoch {prog.epoch + 1} | loss {row['loss']:.4f} | nll {row['nll']:.4f} | "
                         f"lr {lr:.2e} | grad {gnorm:.2f} | {row['tokens_per_s']:.0f} {unit}/s")
                window = dict(loss=0.0, nll=0.0, tokens=0, t0=time.time())
            bar.update(1)
            evaluated = False
            if args.eval_every and prog.step % args.eval_every == 0:
                run_validation()
                evaluated = True
            if (args.save_every and prog.step % args.save_every == 0) or (evaluated and not args.save_every):
                save("step")
            if prog.step >= total_steps or prog.stopped_early:
                done = True
                break
        if done:
            break
        # End of epoch.
        prog.epoch += 1
        prog.batch = 0
        if not args.eval_every:
            run_validation()
            if not args.save_every:
                save("step")
            done = prog.stopped_early
    bar.close()
    train_time = time.time() - t_start
    if state["validated"] != prog.step:
        run_validation()  # the last steps were not validated yet
    if state["saved"] != prog.step:
        save("step")

    final = {}
    if dist_.main:
        final = final_report(model, out, valid_set, valid_ex, toks, args, device, task, log, train_time, prog)
    log.close()
    if dist_.on:
        dist_.barrier()
        dist.destroy_process_group()
    return final


def _train_step(net, group, task, device, args, scaler, optimizer, dist_):
    """Forward/backward over a group of batches; the loss is normalised by the group's target
    tokens (examples for classification) so accumulation equals one big batch."""
    ntok = sum(b.num_tgt_tokens for b in group)
    loss_total, nll_total = 0.0, 0.0
    for i, batch in enumerate(group):
        batch = batch.to(device, non_blocking=True)
        sync = net.no_sync() if dist_.on and i < len(group) - 1 else nullcontext()
        with sync:
            with autocast_for(device, args.precision):
                if task == "classification":
                    logits = net(batch.src, batch.src_lengths)
                    loss = F.cross_entropy(logits.float(), batch.labels, reduction="sum",
                                           label_smoothing=args.label_smoothing)
                    nll = F.cross_entropy(logits.float().detach(), batch.labels, reduction="sum")
                else:
                    logits = net(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths)
                    loss, nll = label_smoothed_loss(logits.flatten(0, 1), batch.tgt_out.flatten(), args.label_smoothing)
            scaler.scale(loss / ntok).backward()
        loss_total += float(loss.detach())
        nll_total += float(nll.detach())
    return loss_total, nll_total, ntok


def _optimizer_step(model, optimizer, scaler, clip_norm: float) -> float:
    scaler.unscale_(optimizer)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm if clip_norm > 0 else float("inf"))
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return float(gnorm)


def _gather_rng(dist_: Dist):
    """Each rank's RNG state (dropout differs per rank); rank 0 stores the list."""
    state = rng_state()
    if not dist_.on:
        return state
    states = [None] * dist_.world
    dist.all_gather_object(states, state)
    return states


def _sync_progress(prog: Progress, dist_: Dist) -> None:
    """Rank 0 decides best / early stopping; the others follow."""
    if not dist_.on:
        return
    obj = [prog.to_dict()]
    dist.broadcast_object_list(obj, src=0)
    for k, v in obj[0].items():
        setattr(prog, k, v)


def final_report(model, out, valid_set, valid_ex, toks, args, device, task, log, train_time, prog) -> dict:
    """Evaluate best.pt on the validation split (greedy and beam), draw plots, print the summary."""
    best = out / "best.pt"
    if best.exists():
        model.load_state_dict(load_checkpoint(best)["model"])
    model.eval()
    n = args.eval_decode_examples if task != "classification" else len(valid_set)
    res = {"train_seconds": round(train_time, 1), "steps": prog.step, "best_step": prog.best_step}
    lines = []
    tf = teacher_forced(model, eval_loader(valid_set, max_tokens=max(args.max_tokens or 0, 4096)), device, args.precision)
    res.update(tf)
    if task == "classification":
        preds, _ = predict_labels(model, valid_set, device=device, precision=args.precision)
        res["accuracy"] = M.accuracy(preds, [e.tgt for e in valid_ex])
        lines.append(f"validation ({len(valid_set)} examples): {format_metrics(res)}")
    else:
        lines.append(f"validation ({len(valid_set)} examples, teacher forcing): loss {tf['loss']:.4f} | ppl {tf['ppl']:.2f}")
        n = min(n or len(valid_set), len(valid_set))
        subset = D.EncodedDataset(valid_set.src[:n], valid_set.tgt[:n], task)
        refs = valid_set.refs[:n]
        for beam in sorted({1, args.beam_size}):
            name = "greedy" if beam == 1 else f"beam{beam}"
            hyps = predict_seq2seq(model, subset, toks.tgt, device=device, max_tgt_len=args.max_tgt_len,
                                   beam_size=beam, precision=args.precision)
            scores = M.seq2seq_scores(hyps, refs, task)
            res[name] = scores
            lines.append(f"{name:>6} ({n} examples): {format_metrics(scores)}")
            if beam == 1:
                with open(out / "predictions.validation.jsonl", "w", encoding="utf-8") as f:
                    for e, h in zip(valid_ex[:n], hyps):
                        f.write(json.dumps({"id": e.id, "source": e.src, "reference": e.tgt, "prediction": h},
                                           ensure_ascii=False) + "\n")
                for e, h in list(zip(valid_ex, hyps))[:3]:
                    lines.insert(0, f"  example: {e.src[:80]!r} -> {h[:80]!r} (ref {str(e.tgt)[:80]!r})")
    log.row({"split": "final", "step": prog.step, **{k: v for k, v in res.items()}})
    (out / "metrics.final.json").write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    if not args.no_plots:
        from .plots import plot_attention, plot_curves, read_metrics

        plot_curves(read_metrics(out / "metrics.jsonl"), out / "plots" / "curves.png", title=str(out))
        idx = min(max(0, args.attention_example), len(valid_set) - 1)
        w, rows, cols, title = attention_map(model, valid_set, idx, toks, device=device, max_tgt_len=args.max_tgt_len)
        plot_attention(w, rows, cols, out / "plots" / "attention.png", title=f"{title}, validation example {idx}")
    best_txt = f"best.pt = step {prog.best_step}, {args.best_metric} {prog.best:.4f}" if prog.best is not None else ""
    log.info(f"done: {prog.step} steps in {train_time:.0f}s{' (early stop)' if prog.stopped_early else ''}; {best_txt}; "
             f"run folder {out}")
    for line in lines:
        log.info(line)
    return res


if __name__ == "__main__":
    main()
