"""Sampling decoding (`model.sample_decode`): its draws follow the model's distribution as reshaped by a
temperature, top-k and top-p (against the exact distribution over every output, computed by hand);
top-k 1 is greedy; a row's samples depend on the seed, its key and its number, never on its batch."""

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch
from test_decoding import _eos_at, _model, _random_table, _repeats, _score, _src, _TableModel

from scratchformer.model import EOS_ID, PAD_ID, greedy_decode, row_key, sample_decode, sampling

WORDS = (3, 4, 5)


def _step_distribution(probs: dict, temperature: float, top_k: int, top_p: float) -> dict:
    """A step's distribution {token: p} as sampling reshapes it: p ** (1 / T) renormalized, then the top_k
    most probable (0: all), then the fewest most probable whose mass reaches top_p; renormalized."""
    ranked = sorted(((p ** (1 / temperature), tok) for tok, p in probs.items()), reverse=True)
    ranked = ranked[:top_k] if top_k else ranked
    z = sum(p for p, _ in ranked)
    kept, mass = [], 0.0
    for p, tok in ranked:
        if mass >= top_p:
            break
        kept.append((p, tok))
        mass += p / z
    z = sum(p for p, _ in kept)
    return {tok: p / z for p, tok in kept}


def _output_distribution(table, max_len, **shape) -> dict:
    """{output: probability} over every output of up to max_len tokens (ended by EOS, or unfinished at
    max_len), each the product of its steps' reshaped probabilities."""
    dist = {}
    for n in range(max_len + 1):
        for body in itertools.product(WORDS, repeat=n):
            for seq in ([*body, EOS_ID],) if n < max_len else (list(body),):
                p = 1.0
                for i, tok in enumerate(seq):
                    p *= _step_distribution(table[tuple(seq[:i])], **shape).get(tok, 0.0)
                if p > 0:
                    dist[tuple(seq)] = p
    return dist


