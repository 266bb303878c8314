"""BPE-dropout (`data/bpe_dropout.py`, `ResegmentedDataset`): the usual segmentation at p = 0 (against
`tokenizers` itself), the algorithm's distribution (against an enumeration by hand and against
`tokenizers`' own, unseeded dropout), round trips, seeding, truncation and per-epoch batching."""

import heapq
import json
import random

import numpy as np
import pytest

from scratchformer import data as D
from scratchformer.data.bpe_dropout import WordSegmentations, _words, segment

TEXTS = [
    "Two young, White males are outside near many bushes.",
    "Zwei junge weiße Männer sind im Freien neben vielen Büschen.",
    "Amanda: I baked  cookies. Do you want some?\nJerry: Sure!",
    "A man in an orange hat starring at something.",
    "Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
    "Several men in hard hats are operating a giant pulley system.",
    "Mehrere Männer mit Schutzhelmen bedienen ein Antriebsradsystem.",
    "A little girl climbing into a wooden playhouse, 3,5 m high.",
]
CORPUS = [f"{t} {i}" for i in range(40) for t in TEXTS]
ODD = [
    "",  # no word at all
    "a  b\n\nc   ",  # runs of spaces and newlines
    "Cafe\u0301 cre\u0300me",  # decomposed accents: NFC composes them first
    "a <s> b </s> <pad>",  # special tokens' strings: text like any other, no special id
    "日本語 🙂 x²",  # bytes the BPE never merged
    "Männer Männer Männer Männer Männer Männer Männer Männer",
]


@pytest.fixture(scope="module")
def tok():
    return D.BPETokenizer.train(CORPUS, vocab_size=600)


def test_no_dropout_is_the_tokenizers_own_encoding(tok):
    texts = TEXTS + ODD
    want = tok.encode_batch(texts)
    seg = WordSegmentations(tok, texts, p=0.0, seed=0)
    for epoch in (0, 7):
        got = seg.draw(epoch)
        assert [g.tolist() for g in got] == want
        assert all(g.dtype == np.int32 for g in got)


def test_one_word_follows_the_enumerated_distribution():
    """'abc' with merges ab (rank 0), ab+c (1), bc (2). Each step tries the candidates in rank order,
    each kept with probability 1 - p: abc (1-p)², ab|c (1-p)p, a|bc p(1-p), a|b|c p²."""
    ranks = {("a", "b"): 0, ("ab", "c"): 1, ("b", "c"): 2}
    p, n = 0.3, 20000
    rng = random.Random(0)
    counts: dict[tuple[str, ...], int] = {}
    for _ in range(n):
        key = tuple(segment("abc", ranks, p, rng))
        counts[key] = counts.get(key, 0) + 1
    want = {("abc",): (1 - p) ** 2, ("ab", "c"): (1 - p) * p, ("a", "bc"): p * (1 - p), ("a", "b", "c"): p * p}
    print(counts)
    assert set(counts) == set(want)
    for key, q in want.items():
        assert abs(counts[key] / n - q) < 4.5 * (q * (1 - q) / n) ** 0.5, (key, counts[key] / n, q)
    assert segment("abc", ranks, 0.0, rng) == ["abc"]  # p = 0: BPE itself
    assert segment("abab", {("a", "b"): 0, ("ab", "ab"): 1}, 0.0, rng) == ["abab"]


