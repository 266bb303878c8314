"""Encoding and batching: token ids per example, padded batches, length-bucketed samplers.

Batches (`Batch`) hold src (B, Ls), src_lengths (B,), tgt_in = BOS + y and tgt_out = y + EOS
(B, Lt), tgt_lengths (B,) for seq2seq, src + labels (B,) for classification, or src + the
sentence markers' positions and labels (B, S) for extractive summarization; all int64,
right-padded with PAD (labels of padded sentences: -1). Over-long sequences are truncated by
`encode_examples` and counted.
`BucketBatchSampler` forms batches by token budget or sentence count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .bpe_dropout import WordSegmentations
from .extractive import encode_documents, sentence_slots
from .ragged import Ragged
from .records import Example
from .tokenizer import BOS_ID, EOS_ID, PAD_ID

# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------

ENCODER_ONLY = ("classification", "extractive")  # tasks without a target sequence


class EncodedDataset(torch.utils.data.Dataset):
    """Token ids per example (int32; `Ragged`, or a list of arrays); item i is (i, src, tgt or
    label). The same ids every epoch (`ResegmentedDataset` draws new ones)."""

    def __init__(self, src: Ragged | list[np.ndarray], tgt: Ragged | list[np.ndarray] | list[int], task: str):
        if len(src) != len(tgt):
            raise ValueError(f"src and tgt counts differ: {len(src)} vs {len(tgt)}")
        self.src, self.tgt, self.task = src, tgt, task
        self.refs: list[str] | None = None  # reference texts, for scoring decoded outputs
        self.sentences: list[list[str]] | None = None  # extractive: each document's kept sentences

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return i, self.src[i], self.tgt[i]

    def first(self, n: int) -> EncodedDataset:
        """The first n examples (their ids, references and sentences)."""
        head = EncodedDataset(self.src[:n], self.tgt[:n], self.task)
        head.refs = None if self.refs is None else self.refs[:n]
        head.sentences = None if self.sentences is None else self.sentences[:n]
        return head

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose ids the items are (a no-op: they never change)."""

    def lengths(self, epoch: int | None = None) -> np.ndarray:
        """Padded-size proxy per example: the longer of src and tgt_in/tgt_out (tokens), in `epoch`
        (None: the current one)."""
        return _lengths(self.src, self.tgt, self.task)


def _lengths(src, tgt, task: str) -> np.ndarray:
    return _sizes(src) if task in ENCODER_ONLY else np.maximum(_sizes(src), _sizes(tgt) + 1)


def _sizes(seqs: Ragged | list[np.ndarray]) -> np.ndarray:
    return seqs.lengths() if isinstance(seqs, Ragged) else np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))


@dataclass
class TruncationStats:
    examples: int = 0
    src_truncated: int = 0
    tgt_truncated: int = 0

    def __str__(self):
        def pct(n):
            return f"{n} ({100.0 * n / max(1, self.examples):.1f}%)"

        return (f"{self.examples} examples, src truncated {pct(self.src_truncated)}, "
                f"tgt truncated {pct(self.tgt_truncated)}")


def _check_lengths(task: str, max_src_len: int, max_tgt_len: int) -> None:
    if max_src_len < 2 or (task not in ENCODER_ONLY and max_tgt_len < 2):
        raise ValueError(f"max_src_len and max_tgt_len must be >= 2, got {max_src_len}, {max_tgt_len}")