def _chi2_bound(dof: int, z: float = 4.0) -> float:
    """The chi-square quantile of `dof` degrees of freedom about z standard deviations out
    (Wilson-Hilferty): a correct sampler's statistic exceeds it with probability ~3e-5."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.7, 2, 1.0), (1.0, 0, 0.7),
                                                     (0.8, 3, 0.9)])
@pytest.mark.parametrize("across", ["samples", "keys"])
def test_draws_follow_the_reshaped_distribution_over_every_output(temperature, top_k, top_p, across):
    """20,000 draws over a table model (3 words, up to 3 tokens: 40 outputs) against the exact distribution
    of its outputs under the temperature, top-k and top-p (Pearson's chi-square), drawn as one row's
    20,000 samples or as 20,000 rows of one sample each (keys 0, 1, ...). Each draw's score is its
    table log-probability (at temperature 1, nothing cut) / its length."""
    table = _random_table(7)
    shape = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    want = _output_distribution(table, 3, **shape)
    draws = 20_000
    rows, n = (1, draws) if across == "samples" else (draws, 1)
    model = _TableModel(lambda s, prefix: table.get(prefix))
    tokens, scores = sample_decode(model, torch.full((rows, 1), 4), torch.ones(rows, dtype=torch.long), max_len=3,
                                   n=n, seed=11, **shape)
    outputs = [tuple(row[: _eos_at(row) + 1]) for row in tokens.reshape(draws, -1).tolist()]
    counts = {seq: outputs.count(seq) for seq in set(outputs)}
    assert set(counts) <= set(want), f"drew outputs of probability 0: {set(counts) - set(want)}"
    chi2 = sum((counts.get(seq, 0) - draws * p) ** 2 / (draws * p) for seq, p in want.items())
    assert chi2 < _chi2_bound(len(want) - 1), (chi2, len(want))
    for seq, score in zip(outputs[:50], scores.reshape(-1)[:50].tolist(), strict=True):
        logp = sum(math.log(table[seq[:i]][tok]) for i, tok in enumerate(seq))
        assert score == pytest.approx(logp / len(seq), rel=1e-5)


def test_a_wrong_distribution_fails_the_chi_square_check():
    """The check above can fail: draws at temperature 1 against the distribution at temperature 0.8."""
    table = _random_table(7)
    want = _output_distribution(table, 3, temperature=0.8, top_k=0, top_p=1.0)
    tokens, _ = sample_decode(_TableModel(lambda s, prefix: table.get(prefix)), torch.full((1, 1), 4),
                              torch.ones(1, dtype=torch.long), max_len=3, n=20_000, seed=11)
    outputs = [tuple(row[: _eos_at(row) + 1]) for row in tokens[0].tolist()]
    chi2 = sum((outputs.count(seq) - 20_000 * p) ** 2 / (20_000 * p) for seq, p in want.items())
    assert chi2 > 10 * _chi2_bound(len(want) - 1)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("rules", [{}, {"no_repeat_ngram": 2, "min_len": 3}])
def test_top_k_1_and_a_temperature_near_0_are_greedy(copy, rules):
    m = _model(copy=copy)
    src, sl = _src()
    greedy = greedy_decode(m, src, sl, max_len=12, **rules)
    for shape in ({"top_k": 1}, {"temperature": 1e-6}, {"top_p": 1e-9}):
        tokens, _ = sample_decode(m, src, sl, max_len=12, n=3, seed=5, **shape, **rules)
        for j in range(3):
            assert torch.equal(tokens[:, j, : greedy.shape[1]], greedy), shape
    assert (greedy == EOS_ID).any(), "test needs a finished row"


@pytest.mark.parametrize("copy", [False, True])
def test_scores_are_the_full_models_mean_log_probabilities_of_the_samples(copy):
    m = _model(copy=copy)
    src, sl = _src()
    tokens, scores = sample_decode(m, src, sl, max_len=12, n=4, seed=3, temperature=1.3, top_p=0.95)
    for b in range(src.shape[0]):
        for j in range(4):
            row = tokens[b, j].tolist()
            seq = row[: _eos_at(row) + 1]
            assert scores[b, j].item() == pytest.approx(_score(m, src[b : b + 1], sl[b : b + 1], seq, 1.0),
                                                        rel=1e-4, abs=1e-5)


def test_a_rows_samples_depend_on_its_seed_key_and_number_not_its_batch():
    """Each row alone, under its key, draws what it draws in the batch; the batch reversed with its keys
    draws the same rows reversed; another seed, or other keys, draw other samples; the first of n
    samples is the one sample of n = 1; the same call twice draws the same."""
    m = _model()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = 0.0  # long outputs: samples that differ
    src, sl = _src()
    keys = torch.tensor([row_key(i) for i in ("a", "b", 7, "d")])
    kw = dict(max_len=10, n=3, seed=2, temperature=1.5)
    tokens, scores = sample_decode(m, src, sl, keys=keys, **kw)
    assert torch.equal(sample_decode(m, src, sl, keys=keys, **kw)[0], tokens)
    for b in range(4):
        alone, alone_scores = sample_decode(m, src[b : b + 1, : sl[b]], sl[b : b + 1], keys=keys[b : b + 1], **kw)
        assert torch.equal(alone[0], tokens[b, :, : alone.shape[2]])
        assert not (tokens[b, :, alone.shape[2]:] != PAD_ID).any()
        torch.testing.assert_close(alone_scores[0], scores[b])
    flipped, _ = sample_decode(m, src.flip(0), sl.flip(0), keys=keys.flip(0), **kw)
    assert torch.equal(flipped, tokens.flip(0))
    first, _ = sample_decode(m, src, sl, keys=keys, **{**kw, "n": 1})
    assert torch.equal(first[:, 0], tokens[:, 0, : first.shape[2]])
    for other in (dict(seed=3), dict(keys=keys + 1)):
        drawn, _ = sample_decode(m, src, sl, **{"keys": keys, **kw, **other})
        assert drawn.shape != tokens.shape or (drawn != tokens).sum() > tokens.numel() // 4, other
    assert len({tuple(r) for r in tokens.reshape(12, -1).tolist()}) == 12, "every sample differs"


def test_samples_keep_the_rules_and_each_rows_cap():
    m = _model()
    with torch.no_grad():
        m.generator.bias[EOS_ID] = 3.0
        m.generator.bias[4:8] += 3.0  # repeats likely
    src, sl = _src()
    free, _ = sample_decode(m, src, sl, max_len=12, n=16, seed=0, temperature=1.5)
    rows = [r[: _eos_at(r)] for r in free.reshape(64, -1).tolist()]
    assert any(len(r) < 3 for r in rows) and any(_repeats(r, 2) for r in rows), "test needs the rules to matter"
    caps = torch.tensor([12, 5, 1, 9])
    tokens, _ = sample_decode(m, src, sl, max_len=caps, n=16, seed=0, temperature=1.5, no_repeat_ngram=2, min_len=3)
    for b in range(4):
        for row in tokens[b].tolist():
            body = [tok for tok in row[: _eos_at(row)] if tok != PAD_ID]  # a row ended at its cap: PAD after
            assert not _repeats(body, 2) and (len(body) >= 3 or len(body) == caps[b])
            assert sum(tok != PAD_ID for tok in row) <= caps[b]


def test_sampling_refuses_bad_arguments_naming_them():
    m = _model()
    src, sl = _src()
    bad = [(dict(temperature=0), r"temperature must be a number > 0, got 0"),
           (dict(temperature=float("nan")), r"temperature must be a number > 0"),
           (dict(temperature=float("inf")), r"temperature must be a number > 0"),
           (dict(temperature=True), r"temperature must be a number > 0"),
           (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], got 0.0"),
           (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
           (dict(top_k=-1), r"top_k must be an int >= 0 \(0: off\), got -1"),
           (dict(top_k=2.0), r"top_k must be an int >= 0"),
           (dict(seed=-1), r"seed must be an int >= 0, got -1"),
           (dict(seed=2 ** 63), r"seed must be < 2\*\*63"),
           (dict(n=0), r"n must be an int >= 1 \(samples per row\), got 0"),
           (dict(keys=torch.arange(3)), r"keys must be a \(B,\) = \(4,\) int64 tensor of keys >= 0 \(`row_key`\), "
                                        r"got \(3,\) torch.int64"),
           (dict(keys=torch.arange(4.0)), r"keys must be .* got \(4,\) torch.float32"),
           (dict(keys=torch.tensor([0, 1, -2, 3])), r"keys must be .* keys >= 0"),
           (dict(keys=[0, 1, 2, 3]), r"keys must be .* got list"),
           (dict(min_len=13), r"min_len 13 exceeds max_len 12")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            sample_decode(m, src, sl, max_len=12, **kw)
    empty, no_lengths = torch.zeros(0, 6, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    tokens, scores = sample_decode(m, empty, no_lengths, max_len=5, n=2)
    assert tokens.shape == (0, 2, 1) and scores.shape == (0, 2)


def test_row_keys_are_ids_as_text_the_same_in_every_process():
    """An id's key is that of its text (1 and "1" are one id to batch inference), and another process,
    whose str hashes are salted otherwise, computes the same keys."""
    ids = [1, "1", "doc-7", "ünï", 2 ** 40]
    keys = [row_key(i) for i in ids]
    assert keys[0] == keys[1] and len(set(keys[1:])) == 4 and all(0 <= k < 2 ** 63 for k in keys)
    code = "from scratchformer.model import row_key; print([row_key(i) for i in [1, '1', 'doc-7', 'ünï', 2 ** 40]])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"}).stdout
    assert out.strip() == str(keys)


def test_the_hash_is_lowbias32_on_every_32_bit_input_in_int64_without_overflow():
    """`sampling._mix` on int64 tensors (its products split so none overflows) equals lowbias32 written with
    Python's unbounded ints, on inputs across the whole 32-bit range (the top bit set included), and on ints."""
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.randint(0, 2 ** 32, (4096,), generator=g), torch.tensor([0, 1, 2 ** 31, 2 ** 32 - 1])])
    assert sampling._mix(xs).tolist() == [lowbias32(x) for x in xs.tolist()]
    assert [sampling._mix(x) for x in xs[:64].tolist()] == [lowbias32(x) for x in xs[:64].tolist()]


