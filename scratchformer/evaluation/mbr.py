"""Minimum Bayes risk (MBR) decoding: of an input's N candidates (the beam's N best, or N samples), the
one with the highest expected utility against the candidates themselves as pseudo-references (Kumar
and Byrne 2004; Eikema and Aziz 2020, with samples; Freitag et al. 2022). Where beam search returns
the single most probable output, MBR returns the consensus of the model's likely outputs, which the
metrics usually score higher. Utility: sacrebleu's sentence-level chrF (default), the usual lexical
utility of MBR, or sentence BLEU (exponent smoothing, effective order): MBR raises the score of the
metric it uses as its utility, often at the other's expense.

The expectation is uniform over the N candidates, each counted as often as it was drawn (a sample
drawn twice is twice as likely under the model), itself included, as Monte Carlo MBR estimates it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sacrebleu.metrics import BLEU

UTILITIES = ("chrf", "bleu")  # sentence-level scores, 0-100
CHRF_ORDER, CHRF_BETA = 6, 2  # sacrebleu's chrF defaults: character 6-grams, recall weighted twice
_BLEU = BLEU(effective_order=True)  # the BLEU utility's scorer, built once


def _char_ngrams(text: str) -> list[Counter]:
    """chrF's character n-grams of `text`, n = 1..CHRF_ORDER, whitespace removed (sacrebleu's
    extract_all_char_ngrams)."""
    line = "".join(text.split())
    return [Counter(line[i:i + n] for i in range(len(line) - n + 1)) for n in range(1, CHRF_ORDER + 1)]


def _f_score(matches: list[int], hyp: list[int], ref: list[int]) -> float:
    """Sentence chrF from each order's matches and n-gram totals, as sacrebleu 2 computes it: precision
    and recall averaged over the orders both sides have n-grams of, then their F-beta, 0-100."""
    orders = [(m / h, m / r) for m, h, r in zip(matches, hyp, ref) if h and r]
    if not orders:
        return 0.0
    p, r = (sum(x) / len(orders) for x in zip(*orders))
    b2 = CHRF_BETA ** 2
    return 100 * (1 + b2) * p * r / (b2 * p + r) if p + r else 0.0


def chrf_matrix(texts: Sequence[str]) -> list[list[float]]:
    """u[i][j], i != j: the sentence chrF of texts[i] against texts[j] as its reference (sacrebleu's
    sentence_chrf, to rounding); u[i][i]: 100, a text against itself as MBR counts it. Each text's
    n-grams are counted once, and each pair's matches once (they are symmetric; chrF's precision and
    recall are not): N texts cost N extractions, not 2 N^2."""
    grams = [_char_ngrams(t) for t in texts]
    totals = [[sum(c.values()) for c in g] for g in grams]
    n = len(texts)
    u = [[100.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            matches = []
            for a, b in zip(grams[i], grams[j]):
                small, large = (a, b) if len(a) <= len(b) else (b, a)
                matches.append(sum(min(c, large[g]) for g, c in small.items() if g in large))
            u[i][j] = _f_score(matches, totals[i], totals[j])
            u[j][i] = _f_score(matches, totals[j], totals[i])
    return u


def _utilities(texts: list[str], utility: str) -> list[list[float]]:
    """u[i][j]: `utility` of texts[i] against texts[j]; 100 for a text against itself."""
    if utility == "chrf":
        return chrf_matrix(texts)
    return [[100.0 if h == r else _BLEU.sentence_score(h, [r]).score for r in texts] for h in texts]


def mbr_pick(candidates: Sequence[str], utility: str = "chrf") -> int:
    """The index of the candidate of highest mean `utility` (chrf, bleu) against all of `candidates` (each
    counted as often as it occurs, itself included); of equals, the first. Each distinct pair is scored once."""
    if not candidates:
        raise ValueError("MBR needs at least one candidate")
    if utility not in UTILITIES:
        raise ValueError(f"unknown MBR utility {utility!r}; choose one of {', '.join(UTILITIES)}")
    counts = Counter(candidates)
    distinct = list(counts)
    if len(distinct) == 1:
        return 0
    u = _utilities(distinct, utility)
    weights = [counts[r] for r in distinct]
    expected = [sum(w * x for w, x in zip(weights, row)) for row in u]
    best = max(range(len(distinct)), key=expected.__getitem__)  # max keeps the first of equals, in first-seen order
    return candidates.index(distinct[best])
