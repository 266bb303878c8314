"""Does a seq2seq checkpoint read its source? Two measures on the first N validation examples:

- the decoder's loss (mean NLL per target token, teacher forcing) with each example's own source,
  and with the sources rolled by one (every target paired with another example's source): a
  decoder that ignores the encoder scores the same on both;
- the encoder output of the first example: the norm of its mean over positions ("common") and the
  mean distance of each position from that mean ("spread"), after the embedding and after each
  encoder layer. A collapsed encoder gives every position the same vector: spread near 0; the
  layers show where it is lost (without --copy, a CNN/DM encoder's spread fell layer by layer,
  17.6 -> 14.4 -> 10.6 -> 3.8 -> 0.7 at step 300, as near-uniform self-attention added one large
  vector to every position).

    python scripts/source_use.py --checkpoint runs/samsum/best.pt --data ../shared/data/samsum -n 24
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from scratchformer import cli
from scratchformer import data as D
from scratchformer.data.batching import collate, encode_examples
from scratchformer.device import resolve_device
from scratchformer.evaluation.loading import load_run


def spread(memory: torch.Tensor, length: int) -> tuple[float, float]:
    m = memory[0, :length]
    common = m.mean(0)
    return common.norm().item(), (m - common).norm(dim=-1).mean().item()


def load(a: argparse.Namespace):
    """(model, checkpoint, the first -n validation examples encoded); UsageError for a model without
    a decoder, data of another task than the model's, or fewer than two examples to roll."""
    device = resolve_device(a.device)  # names a --device this machine lacks (torch: an AssertionError)
    if device.type == "cpu":
        torch.set_num_threads(1)
    model, toks, ckpt = load_run(a.checkpoint, device, "eager")
    if ckpt["task"] in D.ENCODER_ONLY:
        raise cli.UsageError(f"{a.checkpoint} is a {ckpt['task']} model: it has no decoder to check")
    source = D.resolve_source("synthetic", a.data, None)
    if source.task != ckpt["task"]:
        raise cli.UsageError(f"{a.checkpoint} is a {ckpt['task']} model and --data {a.data} holds {source.task} data: "
                             "give the data it was trained for")
    examples = D.load_split(source, "validation", a.n)
    if len(examples) < 2:
        raise cli.UsageError(f"--data {a.data}: its validation split holds {len(examples)} example(s); the sources are "
                             "rolled among the examples, which needs at least 2")
    args = ckpt["args"]
    ds, _ = encode_examples(examples, ckpt["task"], toks.src, toks.tgt, args["max_src_len"], args["max_tgt_len"])
    return model, ckpt, ds, device


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--data", required=True, help="a data folder with a validation split")
    p.add_argument("-n", type=int, default=24, help="validation examples (at least 2)")
    p.add_argument("--device", help="where the eager model runs (default: cuda where there is one; on one CPU thread "
                   "a base model took over 120 s for 64 CNN/DM articles)")
    cli.add_debug_flag(p)
    a = p.parse_args(argv)
    if a.n < 2:
        raise cli.UsageError(f"-n must be at least 2, got {a.n} (the sources are rolled among the examples)")
    model, ckpt, ds, device = load(a)
    b = collate([ds[i] for i in range(len(ds))]).to(device)
    roll = torch.roll(torch.arange(len(ds), device=device), 1)

    @torch.no_grad()
    def nll(src, lengths):
        logits = model(src, lengths, b.tgt_in, b.tgt_lengths)
        return F.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=D.PAD_ID).item()

    own, other = nll(b.src, b.src_lengths), nll(b.src[roll], b.src_lengths[roll])
    stages = []  # (name, output) after the embedding and after each encoder layer
    hooks = [model.encoder.embedding.register_forward_hook(lambda m, i, out: stages.append(("embedding", out)))]
    for n, layer in enumerate(model.encoder.layers):
        hooks.append(layer.register_forward_hook(lambda m, i, out, n=n: stages.append((f"layer {n + 1}", out[0]))))
    with torch.no_grad():
        common, dev = spread(model.encode(b.src, b.src_lengths), int(b.src_lengths[0]))
    for h in hooks:
        h.remove()
    print(f"{a.checkpoint} (step {ckpt['progress']['step']}), {len(ds)} validation examples")
    print(f"  NLL/token: own source {own:.3f}, another example's source {other:.3f}, gap {other - own:.3f}")
    print(f"  encoder output, example 0: common {common:.2f}, spread {dev:.3f}")
    shown = ", ".join("{} {:.2f}/{:.2f}".format(name, *spread(out, int(b.src_lengths[0]))) for name, out in stages)
    print(f"  common/spread by stage: {shown}")


if __name__ == "__main__":
    sys.exit(cli.run(main))