def _heap_reference(word, ranks, p, rng):
    """The paper's procedure written another way: a heap of (rank, position) merges, invalidated
    lazily (a stale entry is discarded before any draw), dropped merges pushed back after each merge."""
    syms = list(word)
    heap = [(r, i) for i in range(len(syms) - 1) if (r := ranks.get((syms[i], syms[i + 1]))) is not None]
    heapq.heapify(heap)
    dropped = []
    while heap:
        r, i = heapq.heappop(heap)
        if i >= len(syms) - 1 or ranks.get((syms[i], syms[i + 1])) != r:
            continue
        if rng.random() < p:
            dropped.append((r, i))
            continue
        syms[i : i + 2] = [syms[i] + syms[i + 1]]
        heap = [(q, j - (j > i)) for q, j in heap + dropped]
        dropped = []
        heapq.heapify(heap)
        for j in (i - 1, i):
            if 0 <= j < len(syms) - 1 and (q := ranks.get((syms[j], syms[j + 1]))) is not None:
                heapq.heappush(heap, (q, j))
    return syms


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_segment_matches_a_heap_implementation_on_a_real_vocabulary(tok, p):
    """Per word of the corpus, the distribution of the number of pieces: `segment` against
    `_heap_reference`, many draws each. (`tokenizers`' own dropout differs: it also draws for stale
    queue entries and then retries the merges it skipped, about 3% fewer tokens at p 0.1-0.5.)"""
    ranks = {tuple(m): r for r, m in enumerate(json.loads(tok.to_str())["model"]["merges"])}
    words = sorted({w for t in TEXTS for w in _words(tok.tok, t)})
    a, b = random.Random(0), random.Random(1)
    n = 400
    ours = np.array([[len(segment(w, ranks, p, a)) for _ in range(n)] for w in words], dtype=float)
    ref = np.array([[len(_heap_reference(w, ranks, p, b)) for _ in range(n)] for w in words], dtype=float)
    usual = [segment(w, ranks, 0.0, a) for w in words]
    assert [_heap_reference(w, ranks, 0.0, b) for w in words] == usual
    se = np.sqrt((ours.var(1) + ref.var(1)) / n) + 1e-9
    z = (ours.mean(1) - ref.mean(1)) / se
    print(f"{len(words)} words, mean pieces {ours.mean():.3f} vs {ref.mean():.3f}, max |z| {abs(z).max():.2f}")
    assert ours.mean() > 1.1 * np.mean([len(u) for u in usual])  # the dropout segments more finely
    assert abs(ours.mean() - ref.mean()) < 0.01 * ref.mean()
    assert abs(z).max() < 4.5


def test_dropped_segmentations_decode_to_the_same_text(tok):
    texts = TEXTS + ODD
    seg = WordSegmentations(tok, texts, p=0.5, seed=0)
    usual = tok.encode_batch(texts)
    for epoch in range(3):
        got = seg.draw(epoch)
        assert [tok.tok.decode(g.tolist()) for g in got] == [tok.tok.decode(u) for u in usual]
        assert all(0 <= int(i) < tok.vocab_size for g in got for i in g)
        assert sum(g.tolist() != u for g, u in zip(got, usual)) >= len(TEXTS) // 2


def test_draws_are_seeded_and_occurrences_draw_apart(tok):
    texts = TEXTS + ODD
    a, b = WordSegmentations(tok, texts, 0.3, seed=5), WordSegmentations(tok, texts, 0.3, seed=5)
    same = lambda x, y: all(np.array_equal(u, v) for u, v in zip(x, y))  # noqa: E731
    assert same(a.draw(2), b.draw(2))  # a resumed run rebuilds the same
    assert not same(a.draw(2), a.draw(3))  # each epoch its own
    assert not same(a.draw(2), WordSegmentations(tok, texts, 0.3, seed=6).draw(2))
    # a stream of its own: the target's (2) draws apart from the source's (1) under one seed, and neither
    # takes the batch sampler's numbers (stream 0, default_rng([seed, epoch]): the source's once did)
    assert not same(a.draw(2), WordSegmentations(tok, texts, 0.3, seed=5, stream=2).draw(2))
    with pytest.raises(ValueError, match=r"stream must be >= 1 \(0 is the batch sampler's\), got 0"):
        WordSegmentations(tok, texts, 0.3, seed=5, stream=0)
    # the repeated word of ODD[-1]: its 8 occurrences take their own samples, not one for the text
    ids = a.draw(0)[len(TEXTS) + len(ODD) - 1].tolist()
    words = tok.tok.decode(ids).split()
    assert words == ["Männer"] * 8
    pieces = [tuple(p) for p in np.split(ids, np.flatnonzero(np.isin(ids, _word_starts(tok, ids))))[1:]]
    assert len(set(pieces)) > 1, pieces


