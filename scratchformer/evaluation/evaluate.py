"""Evaluation as a library: teacher-forced loss and perplexity, decoding and its metrics, outputs on disk.

`evaluate(model, dataset, examples, tokenizers, ...)` is what `python -m scratchformer.evaluate`
and the trainer's final report both call. Translation: BLEU, chrF (sacrebleu on detokenized
text), exact match; summarization adds ROUGE-1/2/L/Lsum (rouge-score, stemming on), scored the
same on an extractive summarizer's picked sentences; classification: accuracy; every task: loss
and perplexity under teacher forcing (an extractive model's: of its sentences' binary cross-entropy).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import data as D
from ..checkpoint import write_lines_atomic
from ..data.extractive import MAX_ORACLE_SENTENCES, pick_sentences, selection_name
from ..data.tokenizer import TokenizerPair
from ..model import PAD_ID, Sampling, beam_search, beam_search_nbest, greedy_decode, sample_decode
from . import metrics as M
from .mbr import mbr_pick
from .options import check_min_len

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # precision name -> autocast's dtype


def autocast_for(device: torch.device, precision: str, cache: bool = True):
    """The autocast context of a precision name ("fp32", "bf16", "fp16"); `cache`: keep cast
    weights for the context's life (off inside a CUDA graph's capture)."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, cache_enabled=cache)


def eval_loader(dataset: D.EncodedDataset, max_tokens: int | None = 4096, batch_size: int | None = None,
                num_workers: int = 0, pin_memory: bool = False):
    """Length-sorted, unshuffled batches (outputs are put back in dataset order by example id)."""
    sampler = D.BucketBatchSampler(dataset.lengths(), max_tokens=max_tokens, batch_size=batch_size,
                                   shuffle=False, pool_batches=10**9)
    return D.make_loader(dataset, sampler, num_workers=num_workers, pin_memory=pin_memory)


def loss_terms(model, batch: D.Batch):
    """Logits and targets of a batch: seq2seq (B*Lt, V) vs (B*Lt,), classifier (B, C) vs (B,),
    extractive (B, S) vs (B, S)."""
    if batch.sentences is not None:
        return model(batch.src, batch.src_lengths, batch.sentences), batch.labels
    if batch.labels is not None:
        return model(batch.src, batch.src_lengths), batch.labels
    logits = model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths)
    return logits.flatten(0, 1), batch.tgt_out.flatten()


def seq2seq_loss(model, batch: D.Batch, epsilon: float = 0.0):
    """An encoder-decoder batch's (loss sum, NLL sum), label smoothing epsilon, from the model
    itself (`forward(target=)`: the backend's fused generator + loss, never the whole logits on
    the triton backend); None for a batch of another task."""
    if batch.sentences is not None or batch.labels is not None:
        return None
    return model(batch.src, batch.src_lengths, batch.tgt_in, batch.tgt_lengths, target=batch.tgt_out,
                 label_smoothing=epsilon)


@torch.no_grad()
def teacher_forced(model, loader, device, precision: str = "fp32") -> dict:
    """Mean token NLL (no label smoothing) and perplexity; accuracy for classification."""
    model.eval()
    nll, n, correct = 0.0, 0, 0
    classify = loader.dataset.task == "classification"
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        with autocast_for(device, precision):
            sums = seq2seq_loss(model, batch)  # seq2seq: the model's own NLL, as it trains
            if sums is None:
                logits, target = loss_terms(model, batch)
        if sums is not None:
            nll += float(sums[1])
            n += int((batch.tgt_out != PAD_ID).sum())
            continue
        if batch.sentences is not None:  # padded slots (label -1) left out
            keep = target >= 0
            nll += float(F.binary_cross_entropy_with_logits(logits.float()[keep], target[keep].float(),
                                                            reduction="sum"))
            n += int(keep.sum())
        else:  # classification: labels include 0 == PAD_ID, nothing to ignore
            nll += float(F.cross_entropy(logits.float(), target, reduction="sum"))
            n += len(batch)
            correct += int((logits.argmax(-1) == target).sum())
    out = {"loss": nll / max(1, n), "ppl": M.perplexity(nll, max(1, n))}
    if classify:
        out["accuracy"] = 100.0 * correct / max(1, n)
    return out