def _fit(seqs: Ragged, keep: int, eos: str) -> tuple[Ragged, int]:
    """The first `keep` ids of every sequence, then EOS ("always"), EOS for an empty one only ("if
    empty": a classifier still needs a token besides [CLS]) or nothing ("never"), all at once ->
    (the sequences, how many were cut)."""
    lengths, first = seqs.lengths(), int(seqs.offsets[0])
    kept = np.minimum(lengths, keep)
    position = np.arange(int(seqs.offsets[-1]) - first) - np.repeat(seqs.offsets[:-1] - first, lengths)
    body = seqs.flat[first : int(seqs.offsets[-1])][position < np.repeat(kept, lengths)]
    end = {"always": np.ones_like(kept), "if empty": (kept == 0).astype(kept.dtype), "never": 0 * kept}[eos]
    offsets = np.concatenate([[0], np.cumsum(kept + end)])
    is_end = np.zeros(int(offsets[-1]), dtype=bool)
    is_end[offsets[1:][end == 1] - 1] = True
    flat = np.empty(int(offsets[-1]), dtype=np.int32)
    flat[is_end], flat[~is_end] = EOS_ID, body
    return Ragged(flat, offsets), int((lengths > keep).sum())


def _fit_pair(task: str, src: Ragged, tgt: Ragged | None, max_src_len: int, max_tgt_len: int,
              stats: TruncationStats) -> tuple[Ragged, Ragged | None]:
    """The truncation policy of `encode_examples` applied to a dataset's ids, cuts counted in stats."""
    if task == "classification":
        src, stats.src_truncated = _fit(src, max_src_len, eos="if empty")
        return src, None
    src, stats.src_truncated = _fit(src, max_src_len - 1, eos="always")
    tgt, stats.tgt_truncated = _fit(tgt, max_tgt_len - 1, eos="never")
    return src, tgt


def encode_examples(examples: Sequence[Example], task: str, src_tok, tgt_tok=None, max_src_len: int = 256,
                    max_tgt_len: int = 256) -> tuple[EncodedDataset, TruncationStats]:
    """Tokenize examples. Truncation policy (counted in the returned stats):

    - seq2seq source: the first ``max_src_len - 1`` tokens, then EOS (so <= max_src_len);
    - seq2seq target y: the first ``max_tgt_len - 1`` tokens, so tgt_in = BOS + y and
      tgt_out = y + EOS have at most ``max_tgt_len`` tokens;
    - classification text: the first ``max_src_len`` tokens (no EOS; the model adds [CLS]); an
      empty text is [EOS];
    - extractive document: ``BOS s1 BOS s2 ...`` within ``max_src_len`` tokens, the target its
      kept sentences' oracle labels (`extractive.encode_documents`; an empty summary: all 0).
    """
    _check_lengths(task, max_src_len, max_tgt_len)
    stats = TruncationStats(examples=len(examples))
    if task == "extractive":
        summaries = [e.tgt for e in examples]  # none at all (inputs to predict): no oracle to find
        src, labels, sentences, stats.src_truncated = encode_documents([e.src for e in examples],
                                                                       summaries if any(summaries) else None, src_tok,
                                                                       max_src_len)
        dataset = EncodedDataset(src, labels, task)
        dataset.refs, dataset.sentences = summaries, sentences
        return dataset, stats
    src = Ragged.of(src_tok.encode_batch([e.src for e in examples]))
    if task == "classification":
        src, _ = _fit_pair(task, src, None, max_src_len, max_tgt_len, stats)
        return EncodedDataset(src, [int(e.tgt) for e in examples], task), stats
    tgt = Ragged.of((tgt_tok or src_tok).encode_batch([e.tgt for e in examples]))
    dataset = EncodedDataset(*_fit_pair(task, src, tgt, max_src_len, max_tgt_len, stats), task)
    dataset.refs = [e.tgt for e in examples]
    return dataset, stats


