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
import json
from collections import Counter
from pathlib import Path

from scratchformer import data as D
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run folder (its args.json and tokenizer*.json)")
    p.add_argument("--data", help="the folder holding the dataset's folder (default: the run's own --data, "
                                  "or SCRATCHFORMER_DATA)")
    p.add_argument("--steps", type=int, required=True, help="training steps (one batch each) to replay")
    p.add_argument("--pad-multiples", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--bpe-dropout", type=float, help="replay as if the run had this --bpe-dropout (default: its own)")
    args = p.parse_args(argv)
    cfg = TrainConfig.from_dict(json.loads((args.run / "args.json").read_text()))
    if cfg.task in D.ENCODER_ONLY:
        raise SystemExit(f"{args.run}: a {cfg.task} run: its batches have no target side to replay here")
    if cfg.grad_accum != 1:
        raise SystemExit(f"{args.run}: grad_accum {cfg.grad_accum}: a step is then several batches, not replayed here")
    folder = Path(args.data) / cfg.dataset if args.data else None
    source = D.resolve_source(cfg.dataset, str(folder) if folder else cfg.data)
    examples = D.load_split(source, "train", cfg.max_train_examples)
    files = sorted(args.run.glob("tokenizer*.json"))
    if not files:
        raise SystemExit(f"{args.run}: no tokenizer*.json")
    toks = TokenizerPair.load(files)
    if args.bpe_dropout is not None:
        cfg = dataclasses.replace(cfg, bpe_dropout=args.bpe_dropout)
    if cfg.bpe_dropout:
        encoded = D.ResegmentedDataset(examples, source.task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len,
                                       p=cfg.bpe_dropout, seed=cfg.seed)
    else:
        encoded, _ = D.encode_examples(examples, source.task, toks.src, toks.tgt, cfg.max_src_len, cfg.max_tgt_len)
    for m in args.pad_multiples:
        counts, pad = shapes(encoded, cfg, m, args.steps)
        captured = sum(c >= 2 for c in counts.values())
        replayed = args.steps - len(counts)
        print(f"pad multiple {m:3d}: {len(counts):5d} shapes ({len(counts) / args.steps:.1%} of the steps launched), "
              f"{captured:5d} captured, {replayed} of {args.steps} steps replayed ({replayed / args.steps:.1%}), "
              f"{pad:.1%} of the padded tokens padding")


if __name__ == "__main__":
    main()
