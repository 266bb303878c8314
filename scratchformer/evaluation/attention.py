"""The attention of one example, for a heatmap (`plots.plot_attention`): `evaluate --attention N`
and the trainer's plots/attention.png."""

from __future__ import annotations

import torch

from .. import data as D
from ..data.tokenizer import TokenizerPair
from ..model import BOS_ID, EOS_ID, Sampling
from .evaluate import autocast_for, decode_batch, decoding_name


@torch.no_grad()
def attention_map(model, dataset: D.EncodedDataset, index: int, tokenizers: TokenizerPair, *, device,
                  max_tgt_len: int = 64, max_tokens_shown: int = 60, precision: str = "fp32", beam_size: int = 1,
                  length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0,
                  sampling: Sampling | None = None, key: int | None = None, mbr: int = 0,
                  mbr_utility: str | None = None):
    """(weights (rows, cols) numpy, row labels, col labels, title) of example `index`.
    The model reads the whole example; the map shows its first `max_tokens_shown` tokens (the title
    says where it cuts). Seq2seq: the last decoder layer's cross-attention (mean over heads) over the
    model's own output, decoded as the evaluation decodes it (`decode_batch`: greedy, beam search
    with its options, or drawn with `sampling` keyed by `key` (default: `index`), and with mbr n the
    MBR choice among n of those; the title names which), so the rows are the prediction the evaluation
    wrote for it (decoded alone, not in its batch: the same, up to rounding where padding changes the
    sums, as in bf16). Classifier: the last encoder layer's self-attention ([CLS] first); extractive: the same
    without [CLS] (sentence markers: <s>)."""
    model.eval()
    _, src, _ = dataset[index]
    src = torch.as_tensor(src, dtype=torch.int64, device=device)[None]
    n, k = src.shape[1], max_tokens_shown
    src_len = torch.tensor([n], device=device)
    src_labels = tokenizers.src.token_strings(src[0, :k].tolist())
    cut = f", its first {k} of {n} tokens" if n > k else ""
    with autocast_for(device, precision):
        if dataset.task == "classification":
            _, weights = model(src, src_len, return_attention=True)
            w = weights[-1][0].mean(0).float().cpu().numpy()[: k + 1, : k + 1]  # (L+1, L+1)
            labels = ["[CLS]"] + src_labels
            return w, labels, labels, f"classifier self-attention, last layer (mean over heads{cut})"
        if dataset.task == "extractive":
            _, weights = model(src, src_len, (src[0] == BOS_ID).nonzero()[:, 0][None], return_attention=True)
            w = weights[-1][0].mean(0).float().cpu().numpy()[:k, :k]  # (L, L)
            return w, src_labels, src_labels, f"extractive encoder self-attention, last layer (mean over heads{cut})"
        keys = None if sampling is None else torch.tensor([index if key is None else key], device=device)
        hyp = decode_batch(model, src, src_len, dataset.task, max_tgt_len=max_tgt_len, beam_size=beam_size,
                           length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                           sampling=sampling, keys=keys, mbr=mbr, mbr_utility=mbr_utility,
                           tokenizer=tokenizers.tgt)[0].tolist()
        if EOS_ID in hyp:
            hyp = hyp[: hyp.index(EOS_ID) + 1]
        tgt_in = torch.tensor([[BOS_ID] + hyp[:-1]], device=device)
        _, weights = model(src, src_len, tgt_in, torch.tensor([tgt_in.shape[1]], device=device), need_weights=True)
    w = weights[-1][0].mean(0).float().cpu().numpy()[:, :k]  # (Lt, Ls)
    name = decoding_name(beam_size, sampling, mbr, mbr_utility)
    return (w, tokenizers.tgt.token_strings(hyp), src_labels,
            f"decoder cross-attention over its {name} output, last layer (mean over heads{cut})")
