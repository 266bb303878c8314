"""How many distinct batch shapes would a run's training take, and so how many of its steps would
`train --cuda-graphs` replay? Replays a run's batching on the CPU: its data, its tokenizer (the run
folder's), its token budget and seed, the trainer's sampler and collate, one `pad_multiple` at a time.

`--cuda-graphs` launches the first step of each shape, captures the second and replays it and every
later one (`training/cuda_graph.py`), so (steps - shapes) / steps are replayed, the captures among
them (the trainer's count, its log's last lines). The
seventh GPU window's SAMSum run reported 2,996 shapes, 1,221 captured, in 5,714 steps; this replay
of it gives the same counts, and what padding each batch's lengths up to a multiple would change:

    python scripts/graph_shapes.py results/samsum-gpu-5714 --data ../shared/data --steps 5714 --pad-multiples 1 8 16 32
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import Counter
from pathlib import Path

from scratchformer import cli
from scratchformer import data as D
from scratchformer.data.files import read_json
from scratchformer.data.tokenizer import TokenizerPair
from scratchformer.training.config import TrainConfig


def shapes(encoded: D.EncodedDataset, cfg: TrainConfig, multiple: int, steps: int) -> tuple[Counter, float]:
    """(batches per `Batch.shape`, the key the trainer's graphs are kept by, over `steps` batches;
    the fraction of the padded source and target tokens that are padding), batched by the trainer's
    sampler and collate."""
    sampler = D.BucketBatchSampler(encoded.lengths, batch_size=cfg.batch_size, max_tokens=cfg.max_tokens,
                                   shuffle=True, seed=cfg.seed, pad_multiple=multiple)
    counts: Counter = Counter()
    real = padded = epoch = 0
    while sum(counts.values()) < steps:
        encoded.set_epoch(epoch)  # a --bpe-dropout run's texts are segmented anew each epoch
        sampler.set_epoch(epoch)
        epoch += 1
        for indices in sampler:
            batch = D.collate([encoded[i] for i in indices], pad_multiple=multiple)
            counts[batch.shape] += 1
            real += int(batch.src_lengths.sum() + batch.tgt_lengths.sum())
            padded += batch.src.numel() + batch.tgt_in.numel()
            if sum(counts.values()) == steps:
                break
    return counts, 1 - real / padded


def run_task(run: Path, cfg: TrainConfig) -> str | None:
    """The task a run trained: its --task, else its model's kind (config.json: a classifier's classes,
    an extractor); None for a seq2seq model whose task args.json leaves to the data (inferred)."""
    model = read_json(run / "config.json") if (run / "config.json").is_file() else {}
    return cfg.task or ("extractive" if model.get("extractive") else
                        "classification" if model.get("num_classes") else None)


def run_source(run: Path, cfg: TrainConfig, data: str | None) -> D.DataSource:
    """The run's data, as its training read it, or its folder under `data` (the folder of a --data
    run, the dataset of a --dataset one)."""
    name = Path(cfg.data).name if cfg.data else cfg.dataset
    if data and name == "synthetic" and not cfg.data:
        raise cli.UsageError(f"--data {data}: {run} trained on the synthetic task, which has no data folder")
    return D.resolve_source(cfg.dataset, str(Path(data) / name) if data else cfg.data, cfg.task)


def load_encoded(run: Path, cfg: TrainConfig, source: D.DataSource):
    """The run's training split encoded by its tokenizer (run/tokenizer*.json), as the trainer did."""
    examples = D.load_split(source, "train", cfg.max_train_examples)
    files = sorted(run.glob("tokenizer*.json"))
    if not files:
        raise cli.UsageError(f"{run}: no tokenizer*.json (the run's tokenizer, which its batches were cut by)")
    toks = TokenizerPair.load(files)
    if cfg.bpe_dropout:
        return D.ResegmentedDataset(examples, source.task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len,
                                    p=cfg.bpe_dropout, seed=cfg.seed)
    return D.encode_examples(examples, source.task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len)[0]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run folder (its args.json, config.json and tokenizer*.json)")
    p.add_argument("--data", help="the folder holding the dataset's folder (default: the run's own --data, "
                                  "or SCRATCHFORMER_DATA)")
    p.add_argument("--steps", type=int, required=True, help="training steps (one batch each) to replay")
    p.add_argument("--pad-multiples", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--bpe-dropout", type=float, help="replay as if the run had this --bpe-dropout (default: its own)")
    cli.add_debug_flag(p)
    args = p.parse_args(argv)
    for flag, value in (("--steps", args.steps), *(("--pad-multiples", m) for m in args.pad_multiples)):
        if value < 1:
            raise cli.UsageError(f"{flag} must be >= 1, got {value}")
    if not args.run.is_dir():
        raise cli.UsageError(f"{args.run}: {'a file, not a' if args.run.exists() else 'no such'} run folder")
    cfg = TrainConfig.from_dict(read_json(args.run / "args.json"))
    task = run_task(args.run, cfg)
    source = None if task in D.ENCODER_ONLY else run_source(args.run, cfg, args.data)
    if task in D.ENCODER_ONLY or source.task in D.ENCODER_ONLY:  # the data's task: a run's with task None
        raise cli.UsageError(f"{args.run}: a {task or source.task} run: its batches have no target side to "
                             "replay here")
    if cfg.grad_accum != 1:
        raise cli.UsageError(f"{args.run}: grad_accum {cfg.grad_accum}: a step is then several batches, not replayed "
                             "here")
    if args.bpe_dropout is not None:
        cfg = dataclasses.replace(cfg, bpe_dropout=args.bpe_dropout)
    encoded = load_encoded(args.run, cfg, source)
    for m in args.pad_multiples:
        counts, pad = shapes(encoded, cfg, m, args.steps)
        captured = sum(c >= 2 for c in counts.values())
        replayed = args.steps - len(counts)
        print(f"pad multiple {m:3d}: {len(counts):5d} shapes ({len(counts) / args.steps:.1%} of the steps launched), "
              f"{captured:5d} captured, {replayed} of {args.steps} steps replayed ({replayed / args.steps:.1%}), "
              f"{pad:.1%} of the padded tokens padding")


if __name__ == "__main__":
    sys.exit(cli.run(main))
