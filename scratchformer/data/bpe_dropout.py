"""BPE-dropout (Provilkov, Emelianenko and Voita, ACL 2020): a training set's texts segmented anew
every epoch, each merge of the BPE dropped with probability p, so the model sees a word's many
segmentations and learns its pieces; validation, test and decoding keep the usual segmentation.
Their Table 2: +1 to +2.3 BLEU on IWSLT-sized data (up to 1.4 on larger), the most on small data.

The algorithm is BPE's (the tokenizer's vocabulary and merge ranks) with one change: at each step
the candidate merges (adjacent pairs that have a merge) are tried in rank order, each dropped with
probability p, and the first kept one is applied; when every candidate is dropped the word is done.
That is the paper's procedure (its authors' code keeps a heap of merges, discards stale entries
before any draw and puts the dropped ones back after each merge). Hugging Face `tokenizers` has a
dropout too, not used here: it draws from an unseeded generator (a run could not be repeated or
resumed exactly), and it also draws for its queue's stale entries, retrying the merges it skipped
after each, so it merges a little more (about 3% fewer tokens at p 0.1-0.5 on the tests' corpus).
Here every draw comes from the run's seed.

What is sampled, and when: the texts are normalised and split into words by the tokenizer's own
normaliser and pre-tokenizer, once; each distinct word gets `samples` segmentations drawn once
(Python's BPE is slow: IWSLT's 20,000 pairs, 50,035 distinct words, in 12 s on the CPU machine),
and each epoch every occurrence of a word takes one of its word's samples at random (numpy,
vectorised: 0.05 s for those pairs). With
p = 0 every sample is the usual segmentation and `draw` returns exactly the tokenizer's encoding
(tests/test_bpe_dropout.py: against `tokenizers` at p = 0, and the distribution at p > 0 against an
enumeration by hand and a heap implementation). A special token's string in a text (`<s>`, ...)
is text to the tokenizer (`BPETokenizer`), so here too: words like any other.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence

import numpy as np

from .ragged import Ragged
from .tokenizer import UNK_ID, BPETokenizer

SAMPLES_PER_WORD = 16  # segmentations drawn per distinct word, among which each occurrence picks


def _candidates(syms: list[str], ranks: dict[tuple[str, str], int]) -> list[tuple[int, int]]:
    """(rank, position) of every adjacent pair of `syms` that has a merge, best first."""
    return sorted((r, i) for i, pair in enumerate(zip(syms, syms[1:])) if (r := ranks.get(pair)) is not None)


def bpe_path(word: str, ranks: dict[tuple[str, str], int]) -> list[list[str]]:
    """The symbols BPE passes through on `word`: its characters, after each merge, its pieces last."""
    path = [list(word)]
    while candidates := _candidates(path[-1], ranks):
        i, syms = candidates[0][1], list(path[-1])
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
        path.append(syms)
    return path


def segment(word: str, ranks: dict[tuple[str, str], int], p: float, rng: random.Random,
            path: list[list[str]] | None = None) -> list[str]:
    """`word`'s BPE pieces, each candidate merge dropped with probability p. `path`: `bpe_path(word)`
    (computed if not given). While the best candidate of every step is kept, the merges follow BPE's
    own path, so how many steps they do is drawn at once (geometric: the first drop at step g + 1
    with probability (1-p)^g p) and the walk starts from that point of the path: with p = 0.1 most
    words (about (1-p)^merges) come out whole without a step of Python."""
    path = path if path is not None else bpe_path(word, ranks)
    on_path = len(path) - 1 if not p else int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
    if on_path >= len(path) - 1:
        return list(path[-1])
    syms, best_dropped = list(path[on_path]), True  # the step after the path's: its best merge was dropped
    while candidates := _candidates(syms, ranks):
        if not best_dropped and rng.random() >= p:
            chosen = candidates[0][1]
        else:  # the next ones in rank order, each kept with probability 1 - p
            chosen = next((i for _, i in candidates[1:] if rng.random() >= p), None)
            if chosen is None:
                break
        best_dropped = False
        syms[chosen : chosen + 2] = [syms[chosen] + syms[chosen + 1]]
    return syms


def _words(tok, text: str) -> list[str]:
    """`text` normalised and pre-tokenized as `tok` does before its BPE (each word segmented alone)."""
    if tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    return [w for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)] if tok.pre_tokenizer is not None else [text]


class WordSegmentations:
    """BPE-dropout segmentations of fixed texts with one tokenizer: `draw(epoch)` gives each text's
    ids (no special tokens added), a pure function of (seed, stream, epoch). `stream` (>= 1) keeps
    the draws of one run's seed apart: the source's from the target's, and both from the batch
    sampler's shuffle (`default_rng([seed, epoch])`, the same as [seed, epoch, 0]: numpy pads the
    entropy with zeros), which they once drew the very same numbers as."""

    def __init__(self, tokenizer: BPETokenizer, texts: Sequence[str], p: float, seed: int, stream: int = 1,
                 samples: int = SAMPLES_PER_WORD):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"BPE-dropout rate must be in [0, 1), got {p}")
        if samples < 1:
            raise ValueError(f"samples per word must be >= 1, got {samples}")
        if stream < 1:
            raise ValueError(f"stream must be >= 1 (0 is the batch sampler's), got {stream}")
        model = json.loads(tokenizer.to_str())["model"]
        if model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError("BPE-dropout needs a plain BPE tokenizer (no subword prefix or word suffix), "
                             f"got model {model.get('type')!r}")
        vocab: dict[str, int] = model["vocab"]
        ranks = {tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m): r for r, m in enumerate(model["merges"])}
        tok = tokenizer.tok
        self.seed, self.stream, self.samples = seed, stream, samples
        types: dict[str, int] = {}  # a word's string -> its type id
        pieces: list[list[int]] = []  # type * samples + k -> ids
        occurrences: list[int] = []  # every text's words' types, in order
        self.text_starts = np.zeros(len(texts) + 1, dtype=np.int64)  # text t: occurrences[starts[t]:starts[t + 1]]
        rng = random.Random(f"{seed}/{stream}")

        def drawn(word: str) -> list[list[int]]:  # a new word's `samples` segmentations, as ids
            path = bpe_path(word, ranks)
            segs = [segment(word, ranks, p, rng, path) for _ in range(samples)] if p else [path[-1]] * samples
            return [[vocab.get(s, UNK_ID) for s in seg] for seg in segs]

        for t, text in enumerate(texts):
            for w in _words(tok, text):
                k = types.get(w)
                if k is None:
                    k = types[w] = len(types)
                    pieces += drawn(w)
                occurrences.append(k)
            self.text_starts[t + 1] = len(occurrences)
        self.occurrences = np.asarray(occurrences, dtype=np.int64)
        self.piece_lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        self.piece_starts = np.concatenate([[0], np.cumsum(self.piece_lengths)])
        self.flat = np.fromiter((i for ids in pieces for i in ids), dtype=np.int32, count=int(self.piece_starts[-1]))
        self.types = len(types)

    def draw(self, epoch: int) -> Ragged:
        """Every text's ids for this epoch (int32): each word occurrence one of its word's samples."""
        n = len(self.occurrences)
        pick = np.random.default_rng([self.seed, epoch, self.stream]).integers(self.samples, size=n)
        piece = self.occurrences * self.samples + pick
        lengths = self.piece_lengths[piece]
        ends = np.cumsum(lengths)
        # token j of occurrence o is flat[piece_starts[piece[o]] + j]: one gather for all of them
        offset = np.repeat(self.piece_starts[piece] - (ends - lengths), lengths)
        ids = self.flat[offset + np.arange(int(ends[-1]) if n else 0)]
        return Ragged(ids, np.concatenate([[0], ends])[self.text_starts])
