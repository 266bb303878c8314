"""Scoring given outputs: each (source, target) pair's log-probability under a model, as fairseq's
--score-reference, Sockeye's `score` and Marian's scorer give it: to filter parallel data, to rerank
candidates (`generate --json --nbest`'s, or another system's), or to read a model's confidence in a
reference.

A pair's score is on generate's scale: the sum of log p(token) over the target's tokens (its EOS
counted), PAD and BOS ruled out of each distribution as decoding rules them out, divided by
tokens ** length_penalty (1: the mean log-probability). So scoring a beam's hypothesis gives the
score `generate --json` printed for it, when it ended with EOS and its input was not cut to the
training max_src_len (a hypothesis stopped at its cap was scored without an EOS). Pairs longer than
the model's positions are refused, not cut: a cut target's score would be another sentence's.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import data as D
from ..model import BOS_ID, PAD_ID
from .evaluate import autocast_for, eval_loader
from .options import OptionError

SCORED_TASKS = ("translation", "summarization")  # the tasks whose outputs are token sequences


def target_log_probs(model, src, src_lengths, tgt_in, tgt_out, tgt_lengths) -> torch.Tensor:
    """(B,) float64: each row's sum of log p(tgt_out token) under teacher forcing, PAD and BOS ruled out of
    every step's distribution (as decoding rules them out); the PAD positions of tgt_out add nothing."""
    logits = model(src, src_lengths, tgt_in, tgt_lengths).float()
    logits[..., [PAD_ID, BOS_ID]] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt_out[..., None])[..., 0]
    return logp.masked_fill(tgt_out == PAD_ID, 0.0).double().sum(1)


def check_task(task: str) -> None:
    """OptionError for a model whose outputs are no token sequence (a classifier, an extractive summarizer)."""
    if task not in SCORED_TASKS:
        raise OptionError(f"scoring reads a target sequence's log-probability; this model is {task} (scoring takes "
                          f"a model of {' or '.join(SCORED_TASKS)})")


def encode_pairs(examples: list[D.Example], task: str, toks, limit: int, source: str) -> D.EncodedDataset:
    """The pairs tokenized as training encodes them; a DataError naming the first pair (its place in
    `source`, and its id) whose source or target, its EOS included, holds more than `limit` tokens."""
    check_task(task)
    dataset, _ = D.encode_examples(examples, task, toks.src, toks.tgt, 2 ** 31, 2 ** 31)  # nothing cut
    src_len, tgt_len = dataset.src.lengths(), dataset.tgt.lengths() + 1  # the target's EOS counted
    over = np.flatnonzero((src_len > limit) | (tgt_len > limit))
    if len(over):
        i = int(over[0])
        name = f" (id {examples[i].id!r})" if examples[i].id is not None else ""
        raise D.DataError(f"{source}: pair {i + 1}{name} holds {src_len[i]} source and {tgt_len[i]} target tokens, "
                          f"more than the model's {limit} positions (EOS included; {len(over)} pair(s) in all): a cut "
                          "target's score would be another sentence's; leave them out")
    return dataset


@torch.no_grad()
def score_pairs(model, dataset: D.EncodedDataset, *, device, length_penalty: float = 1.0,
                max_tokens: int | None = 4096, batch_size: int | None = None, precision: str = "fp32") -> list[dict]:
    """Each pair's {"score", "log_prob", "tokens"} in dataset order: log_prob the sum of its target's
    log-probabilities (`target_log_probs`), tokens their number (EOS counted), score log_prob / tokens **
    length_penalty; the floats rounded to 6 decimals, as generate prints them."""
    model.eval()
    out: list[dict | None] = [None] * len(dataset)
    for batch in eval_loader(dataset, max_tokens=max_tokens, batch_size=batch_size):
        batch = batch.to(device)
        with autocast_for(device, precision):
            sums = target_log_probs(model, batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_out,
                                    batch.tgt_lengths)
        tokens = (batch.tgt_out != PAD_ID).sum(1)
        for i, s, n in zip(batch.ids.tolist(), sums.tolist(), tokens.tolist(), strict=True):
            out[i] = {"score": round(s / n ** length_penalty, 6), "log_prob": round(s, 6), "tokens": n}
    return out