# The decoding cap's default length ratio per task: up to ratio * Ls + 10 tokens (Ls: the row's own source
# length, so an output does not depend on its batch); a task without one (summarization) decodes up to max_tgt_len.
LEN_RATIO = {"translation": 2.0}


def decode_max_len(task: str, src_lengths: torch.Tensor, max_tgt_len: int,
                   len_ratio: float | None = None, min_len: int = 0) -> int | torch.Tensor:
    """Each row's cap, (B,): ceil(len_ratio * Ls) + 10 tokens, never more than max_tgt_len nor fewer than
    min_len (--min-len's outputs hold that many: a short source's cap ended them sooner, unsaid); len_ratio
    None = the task's default (`LEN_RATIO`: translation 2), 0 = no ratio (max_tgt_len, one int for every row)."""
    ratio = LEN_RATIO.get(task) if len_ratio is None else len_ratio
    if ratio:
        return (torch.ceil(src_lengths.double() * ratio).long() + 10).clamp(min(max(1, min_len), max_tgt_len),
                                                                            max_tgt_len)
    return max_tgt_len


def decode_batch(model, src, src_lengths, task: str, *, max_tgt_len: int, beam_size: int = 1,
                 length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0,
                 len_ratio: float | None = None, nbest: int = 0, sampling: Sampling | None = None,
                 keys: torch.Tensor | None = None, mbr: int = 0, mbr_utility: str | None = None,
                 tokenizer=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One batch's outputs, (B, T) token ids: beam search (beam_size > 1) or greedy, or with `sampling`
    drawn (`sample_decode`, each row's draws keyed by `keys`, (B,)), each row capped by `decode_max_len`.
    What `predict_seq2seq` decodes, and the attention map's rows. nbest n > 0: the search's n best
    hypotheses and their scores, ((B, n, T), (B, n)) (`beam_search_nbest`; beam size 1 is greedy's
    search), or n samples in the order drawn. mbr n > 0: each row's MBR choice (`mbr_pick` by
    `mbr_utility`, default chrf, on the texts of `tokenizer`) among n such candidates, as one output,
    with nbest its one hypothesis and score."""
    if mbr:
        if tokenizer is None:
            raise ValueError("MBR compares the candidates' texts: give the tokenizer that decodes them")
        tokens, scores = decode_batch(model, src, src_lengths, task, max_tgt_len=max_tgt_len, beam_size=beam_size,
                                      length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                                      len_ratio=len_ratio, nbest=mbr, sampling=sampling, keys=keys)
        B, n, T = tokens.shape
        texts = tokenizer.decode_batch(tokens.reshape(B * n, T).tolist())
        rows = torch.arange(B, device=tokens.device)
        pick = torch.tensor([mbr_pick(texts[b * n:(b + 1) * n], mbr_utility or "chrf") for b in range(B)],
                            device=tokens.device)
        return (tokens[rows, pick][:, None], scores[rows, pick][:, None]) if nbest else tokens[rows, pick]
    max_len = decode_max_len(task, src_lengths, max_tgt_len, len_ratio, min_len)
    if sampling is not None:
        tokens, scores = sample_decode(model, src, src_lengths, max_len=max_len, n=max(nbest, 1), keys=keys,
                                       no_repeat_ngram=no_repeat_ngram, min_len=min_len, **asdict(sampling))
        return (tokens, scores) if nbest else tokens[:, 0]  # one sample: trimmed already
    if nbest:
        return beam_search_nbest(model, src, src_lengths, nbest=nbest, beam_size=beam_size, max_len=max_len,
                                 length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len)
    if beam_size > 1:
        return beam_search(model, src, src_lengths, beam_size=beam_size, max_len=max_len,
                           length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len)
    return greedy_decode(model, src, src_lengths, max_len=max_len, no_repeat_ngram=no_repeat_ngram, min_len=min_len)


def _hypotheses(tokenizer, tokens: torch.Tensor, scores: torch.Tensor) -> list[list[dict]]:
    """(B, n, T) hypotheses and (B, n) scores -> per row [{"output", "score"}], best first; past the first,
    those of score -inf (none found: a vocabulary smaller than n) left out; a score -inf is None (JSON has
    no infinity), the others rounded to 6 decimals (fp32 log-probabilities)."""
    B, n, T = tokens.shape
    texts, scores = tokenizer.decode_batch(tokens.reshape(B * n, T).tolist()), scores.tolist()
    return [[{"output": texts[b * n + k], "score": round(scores[b][k], 6) if scores[b][k] > float("-inf") else None}
             for k in range(n) if k == 0 or scores[b][k] > float("-inf")] for b in range(B)]


@torch.no_grad()
def predict_seq2seq(model, dataset: D.EncodedDataset, tokenizer, *, device, max_tgt_len: int, beam_size: int = 1,
                    length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0,
                    max_tokens: int | None = 4096, precision: str = "fp32", progress: bool = False,
                    batch_size: int | None = None, len_ratio: float | None = None, on_batch=None,
                    nbest: int = 0, sampling: Sampling | None = None, keys: Sequence[int] | None = None,
                    mbr: int = 0, mbr_utility: str | None = None) -> list:
    """Decoded, detokenized outputs in dataset order. beam_size 1 = greedy; no_repeat_ngram n > 0:
    no n-gram twice in an output; min_len m: at least m tokens before EOS (`model.decoding`).
    `len_ratio`: see `decode_max_len` (a row's cap is at least min_len).
    `on_batch(indices, outputs)`, if given, is called after every batch. nbest n > 0: each output is
    instead the search's n best hypotheses, best first, [{"output", "score"}] (`beam_search_nbest`'s
    score; `_hypotheses`). `sampling`: outputs drawn (`decode_batch`), example i's draws keyed by
    keys[i] (`model.row_key` of its id; default: i), so that they depend on no batch. mbr n > 0: each
    output is the MBR choice (`mbr.mbr_pick`, by `mbr_utility`, default chrf) among n candidates, the
    search's n best or n samples (with nbest, [{"output", "score"}] of it alone)."""
    check_min_len(min_len, max_tgt_len)
    model.eval()
    out: list[str | None] = [None] * len(dataset)
    loader = eval_loader(dataset, max_tokens=max_tokens, batch_size=batch_size)
    if progress:
        from tqdm import tqdm

        loader = tqdm(loader, desc="decode", leave=False, dynamic_ncols=True)
    for batch in loader:
        batch = batch.to(device)
        ids = batch.ids.tolist()
        batch_keys = None if sampling is None else torch.tensor([keys[i] for i in ids] if keys else ids, device=device)
        with autocast_for(device, precision):
            toks = decode_batch(model, batch.src, batch.src_lengths, dataset.task, max_tgt_len=max_tgt_len,
                                beam_size=beam_size, length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram,
                                min_len=min_len, len_ratio=len_ratio, nbest=nbest, sampling=sampling,
                                keys=batch_keys, mbr=mbr, mbr_utility=mbr_utility, tokenizer=tokenizer)
        texts = _hypotheses(tokenizer, *toks) if nbest else tokenizer.decode_batch(toks.tolist())
        for i, text in zip(ids, texts, strict=True):
            out[i] = text
        if on_batch is not None:
            on_batch(ids, texts)
    return out


@torch.no_grad()
def predict_labels(model, dataset: D.EncodedDataset, *, device, max_tokens: int | None = 8192, precision: str = "fp32",
                   batch_size: int | None = None, on_batch=None):
    """(predicted labels, their probabilities) in dataset order. `on_batch(indices, labels)`, if given,
    is called after every batch."""
    model.eval()
    preds, probs = [0] * len(dataset), [0.0] * len(dataset)
    for batch in eval_loader(dataset, max_tokens=max_tokens, batch_size=batch_size):
        batch = batch.to(device)
        with autocast_for(device, precision):
            p = torch.softmax(model(batch.src, batch.src_lengths).float(), dim=-1)
        conf, lab = p.max(-1)
        ids, labels = batch.ids.tolist(), lab.tolist()
        for i, y, c in zip(ids, labels, conf.tolist(), strict=True):
            preds[i], probs[i] = y, c
        if on_batch is not None:
            on_batch(ids, labels)
    return preds, probs


@torch.no_grad()
def predict_extracts(model, dataset: D.EncodedDataset, *, device, sentences: int | None = None,
                     words: int | None = None, block_trigrams: bool = True, max_tokens: int | None = 8192,
                     precision: str = "fp32", batch_size: int | None = None, on_batch=None) -> list[str]:
    """An extractive model's summaries in dataset order: each document's best-scored sentences,
    at most `sentences` of them (None: MAX_ORACLE_SENTENCES), fewer once they hold `words` words
    (`data.extractive.pick_sentences`, trigram blocking on), one per line, in document order.
    `on_batch(indices, summaries)`, if given, is called after every batch."""
    model.eval()
    k = sentences or MAX_ORACLE_SENTENCES
    out: list[str | None] = [None] * len(dataset)
    for batch in eval_loader(dataset, max_tokens=max_tokens, batch_size=batch_size):
        batch = batch.to(device)
        with autocast_for(device, precision):
            scores = model(batch.src, batch.src_lengths, batch.sentences).float().cpu()
        ids, summaries = batch.ids.tolist(), []
        for i, row in zip(ids, scores, strict=True):
            sents = dataset.sentences[i]
            picked = pick_sentences(sents, row[: len(sents)].tolist(), k, block_trigrams, words)
            summaries.append("\n".join(sents[j] for j in picked))
            out[i] = summaries[-1]
        if on_batch is not None:
            on_batch(ids, summaries)
    return out


def format_metrics(m: dict) -> str:
    digits = {"loss": 4, "len_ratio": 3}  # the rest 2; a percentage's sign after it
    order = ["loss", "ppl", "accuracy", "exact_match", "bleu", "len_ratio", "chrf", "rouge1", "rouge2", "rougeL",
             "rougeLsum"]
    return " | ".join(f"{k} {m[k]:.{digits.get(k, 2)}f}{'%' * (k in ('accuracy', 'exact_match'))}" for k in order
                      if k in m and isinstance(m[k], (int, float)))


def decoding_name(beam_size: int, sampling: Sampling | None = None, mbr: int = 0,
                  mbr_utility: str | None = None) -> str:
    """A decoding's name in scores and titles: greedy, beam4; sample, with the draws' options that are not
    the default (sample-t0.7-k50-p0.9-seed3); MBR among n of those, mbr4-chrf-beam4 (what tells the scores of
    one decoding from another's: scripts/pick_checkpoint.py compares it)."""
    name = "greedy" if beam_size <= 1 else f"beam{beam_size}"
    if sampling is not None:
        shown = (("t", sampling.temperature, 1.0), ("k", sampling.top_k, 0), ("p", sampling.top_p, 1.0),
                 ("seed", sampling.seed, 0))
        name = "-".join(["sample", *(f"{tag}{value:g}" for tag, value, default in shown if value != default)])
    return f"mbr{mbr}-{mbr_utility or 'chrf'}-{name}" if mbr else name


@dataclass
class Evaluation:
    """What `evaluate` measured. `metrics`: teacher-forced loss and ppl (+ accuracy) on every
    example; `decodings`: each decoding's scores ("greedy", "beam4" -> {"bleu", ...}) on the first
    `n` examples; `outputs`: per example of those, the first decoding's text, or for a classifier
    {"prediction", "confidence"}."""

    metrics: dict
    decodings: dict[str, dict] = field(default_factory=dict)
    outputs: list = field(default_factory=list)
    n: int = 0


def evaluate(model, dataset: D.EncodedDataset, examples: list[D.Example], tokenizers: TokenizerPair, *, device,
             max_tgt_len: int, beam_sizes=(1,), limit: int | None = None, length_penalty: float = 1.0,
             no_repeat_ngram: int = 0, min_len: int = 0, max_tokens: int = 4096, precision: str = "fp32",
             progress: bool = False, summary_sentences: int | None = None,
             summary_words: int | None = None, sampling: Sampling | None = None, keys: Sequence[int] | None = None,
             mbr: int = 0, mbr_utility: str | None = None) -> Evaluation:
    """Score `model` on `dataset` (encoded from `examples`, in the same order).

    Teacher forcing runs on every example; decoding (one pass per beam size, 1 = greedy; or drawn with
    `sampling`, example i's draws keyed by keys[i]; with mbr n, the MBR choice among n of either's
    outputs: `predict_seq2seq`), classification or an extractive model's picking (`predict_extracts`:
    `summary_sentences`, `summary_words`) on the first `limit` (None: all; 0: teacher forcing only).
    Each decoding's scores are under its `decoding_name`.
    """
    result = Evaluation(teacher_forced(model, eval_loader(dataset, max_tokens), device, precision))
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if n == 0:
        return result
    result.n = n
    subset = dataset if n == len(dataset) else dataset.first(n)
    if dataset.task == "extractive":
        hyps = predict_extracts(model, subset, device=device, sentences=summary_sentences, words=summary_words,
                                max_tokens=max_tokens, precision=precision)
        result.decodings[selection_name(summary_sentences, summary_words)] = M.seq2seq_scores(
            hyps, dataset.refs[:n], "summarization")
        result.outputs = hyps
        return result
    if dataset.task == "classification":
        preds, probs = predict_labels(model, subset, device=device, max_tokens=max_tokens, precision=precision)
        result.metrics["accuracy"] = M.accuracy(preds, [e.tgt for e in examples[:n]])
        result.outputs = [{"prediction": y, "confidence": c} for y, c in zip(preds, probs)]
        return result
    for beam in beam_sizes:
        hyps = predict_seq2seq(model, subset, tokenizers.tgt, device=device, max_tgt_len=max_tgt_len, beam_size=beam,
                               length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                               max_tokens=max_tokens, precision=precision, progress=progress, sampling=sampling,
                               keys=keys, mbr=mbr, mbr_utility=mbr_utility)
        name = decoding_name(beam, sampling, mbr, mbr_utility)
        result.decodings[name] = M.seq2seq_scores(hyps, dataset.refs[:n], dataset.task)
        if not result.outputs:
            result.outputs = hyps
    return result


def write_predictions(path: Path, examples, outputs, split: str) -> None:
    """One JSON line per example: id (data without one: ``"<split>-<i>"``, its place from 0), source,
    reference, and the prediction (or the output dict). Atomic: a failure (a full disk, a read-only
    folder) leaves any previous file as it was."""

    def rows():
        for rid, e, p in zip(D.prediction_ids(examples, split), examples, outputs):
            row = {"id": rid, "source": e.src, "reference": e.tgt}
            row.update(p if isinstance(p, dict) else {"prediction": p})
            yield json.dumps(row, ensure_ascii=False)

    write_lines_atomic(path, rows())


def write_outputs(out: Path, stem: str, split: str, examples, outputs, result: dict) -> None:
    """predictions.<stem>.jsonl (one row per example of `split`) and metrics.<stem>.json, each written atomically."""
    write_predictions(out / f"predictions.{stem}.jsonl", examples, outputs, split)
    write_lines_atomic(out / f"metrics.{stem}.json", [json.dumps(result, indent=2)])