class ResegmentedDataset(EncodedDataset):
    """A training set under BPE-dropout (`bpe_dropout.py`): each epoch's items are its texts
    segmented anew with merges dropped at rate p (source and target drawn apart), truncated as
    `encode_examples` does; a pure function of (seed, epoch), so a resumed run sees the same.
    `set_epoch` picks the epoch the items come from; `lengths(epoch)` any epoch's, without changing it."""

    def __init__(self, examples: Sequence[Example], task: str, src_tok, tgt_tok=None, max_src_len: int = 256,
                 max_tgt_len: int = 256, *, p: float, seed: int):
        _check_lengths(task, max_src_len, max_tgt_len)
        if task == "extractive":
            raise ValueError("BPE-dropout resegments words, not an extractive summarizer's marked sentences")
        self.task, self.max_src_len, self.max_tgt_len = task, max_src_len, max_tgt_len
        self._src = WordSegmentations(src_tok, [e.src for e in examples], p, seed, 1)  # stream 1, the target's 2
        classify = task == "classification"
        self._tgt = None if classify else WordSegmentations(tgt_tok or src_tok, [e.tgt for e in examples], p, seed, 2)
        self._labels = [int(e.tgt) for e in examples] if classify else None
        self._drawn: dict[int, tuple[Ragged, Ragged | list[int], TruncationStats]] = {}  # the last 2 epochs drawn
        super().__init__(*self._epoch(0)[:2], task)
        self.epoch = 0
        if not classify:
            self.refs = [e.tgt for e in examples]

    def distinct_words(self) -> int:
        """Distinct words segmented, source and target (what building took time for)."""
        return self._src.types + (self._tgt.types if self._tgt is not None else 0)

    def _epoch(self, epoch: int) -> tuple[Ragged, Ragged | list[int], TruncationStats]:
        if epoch not in self._drawn:
            stats = TruncationStats(examples=len(self._src.text_starts) - 1)
            src, tgt = _fit_pair(self.task, self._src.draw(epoch), self._tgt.draw(epoch) if self._tgt else None,
                                 self.max_src_len, self.max_tgt_len, stats)
            while len(self._drawn) >= 2:
                del self._drawn[next(iter(self._drawn))]
            self._drawn[epoch] = src, self._labels if tgt is None else tgt, stats
        return self._drawn[epoch]

    def set_epoch(self, epoch: int) -> None:
        self.src, self.tgt, _ = self._epoch(epoch)
        self.epoch = epoch

    def lengths(self, epoch: int | None = None) -> np.ndarray:
        if epoch is None or epoch == self.epoch:
            return super().lengths()
        src, tgt, _ = self._epoch(epoch)
        return _lengths(src, tgt, self.task)

    def truncation(self, epoch: int) -> TruncationStats:
        """What `epoch`'s segmentation truncated."""
        return self._epoch(epoch)[2]


