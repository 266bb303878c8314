"""Extractive summarization's data: documents as marked sentences, and the oracle sentences to learn.

A document is split into sentences (`sentences.split_sentences`) and encoded as
``BOS s1 BOS s2 ...``: every sentence led by a marker token whose final hidden state the
`Extractor` scores (BertSum's per-sentence [CLS], Liu & Lapata 2019). Sentences are taken in
order while they fit in ``max_src_len`` tokens; the last one kept may be cut (at least one of its
tokens stays). The training target of each kept sentence is 1 if it is in the document's oracle
(`oracle`), else 0.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
from collections.abc import Sequence

import numpy as np

from .files import DataError
from .ragged import Ragged
from .sentences import split_sentences
from .tokenizer import BOS_ID

_WORD = re.compile(r"[a-z0-9]+")
MAX_ORACLE_SENTENCES = 3  # CNN/DailyMail's highlights hold 3-4 sentences; BertSum's oracle takes 3


def _ngrams(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _f1(overlap: int, candidate: int, reference: int) -> float:
    if not overlap:
        return 0.0
    p, r = overlap / candidate, overlap / reference
    return 2 * p * r / (p + r)


def oracle(sentences: Sequence[str], summary: str, max_sentences: int = MAX_ORACLE_SENTENCES) -> list[int]:
    """The sentences (indices, ascending) that greedily maximise ROUGE-1 F1 + ROUGE-2 F1 (on sets
    of lower-cased alphanumeric n-grams) of their union against the summary: BertSum's
    `greedy_selection`. Adds the best sentence while the score grows, up to `max_sentences`."""
    words = [_WORD.findall(s.lower()) for s in sentences]
    ref = _WORD.findall(summary.lower())
    refs = [_ngrams(ref, n) for n in (1, 2)]
    grams = [[_ngrams(w, n) for w in words] for n in (1, 2)]
    chosen: list[int] = []
    union: list[set] = [set(), set()]
    best = 0.0
    for _ in range(min(max_sentences, len(sentences))):
        pick, pick_score = None, best
        for i in range(len(sentences)):
            if i in chosen:
                continue
            score = 0.0
            for n in range(2):
                cand = union[n] | grams[n][i]
                score += _f1(len(cand & refs[n]), len(cand), len(refs[n]))
            if score > pick_score:
                pick, pick_score = i, score
        if pick is None:
            break
        chosen.append(pick)
        best = pick_score
        union = [union[n] | grams[n][pick] for n in range(2)]
    return sorted(chosen)


def mark_sentences(sentence_ids: Sequence[Sequence[int]], max_src_len: int) -> tuple[list[int], int]:
    """``BOS s1 BOS s2 ...`` within max_src_len tokens -> (ids, sentences kept). A sentence is kept
    while its marker and at least one of its tokens fit; the last kept may be cut."""
    out: list[int] = []
    kept = 0
    for ids in sentence_ids:
        room = max_src_len - len(out) - 1
        if room < 1:
            break
        out.append(BOS_ID)
        out.extend(ids[:room])
        kept += 1
    return out, kept


# From this many documents on, `encode_documents` splits them and finds their oracles in a pool of
# processes: CNN/DM's 39k training articles take ~100 s on one core.
POOL_MIN_DOCUMENTS = 4096


def encode_documents(documents: Sequence[str], summaries: Sequence[str] | None, tok, max_src_len: int,
                     processes: int | None = None) -> tuple[Ragged, Ragged, list[list[str]], int]:
    """Documents -> (marked ids, per-sentence oracle labels (int32, zeros without summaries), the
    kept sentences' texts, documents cut). One tokenizer call for every sentence of every document;
    the splitting and the oracles (pure Python, ~2.5 ms a CNN/DM article) in `processes` worker
    processes (None: one per core, up to 16, from POOL_MIN_DOCUMENTS documents on; 1: none)."""
    if processes is None:
        processes = _cores() if len(documents) >= POOL_MIN_DOCUMENTS else 1
    chunk = max(1, len(documents) // (8 * processes))
    with _pool(processes) as pool:
        split = _map(pool, chunk, split_sentences, documents)
        empty = next((i for i, sents in enumerate(split) if not sents), None)
        if empty is not None:
            raise DataError(f"document {empty + 1} has no sentence (it is blank)")
        flat = tok.encode_batch([s for sents in split for s in sents])  # a literal "<s>" is text, not a marker
        src, texts, cut, at = [], [], 0, 0
        for sents in split:
            ids, kept = mark_sentences(flat[at : at + len(sents)], max_src_len)
            cut += kept < len(sents) or len(ids) - kept < sum(map(len, flat[at : at + kept]))
            at += len(sents)
            src.append(ids)
            texts.append(sents[:kept])
        picks = _map(pool, chunk, oracle, texts, summaries) if summaries is not None else [[] for _ in texts]
    labels = [np.isin(np.arange(len(t)), p).astype(np.int32) for t, p in zip(texts, picks, strict=True)]
    return Ragged.of(src), Ragged.of(labels), texts, cut


def _cores() -> int:
    """This process's share of the cores it may run on (one of LOCAL_WORLD_SIZE ranks), at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


@contextlib.contextmanager
def _pool(processes: int):
    """Forked workers, where the platform forks: they run pure Python on their copy of the documents;
    a spawned worker would re-import the caller's main module, which a script without a main guard
    cannot take. Also once CUDA is initialised (a GPU run has, before its data is built: its
    precision, its device's description), as torch's DataLoader forks its workers: they never call
    CUDA, and torch's fork handler makes a call there an error. (Under CUDA they ran in one process:
    CNN/DM's articles took ~100 s of a GPU window, not ~7.)
    TOKENIZERS_PARALLELISM is set while the workers fork, to its value, so that tokenizers does not
    warn in each child that it was forked after its threads ran (the children never tokenize)."""
    if processes <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield None
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        pool = multiprocessing.get_context("fork").Pool(processes)
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
    with pool:
        yield pool


def _map(pool, chunk: int, fn, *args) -> list:
    if pool is None:
        return list(map(fn, *args))
    return pool.starmap(fn, zip(*args, strict=True), chunksize=chunk)


def sentence_slots(src: np.ndarray, labels: Sequence[np.ndarray],
                   pad_multiple: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A padded batch of marked documents (B, L) and their labels -> (each marker's position (B, S),
    the labels (B, S) padded with -1), S the most sentences rounded up to pad_multiple. A padded
    slot points at position 0 and is never scored."""
    counts = np.fromiter(map(len, labels), dtype=np.int64, count=len(labels))
    S = -(-max(1, int(counts.max())) // pad_multiple) * pad_multiple
    rows, cols = np.nonzero(src == BOS_ID)  # row-major: each document's markers in order
    if np.any(np.bincount(rows, minlength=len(labels)) != counts):
        raise ValueError("an extractive batch's sentence markers and labels disagree (documents encoded "
                         "without encode_examples(task='extractive')?)")
    slots = np.arange(S)[None, :] < counts[:, None]
    starts = np.zeros((len(labels), S), dtype=np.int64)
    starts[slots] = cols
    target = np.full((len(labels), S), -1, dtype=np.int64)
    target[slots] = np.concatenate(labels)
    return starts, target


def pick_sentences(sentences: Sequence[str], scores: Sequence[float], k: int = MAX_ORACLE_SENTENCES,
                   block_trigrams: bool = True, words: int | None = None) -> list[int]:
    """The summary's sentences (indices, in document order): the best-scored first, until k are
    picked or, with `words`, until they hold at least that many words (whitespace-separated, as
    the data is tokenized); with `block_trigrams`, a sentence sharing a word trigram with one
    already picked is skipped (BertSum's trigram blocking: fewer repeats of one fact)."""
    if len(scores) != len(sentences):
        raise ValueError(f"{len(scores)} scores for {len(sentences)} sentences")
    picked: list[int] = []
    seen: set[tuple[str, ...]] = set()
    n_words = 0
    for i in sorted(range(len(scores)), key=lambda j: -scores[j]):
        grams = _ngrams(_WORD.findall(sentences[i].lower()), 3)
        if block_trigrams and grams & seen:
            continue
        picked.append(i)
        seen |= grams
        n_words += len(sentences[i].split())
        if len(picked) == k or (words is not None and n_words >= words):
            break
    return sorted(picked)


def selection_name(k: int | None = None, words: int | None = None) -> str:
    """How `pick_sentences` picked, as a decoding's name: "top3", or "top4-60w" with a word budget
    (k None: MAX_ORACLE_SENTENCES)."""
    return f"top{k or MAX_ORACLE_SENTENCES}" + (f"-{words}w" if words is not None else "")
