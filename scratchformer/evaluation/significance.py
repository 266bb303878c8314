"""Is one system's score better than another's by more than chance? Paired bootstrap resampling
(Koehn 2004) of any of the project's metrics over two systems' outputs for the same examples.

Each metric is cut into per-example sufficient statistics whose sum gives the corpus score: BLEU's
and chrF's n-gram counts (sacrebleu's own), or an example's ROUGE F1, correctness or exact match
(corpus score: their mean). A resample draws the examples with replacement; every system is scored
on the same draws, so the test is paired. The p-value and the confidence intervals follow sacrebleu's
``--paired-bs`` (the Moses script's test): for BLEU and chrF, with the same seed and number of
resamples, they are sacrebleu's numbers, but for a system that scores as the baseline on every
resample (the same outputs): p is 1 here, the smallest p there.

For a metric that scores each example right or wrong (accuracy, exact match) the exact McNemar test
is given too (Dietterich 1998, for comparing classifiers): on the examples exactly one system gets
right, a binomial test of each being as likely to be either's. It does not resample, and with few
such examples it is the one to read: the bootstrap's shifted null then puts p near 0.05 for a
difference of two examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

from .metrics import ROUGE_KEYS, rouge_per_example

METRICS = ("bleu", "chrf", *ROUGE_KEYS, "accuracy", "exact_match")
BINARY = ("accuracy", "exact_match")  # each example right or wrong: `mcnemar` applies
SEED = 12345  # sacrebleu's default (SACREBLEU_SEED)
_CHUNK = 100  # resamples gathered at once: (chunk, examples, statistics) floats in memory


@dataclass
class Statistics:
    """Per-example statistics (n, k) of one metric, and the corpus score of their sum (k,) over n examples."""

    per_example: np.ndarray
    score: Callable[[np.ndarray, int], float]

    def corpus(self) -> float:
        return self.score(self.per_example.sum(0), len(self.per_example))


def _mean(total: np.ndarray, n: int) -> float:
    return float(total[0] / n)


def statistics(metrics: Sequence[str], hyps: Sequence, refs: Sequence) -> dict[str, Statistics]:
    """Each of `metrics`' per-example statistics of hyps against refs (texts; labels for accuracy), 0-100
    scale; the ROUGE variants among them from one pass of the scorer."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric {unknown[0]!r}; known: {', '.join(METRICS)}")
    rouge_keys = [m for m in metrics if m in ROUGE_KEYS]
    values = rouge_per_example(hyps, refs, rouge_keys) if rouge_keys else {}
    out = {}
    for metric in metrics:
        if metric in ("bleu", "chrf"):
            scorer = BLEU() if metric == "bleu" else CHRF()
            stats = np.array(scorer._extract_corpus_statistics(list(hyps), [list(refs)]), dtype=np.float64)
            out[metric] = Statistics(stats, lambda total, n, scorer=scorer: float(
                scorer._compute_score_from_stats(list(total)).score))
            continue
        if metric == "accuracy":
            values[metric] = [int(h) == int(r) for h, r in zip(hyps, refs, strict=True)]
        elif metric == "exact_match":
            values[metric] = [h.strip() == r.strip() for h, r in zip(hyps, refs, strict=True)]
        out[metric] = Statistics(100.0 * np.asarray(values[metric], dtype=np.float64)[:, None], _mean)
    return out


@dataclass
class Comparison:
    """One system against the baseline on one metric: its score, its bootstrap mean and 95% interval's
    half-width (sacrebleu's "μ ± CI"), the difference system - baseline with its 95% interval, and
    the p-value of the difference's size arising by chance."""

    score: float
    mean: float
    ci: float
    difference: float
    difference_interval: tuple[float, float]
    p: float
    p_mcnemar: float | None = None  # right-or-wrong metrics only (`mcnemar`)


def resampled_scores(stats: Statistics, indices: np.ndarray) -> np.ndarray:
    """The corpus score of each resample (a row of example indices)."""
    n = indices.shape[1]
    out = []
    for start in range(0, len(indices), _CHUNK):
        totals = stats.per_example[indices[start:start + _CHUNK]].sum(1)  # (chunk, k)
        out.extend(stats.score(t, n) for t in totals)
    return np.array(out)


def _interval(scores: np.ndarray) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles as sacrebleu's `estimate_ci` reads them: the (n // 40)-th
    from each end."""
    s = np.sort(scores)
    lo = len(s) // 40
    return float(s[lo]), float(s[len(s) - lo - 1])


def paired_bootstrap(baseline: Statistics, systems: Sequence[Statistics], samples: int = 1000,
                     seed: int = SEED) -> tuple[Comparison, list[Comparison]]:
    """The baseline's own figures (difference 0, p 1) and each system's against it, all scored on the
    same `samples` resamples of the examples, drawn from `seed`."""
    n = len(baseline.per_example)
    if n == 0:
        raise ValueError("no examples to compare")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    for s in systems:
        if len(s.per_example) != n:
            raise ValueError(f"a system has {len(s.per_example)} examples, the baseline {n}")
    indices = np.random.default_rng(seed).choice(n, size=(samples, n), replace=True)
    base_scores = resampled_scores(baseline, indices)
    base = baseline.corpus()

    def compare(scores: np.ndarray, score: float) -> Comparison:
        lo, hi = _interval(scores)
        d_lo, d_hi = _interval(scores - base_scores)
        sample_diffs = np.abs(scores - base_scores)
        p = (np.sum(sample_diffs - sample_diffs.mean() > abs(score - base)) + 1) / (samples + 1)
        if not sample_diffs.any():  # the same score on every resample (sacrebleu: 1 / (samples + 1))
            p = 1.0
        return Comparison(score, float(scores.mean()), 0.5 * (hi - lo), score - base, (d_lo, d_hi), float(p))

    lo, hi = _interval(base_scores)
    own = Comparison(base, float(base_scores.mean()), 0.5 * (hi - lo), 0.0, (0.0, 0.0), 1.0)
    return own, [compare(resampled_scores(s, indices), s.corpus()) for s in systems]


def mcnemar(baseline: Statistics, system: Statistics) -> float:
    """The exact (binomial) McNemar test's two-sided p of right-or-wrong per-example statistics: of the
    n examples exactly one of the two gets right, the system gets k; p = P(a count as far from n / 2)
    under Binomial(n, 1/2), 1 when n = 0."""
    base, other = baseline.per_example[:, 0] > 0, system.per_example[:, 0] > 0
    k, n = int(np.sum(other & ~base)), int(np.sum(other != base))
    if n == 0:
        return 1.0
    log_half = n * math.log(0.5)
    tail = math.fsum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half)
                     for i in range(min(k, n - k) + 1))
    return min(1.0, 2.0 * tail)