@pytest.mark.parametrize("hashed", [0, 2 ** 32 - 128, 2 ** 32 - 1])
def test_uniforms_are_float64_strictly_inside_0_1_at_the_hashs_extremes(hashed, monkeypatch):
    """Every hash gives a uniform in (0, 1), the lowest and highest included: in float32 the top 128
    of the 2**32 hashes rounded to 1, where the draw took the last candidate, a token of probability 0."""
    monkeypatch.setattr(sampling, "_fold", lambda h, x: torch.full_like(h, hashed))
    u = sampling._uniforms(torch.zeros(3, dtype=torch.long), 5)
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all()), u.tolist()
    low = (hashed * 2 ** 20 + (hashed >> 12) + 0.5) / 2 ** 52  # exact in float64
    assert u.tolist() == [low] * 3


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.9)])
def test_no_uniform_draws_a_token_of_probability_0(top_k, top_p):
    """Whatever the uniform, the draw is a candidate of probability > 0, never a token ruled out (-inf),
    outside the top k or outside the nucleus; even u = 1 (the float32 uniforms' top, and where the last
    prefix sum ends above the last candidate's, as a parallel cumsum's rounding may leave it), which
    searchsorted runs past the end for: the last candidate of probability > 0."""
    x = torch.tensor([[0.3, -1.0, float("-inf"), 1.2, -0.5, float("-inf")],
                      [float("-inf"), 2.0, 1.9, -3.0, float("-inf"), float("-inf")]], dtype=torch.float64)
    p = torch.softmax(x, -1)
    ranked = x.argsort(-1, descending=True)
    allowed = ranked[:, : top_k or x.shape[1]]
    if top_p < 1:  # the nucleus of the top k: the fewest best whose renormalized mass reaches top_p
        kept = p.gather(1, allowed)
        kept = kept / kept.sum(-1, keepdim=True)
        allowed = [a[: int(((k.cumsum(0) - k) < top_p).sum())] for a, k in zip(allowed, kept)]
    for value in (2.0 ** -53, 0.5, 1 - 2.0 ** -53, 1.0):
        drawn = sampling._draw(x, torch.full((2,), value, dtype=torch.float64), top_k, top_p)
        for r, d in enumerate(drawn.tolist()):
            assert p[r, d] > 0 and d in allowed[r].tolist(), (value, r, d)
    unsorted = not top_k and top_p == 1  # the candidates in the vocabulary's order
    in_order = [sorted(a.tolist()) if unsorted else a.tolist() for a in allowed]
    last = [[t for t in a if p[r, t] > 0][-1] for r, a in enumerate(in_order)]  # u = 1: the last candidate
    assert sampling._draw(x, torch.ones(2, dtype=torch.float64), top_k, top_p).tolist() == [int(t) for t in last]
