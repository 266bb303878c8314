"""Corpus metrics on detokenized text: BLEU and chrF (sacrebleu), ROUGE-1/2/L/Lsum (rouge-score,
Porter stemming on), exact match, accuracy, perplexity, and the Lead-3 summarization baseline.

All scores are on a 0-100 scale except perplexity. rouge-score is imported where ROUGE is computed,
so this module (and the train / evaluate command lines) import without it: the GPU machines we are
lent have sacrebleu but not rouge-score (see scripts/gpu/README.md for carrying it as a wheel).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from importlib import metadata

from sacrebleu.metrics import BLEU, CHRF

from ..data.extractive import pick_sentences
from ..data.sentences import split_sentences

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if not hyps:
        raise ValueError("no hypotheses to score")


def bleu(hyps: Sequence[str], refs: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenization, exp smoothing)."""
    return bleu_and_length_ratio(hyps, refs)[0]


def bleu_and_length_ratio(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, float]:
    """(corpus BLEU, the outputs' length over the references' in BLEU's 13a tokens: sacrebleu's "ratio").
    Below 1 BLEU pays its brevity penalty, exp(1 - 1 / ratio): the figure a length penalty is tuned by."""
    _check(hyps, refs)
    score = BLEU().corpus_score(list(hyps), [list(refs)])
    return float(score.score), score.sys_len / score.ref_len if score.ref_len else math.nan


def chrf(hyps: Sequence[str], refs: Sequence[str]) -> float:
    _check(hyps, refs)
    return float(CHRF().corpus_score(list(hyps), [list(refs)]).score)


def _rouge_scorer_module():
    """rouge_score.rouge_scorer, or an ImportError that says how to install it."""
    try:
        from rouge_score import rouge_scorer
    except ImportError as err:
        raise ImportError(
            "ROUGE needs the rouge-score package, which is not installed: pip install rouge-score "
            "(on a machine without network, carry its wheel and nltk's: make wheels)"
        ) from err
    return rouge_scorer


def rouge(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    """Mean F1 of ROUGE-1/2/L/Lsum with stemming. rougeL is the LCS of the whole texts; rougeLsum
    the summary-level LCS over their sentences, which rouge-score reads from newlines: both texts
    are split here first (`split_sentences`, as Hugging Face's summarization scripts split with
    nltk), so a summary written on one line (SAMSum's references) still gets its sentences.
    The split changes no other score: rouge-score's tokenizer reads a newline as a space."""
    per_example = rouge_per_example(hyps, refs)
    return {k: 100.0 * sum(v) / len(hyps) for k, v in per_example.items()}


def rouge_per_example(hyps: Sequence[str], refs: Sequence[str], keys: Sequence[str] = ROUGE_KEYS) -> dict[str, list]:
    """Each example's F1 (0-1) of each ROUGE variant in `keys`, as `rouge` scores them."""
    _check(hyps, refs)
    scorer = _rouge_scorer_module().RougeScorer(list(keys), use_stemmer=True)
    out = {k: [] for k in keys}
    for h, r in zip(hyps, refs):
        scores = scorer.score(_one_per_line(r), _one_per_line(h))  # (target, prediction)
        for k in keys:
            out[k].append(scores[k].fmeasure)
    return out


def scorers(scores: Mapping[str, object]) -> dict[str, str]:
    """What the text metrics among `scores`' keys were computed with, to be reported beside them:
    sacrebleu's signatures for BLEU and chrF (references, case, tokenizer, smoothing, its version:
    Post 2018, "A Call for Clarity in Reporting BLEU Scores"), and rouge-score's version and this
    module's settings for ROUGE. Scores under different signatures are not comparable."""
    out = {}
    for key, metric in (("bleu", BLEU), ("chrf", CHRF)):
        if key in scores:
            m = metric()
            m.corpus_score(["a b"], [["a b"]])  # a signature names the reference count: one, as here
            out[key] = str(m.get_signature())
    if any(k in scores for k in ROUGE_KEYS):
        try:
            release = metadata.version("rouge-score")
        except metadata.PackageNotFoundError:  # importable without its metadata (copied in): still a report
            release = "(release unknown)"
        out["rouge"] = f"rouge-score {release}|stemmer:porter|rougeLsum:sentences split by scratchformer.data.sentences"
    return out


def exact_match(hyps: Sequence[str], refs: Sequence[str]) -> float:
    _check(hyps, refs)
    return 100.0 * sum(h.strip() == r.strip() for h, r in zip(hyps, refs)) / len(hyps)


def accuracy(preds: Sequence[int], labels: Sequence[int]) -> float:
    _check(preds, labels)
    return 100.0 * sum(int(p) == int(y) for p, y in zip(preds, labels)) / len(preds)


def perplexity(nll_sum: float, num_tokens: int) -> float:
    """exp(mean token NLL), capped to stay finite for an untrained model."""
    if num_tokens <= 0:
        raise ValueError("perplexity needs at least one token")
    return math.exp(min(nll_sum / num_tokens, 100.0))


# Scores that describe the outputs without ranking them: never a --best-metric (`training.config.METRICS`).
DIAGNOSTICS = ("len_ratio",)


def seq2seq_scores(hyps: Sequence[str], refs: Sequence[str], task: str) -> dict[str, float]:
    """The metric set of a task: translation BLEU/chrF/exact match, summarization ROUGE (+BLEU); and
    len_ratio, the outputs' length over the references' (`bleu_and_length_ratio`, `DIAGNOSTICS`)."""
    score, ratio = bleu_and_length_ratio(hyps, refs)
    out = {"bleu": score, "len_ratio": ratio, "chrf": chrf(hyps, refs), "exact_match": exact_match(hyps, refs)}
    if task == "summarization":
        out.update(rouge(hyps, refs))
    return out


def _one_per_line(text: str) -> str:
    return "\n".join(split_sentences(text))


def lead3(document: str, k: int = 3, words: int | None = None) -> str:
    """The first three sentences (k), one per line; with `words`, fewer once they hold that many
    words: an extractive model's picking (`pick_sentences`, no trigram blocking) with position as the score."""
    sentences = split_sentences(document)
    picked = pick_sentences(sentences, [-i for i in range(len(sentences))], k, block_trigrams=False, words=words)
    return "\n".join(sentences[i] for i in picked)
