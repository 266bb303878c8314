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

from sacrebleu.metrics import BLEU, CHRF

UTILITIES = {"chrf": CHRF(), "bleu": BLEU(effective_order=True)}  # sentence-level scores, 0-100


def mbr_pick(candidates: Sequence[str], utility: str = "chrf") -> int:
    """The index of the candidate of highest mean `utility` (chrf, bleu) against all of `candidates` (each
    counted as often as it occurs, itself included); of equals, the first. Each distinct pair is scored once."""
    if not candidates:
        raise ValueError("MBR needs at least one candidate")
    if utility not in UTILITIES:
        raise ValueError(f"unknown MBR utility {utility!r}; choose one of {', '.join(UTILITIES)}")
    metric = UTILITIES[utility]
    counts = Counter(candidates)
    distinct = list(counts)
    if len(distinct) == 1:
        return 0
    expected = {h: sum(n * (100.0 if h == r else metric.sentence_score(h, [r]).score) for r, n in counts.items())
                for h in distinct}
    best = max(distinct, key=lambda h: expected[h])  # max keeps the first of equals, in first-seen order
    return candidates.index(best)