def test_each_stream_draws_its_own_segmentations_and_picks(tok):
    """The source's (stream 1) and the target's (stream 2) draws are apart twice over: a word's samples
    (with one sample per word, no pick to draw, the streams still differ) and each occurrence's pick."""
    texts = TEXTS + ODD
    one, two = (WordSegmentations(tok, texts, 0.3, seed=5, stream=s, samples=1) for s in (1, 2))
    assert one.draw(0).flat.tolist() != two.draw(0).flat.tolist()
    assert one.draw(0).flat.tolist() == one.draw(7).flat.tolist()  # one sample: every epoch the same
    # and each occurrence's pick among its word's samples too: one word per text, the samples an
    # occurrence's ids could be in each stream; picks drawn from one generator (the same sample index
    # in both streams) would leave every occurrence a common candidate
    one, two = (WordSegmentations(tok, ["Antriebsradsystem"] * 64, 0.5, seed=5, stream=s) for s in (1, 2))

    def candidates(ws):
        pool = [ws.flat[ws.piece_starts[k]:ws.piece_starts[k + 1]].tolist() for k in range(ws.samples)]
        return [{k for k, seg in enumerate(pool) if seg == ids.tolist()} for ids in ws.draw(3)]

    assert any(not a & b for a, b in zip(candidates(one), candidates(two)))


def _word_starts(tok, ids):
    """The ids in `ids` that begin a word (their piece starts with the byte-level space 'Ġ')."""
    return [i for i in ids if tok.tok.id_to_token(int(i)).startswith("Ġ")]


def test_bad_rate_is_refused(tok):
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match="BPE-dropout rate must be in"):
            WordSegmentations(tok, TEXTS, p, seed=0)


def _examples():
    return [D.Example(src=s, tgt=t) for s, t in zip(TEXTS[::2], TEXTS[1::2])] * 8


def test_resegmented_dataset_truncates_and_keeps_epochs_apart(tok):
    ex = _examples()
    usual, _ = D.encode_examples(ex, "translation", tok, max_src_len=12, max_tgt_len=10)
    ds = D.ResegmentedDataset(ex, "translation", tok, max_src_len=12, max_tgt_len=10, p=0.4, seed=0)
    assert ds.refs == usual.refs and len(ds) == len(usual)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for _, src, tgt in (ds[i] for i in range(len(ds))):
            assert len(src) <= 12 and src[-1] == D.EOS_ID and len(tgt) <= 9  # encode_examples' policy
        assert ds.truncation(epoch).src_truncated > 0 and ds.truncation(epoch).examples == len(ex)
    # each epoch segments the source and the target anew
    ds.set_epoch(0)
    first = [(ds[i][1].tolist(), ds[i][2].tolist()) for i in range(len(ds))]
    ds.set_epoch(1)
    assert any(first[i][0] != ds[i][1].tolist() for i in range(len(ds)))
    assert any(first[i][1] != ds[i][2].tolist() for i in range(len(ds)))
    wide = D.ResegmentedDataset(ex, "translation", tok, p=0.4, seed=0)
    wide.set_epoch(1)
    items = [wide[i][1].tolist() for i in range(len(wide))]
    other = wide.lengths(2)  # another epoch's lengths, looked at without switching to it
    assert [wide[i][1].tolist() for i in range(len(wide))] == items
    assert not np.array_equal(other, wide.lengths())
    wide.set_epoch(2)
    assert np.array_equal(other, wide.lengths())
    # p = 0 gives exactly encode_examples' dataset
    zero = D.ResegmentedDataset(ex, "translation", tok, max_src_len=12, max_tgt_len=10, p=0.0, seed=0)
    assert all(np.array_equal(a, b) for x, y in ((zero.src, usual.src), (zero.tgt, usual.tgt)) for a, b in zip(x, y))


def test_resegmented_classification_keeps_its_labels(tok):
    ex = [D.Example(src=t, tgt=i % 2) for i, t in enumerate(TEXTS)]
    ds = D.ResegmentedDataset(ex, "classification", tok, max_src_len=8, p=0.3, seed=0)
    ds.set_epoch(4)
    assert [ds[i][2] for i in range(len(ds))] == [i % 2 for i in range(len(TEXTS))]
    assert all(len(ds[i][1]) <= 8 for i in range(len(ds)))


def test_sampler_keeps_the_token_budget_in_every_epochs_segmentation(tok):
    ds = D.ResegmentedDataset(_examples(), "translation", tok, p=0.5, seed=0)
    sampler = D.BucketBatchSampler(ds.lengths, max_tokens=120, seed=0, pad_multiple=8)
    counts = set()
    for epoch in range(4):
        ds.set_epoch(epoch)
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(ds)))
        for b in batches:
            widest = max(max(len(ds[i][1]), len(ds[i][2]) + 1) for i in b)
            assert len(b) == 1 or len(b) * D.round_up(widest, 8) <= 120
        counts.add(len(batches))
        assert sampler.batches_per_epoch(epoch) == len(batches)