# ---------------------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One batch; all tensors int64, right-padded with PAD. tgt_* are None for classification."""

    ids: torch.Tensor  # (B,) example indices in the dataset
    src: torch.Tensor  # (B, Ls)
    src_lengths: torch.Tensor  # (B,)
    tgt_in: torch.Tensor | None = None  # (B, Lt) BOS + y
    tgt_out: torch.Tensor | None = None  # (B, Lt) y + EOS
    tgt_lengths: torch.Tensor | None = None  # (B,)
    labels: torch.Tensor | None = None  # (B,) classification; (B, S) extractive, -1 past a document's sentences
    sentences: torch.Tensor | None = None  # (B, S) extractive: each sentence marker's position in src
    # target tokens (examples for classification), counted once where the batch is made, on the host:
    # a count read from a batch already on a GPU would be a host-device sync
    num_tgt_tokens: int | None = None

    def __post_init__(self):
        if self.num_tgt_tokens is None:
            if self.tgt_lengths is not None:
                self.num_tgt_tokens = int(self.tgt_lengths.sum())
            else:
                self.num_tgt_tokens = int((self.labels >= 0).sum()) if self.sentences is not None else len(self)

    def _map(self, fn):
        return Batch(**{k: (fn(v) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:  # DataLoader(pin_memory=True) calls this on custom types
        return self._map(lambda t: t.pin_memory())

    def copy_(self, other: Batch, non_blocking: bool = False) -> None:
        """Each of `other`'s tensors copied into this batch's, in place (same shapes): a CUDA
        graph's fixed inputs refilled."""
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                v.copy_(getattr(other, k), non_blocking=non_blocking)

    def twice(self) -> Batch:
        """The batch stacked on itself (example i again at i + B): R-Drop's two copies in one forward."""
        doubled = self._map(lambda t: torch.cat([t, t]))
        doubled.num_tgt_tokens *= 2  # _map kept the count of one copy
        return doubled

    def __len__(self):
        return self.src.shape[0]

    @property
    def shape(self) -> tuple[int, ...]:
        """(B, Ls, Lt); (B, Ls) for classification; (B, Ls, S) for extraction: its tensors' shapes follow."""
        second = self.tgt_in if self.tgt_in is not None else self.sentences
        return tuple(self.src.shape) + (() if second is None else (second.shape[1],))


def round_up(n, multiple: int):
    """n (an int or an integer array) rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def _pad(seqs: Sequence[Sequence[int]], prefix: int | None = None, suffix: int | None = None, multiple: int = 1):
    """Right-padded (B, L) int64 rows: [prefix] + seq + [suffix], L the longest rounded up to a
    multiple; -> (rows, lengths). One scatter of all the tokens, not a copy per row: a training
    batch of ~500 Multi30k sentences took 12 ms row by row on the CPU machine, which a GPU step
    replayed as a CUDA graph would wait on."""
    head = prefix is not None
    n = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    lengths = n + head + (suffix is not None)
    out = np.full((len(seqs), round_up(int(lengths.max()), multiple)), PAD_ID, dtype=np.int64)
    cols = np.arange(out.shape[1])[None, :] - head
    out[(cols >= 0) & (cols < n[:, None])] = np.concatenate(seqs)  # row-major: the rows' tokens in order
    if head:
        out[:, 0] = prefix
    if suffix is not None:
        out[np.arange(len(seqs)), n + head] = suffix
    return torch.from_numpy(out), torch.from_numpy(lengths)


def collate(items, pad_multiple: int = 1, task: str | None = None) -> Batch:
    """items: [(index, src ids, tgt ids or int label, or extractive labels when task is "extractive")] -> Batch
    with dynamic (per-batch) padding, each padded length rounded up to a multiple of `pad_multiple`
    (fairseq's --pad-to-multiple, Hugging Face's pad_to_multiple_of): tensor-core-sized shapes, and fewer
    distinct ones for what compiles or captures per shape (torch.compile's reduce-overhead records a
    CUDA graph for each)."""
    ids = torch.tensor([it[0] for it in items], dtype=torch.int64)
    src, src_lengths = _pad([it[1] for it in items], multiple=pad_multiple)
    if isinstance(items[0][2], (int, np.integer)):
        return Batch(ids, src, src_lengths, labels=torch.tensor([int(it[2]) for it in items], dtype=torch.int64))
    if task == "extractive":
        starts, labels = sentence_slots(src.numpy(), [it[2] for it in items], pad_multiple)
        return Batch(ids, src, src_lengths, labels=torch.from_numpy(labels), sentences=torch.from_numpy(starts))
    tgt_in, tgt_lengths = _pad([it[2] for it in items], prefix=BOS_ID, multiple=pad_multiple)
    tgt_out, _ = _pad([it[2] for it in items], suffix=EOS_ID, multiple=pad_multiple)
    return Batch(ids, src, src_lengths, tgt_in, tgt_out, tgt_lengths)


class BucketBatchSampler:
    """Batches of example indices by token budget and/or sentence count, with length bucketing.

    Each epoch: a seeded permutation (or the identity when not shuffling), cut into pools of
    `pool_batches` batches' worth of examples; each pool sorted by length and cut greedily into
    batches whose padded size ``B * max_len`` stays within `max_tokens` (an example longer than
    the budget gets a batch of its own) and whose ``B <= batch_size``; then batch order is shuffled.
    Every example appears exactly once per epoch. With ``num_replicas > 1`` the batch list is
    padded by repeating its batches cyclically (even fewer than ranks) up to a multiple of
    num_replicas (like DistributedSampler), and rank r takes batches r, r + R, ...

    `set_epoch(epoch, start)` picks the epoch and skips its first `start` batches (exact resume).
    `lengths`: the examples' lengths, or a function of the epoch giving them (a dataset whose
    segmentation changes per epoch: `ResegmentedDataset.lengths`).
    `pad_multiple`: lengths count rounded up to that multiple, as `collate(pad_multiple=...)` pads them,
    so the budget holds for the padded batch and a pool's batches take few distinct shapes.
    """

    def __init__(self, lengths: Sequence[int] | Callable[[int], Sequence[int]], *, batch_size: int | None = None,
                 max_tokens: int | None = None, shuffle: bool = True, seed: int = 0, num_replicas: int = 1,
                 rank: int = 0, pool_batches: int = 50, pad_multiple: int = 1):
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size, max_tokens or both")
        if batch_size is not None and batch_size < 1 or max_tokens is not None and max_tokens < 1:
            raise ValueError(f"batch_size and max_tokens must be positive, got {batch_size}, {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} must be in [0, {num_replicas})")
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple must be >= 1, got {pad_multiple}")
        self._lengths = lengths if callable(lengths) else np.asarray(lengths, dtype=np.int64)
        self.pad_multiple = pad_multiple
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank, self.pool_batches = num_replicas, rank, pool_batches
        self.epoch, self.start = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def _all_batches(self, epoch: int) -> list[list[int]]:
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        lengths = self._lengths(epoch) if callable(self._lengths) else self._lengths
        lengths = round_up(np.asarray(lengths, dtype=np.int64), self.pad_multiple)
        n = len(lengths)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        mean_len = max(1.0, float(lengths.mean())) if n else 1.0
        per_batch = self.batch_size or max(1, int(self.max_tokens // mean_len))
        pool = max(1, per_batch * self.pool_batches)
        batches: list[list[int]] = []
        for p0 in range(0, n, pool):
            chunk = order[p0 : p0 + pool]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            cur: list[int] = []
            cur_max = 0
            for i in chunk.tolist():
                L = int(lengths[i])
                new_max = max(cur_max, L)
                too_many = self.batch_size is not None and len(cur) + 1 > self.batch_size
                too_big = self.max_tokens is not None and (len(cur) + 1) * new_max > self.max_tokens
                if cur and (too_many or too_big):
                    batches.append(cur)
                    cur, new_max = [], L
                cur.append(i)
                cur_max = new_max
            if cur:
                batches.append(cur)
        if self.shuffle:
            perm = rng.permutation(len(batches))
            batches = [batches[j] for j in perm]
        if self.num_replicas > 1 and batches:  # padded cyclically: fewer batches than ranks too
            total = -(-len(batches) // self.num_replicas) * self.num_replicas
            batches = (batches * -(-total // len(batches)))[:total]
            batches = batches[self.rank :: self.num_replicas]
        self._cache = (epoch, batches)
        return batches

    def __iter__(self):
        yield from self._all_batches(self.epoch)[self.start :]

    def __len__(self):
        return len(self._all_batches(self.epoch)) - self.start

    def batches_per_epoch(self, epoch: int = 0) -> int:
        return len(self._all_batches(epoch))


def make_loader(dataset: EncodedDataset, sampler: BucketBatchSampler, *, num_workers: int = 0,
                pin_memory: bool = False, pad_multiple: int = 1, seed: int = 0) -> torch.utils.data.DataLoader:
    """Batches in the sampler's order. Each iterator draws its workers' base seed from the loader's own generator:
    from torch's, a validation or an iterator made mid-epoch on resume would move dropout's random stream."""
    collate_fn = functools.partial(collate, pad_multiple=pad_multiple, task=dataset.task)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                                       pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed))
