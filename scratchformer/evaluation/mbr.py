"""Minimum Bayes risk (MBR) decoding: of an input's N candidates (the beam's N best, or N samples), the
one with the highest expected utility against the candidates themselves as pseudo-references (Kumar
and Byrne 2004; Eikema and Aziz 2020, with samples; Freitag et al. 2022). Where beam search returns
the single most probable output, MBR returns the consensus of the model's likely outputs, which the
metrics usually score higher. Utility: sacrebleu's sentence-level chrF, the metric this project
reports beside BLEU and the usual lexical utility of MBR.

The expectation is uniform over the N candidates, each counted as often as it was drawn (a sample
drawn twice is twice as likely under the model), itself included, as Monte Carlo MBR estimates it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from sacrebleu.metrics import CHRF

_CHRF = CHRF()


def mbr_pick(candidates: Sequence[str]) -> int:
    """The index of the candidate of highest mean chrF against all of `candidates` (each counted as often
    as it occurs, itself included); of equals, the first. Each distinct pair is scored once."""
    if not candidates:
        raise ValueError("MBR needs at least one candidate")
    counts = Counter(candidates)
    distinct = list(counts)
    if len(distinct) == 1:
        return 0
    expected = {h: sum(n * (100.0 if h == r else _CHRF.sentence_score(h, [r]).score) for r, n in counts.items())
                for h in distinct}
    best = max(distinct, key=lambda h: expected[h])  # max keeps the first of equals, in first-seen order
    return candidates.index(best)
