"""Metrics on known strings."""

import math

import pytest

from scratchformer.evaluation import metrics as M

REFS = ["the cat sat on the mat", "a quick brown fox jumps over the lazy dog"]


def test_identical_scores_100():
    assert M.bleu(REFS, REFS) == pytest.approx(100.0)
    assert M.chrf(REFS, REFS) == pytest.approx(100.0)
    for v in M.rouge(REFS, REFS).values():
        assert v == pytest.approx(100.0)
    assert M.exact_match(REFS, [" " + r for r in REFS]) == 100.0


def test_partial_and_disjoint():
    hyps = ["the cat sat on a mat", "completely different words here"]
    assert 0.0 < M.bleu(hyps, REFS) < 100.0
    assert M.exact_match(hyps, REFS) == 0.0
    r = M.rouge(["the cat"], ["the cat sat"])
    assert r["rouge1"] == pytest.approx(100 * 2 * (1.0 * 2 / 3) / (1.0 + 2 / 3))  # P=1, R=2/3
    assert M.rouge(["dogs running"], ["dog runs"])["rouge1"] == pytest.approx(100.0)  # stemming on
    assert M.bleu(["xyz"], ["abc"]) == pytest.approx(0.0)


def test_accuracy_perplexity_and_errors():
    assert M.accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 50.0
    assert M.perplexity(2 * math.log(3.0), 2) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        M.bleu(["a", "b"], ["a"])
    with pytest.raises(ValueError):
        M.perplexity(1.0, 0)


def test_rouge_lsum_reads_sentences_of_one_line_summaries():
    """rougeLsum is the summary-level LCS over sentences; SAMSum's references (and a model's
    summaries) come on one line, so the texts are split into sentences before scoring. Reference:
    rouge-score itself on the texts split by hand, one sentence per line."""
    from rouge_score import rouge_scorer

    ref = "Amanda baked cookies. Jerry will bring them to the party tomorrow."
    hyp = "Jerry will bring cookies to the party. Amanda baked them."
    by_hand = rouge_scorer.RougeScorer(["rougeL", "rougeLsum"], use_stemmer=True).score(
        "Amanda baked cookies.\nJerry will bring them to the party tomorrow.",
        "Jerry will bring cookies to the party.\nAmanda baked them.")
    ours = M.rouge([hyp], [ref])
    assert ours["rougeLsum"] == pytest.approx(100 * by_hand["rougeLsum"].fmeasure)
    assert ours["rougeL"] == pytest.approx(100 * by_hand["rougeL"].fmeasure)
    assert ours["rougeLsum"] > ours["rougeL"] + 10  # sentences out of order: the whole-text LCS misses one
    # one sentence per line already (CNN/DM's highlights, our written summaries): scored the same
    assert M.rouge([hyp.replace(". ", ".\n")], [ref]) == pytest.approx(ours)
    # swapping two whole sentences costs rougeLsum nothing, rougeL half
    swapped = M.rouge(["dd ee ff. aa bb cc."], ["aa bb cc. dd ee ff."])  # (one letter and a period: an initial)
    assert swapped["rougeLsum"] == pytest.approx(100.0) and swapped["rougeL"] == pytest.approx(50.0)


def test_lead3():
    doc = "first one . second one ! third one ? fourth one . fifth"
    assert M.lead3(doc) == "first one .\nsecond one !\nthird one ?"
    assert M.lead3("Amanda: hi\nJerry: hello\nAmanda: bye\nJerry: ok") == "Amanda: hi\nJerry: hello\nAmanda: bye"
    assert M.rouge([M.lead3(doc)], ["first one .\nsecond one !\nthird one ?"])["rougeLsum"] == pytest.approx(100.0)
    # k sentences; a word budget stops once the sentences taken hold that many words
    assert M.lead3(doc, k=4) == "first one .\nsecond one !\nthird one ?\nfourth one ."
    assert M.lead3(doc, words=6) == "first one .\nsecond one !"  # 3 + 3 words
    assert M.lead3(doc, words=7) == M.lead3(doc) and M.lead3(doc, k=5, words=1) == "first one ."


def test_abbreviations_end_no_sentence():
    """A period that ends an abbreviation (u.s., p.m., initials, titles) is not a sentence end:
    Lead-3 takes three real sentences of CNN/DM's tokenized text, a highlight with 'u.s.' in it
    stays one sentence, and SAMSum's untokenized 'at 5 p.m. tomorrow' too. Before, 4% of CNN/DM's
    validation articles lost Lead-3 sentences this way, and 3% of their highlights were re-split."""
    doc = ("the u.s. treasury said so . mr. smith , of washington d.c. , agreed ! "
           "george w. bush left at 5 p.m. yesterday . a fourth one .")
    assert M.split_sentences(doc) == ["the u.s. treasury said so .", "mr. smith , of washington d.c. , agreed !",
                                      "george w. bush left at 5 p.m. yesterday .", "a fourth one ."]
    assert M.lead3(doc).count("\n") == 2 and M.lead3(doc).endswith("yesterday .")
    assert M.split_sentences("Dr. Who is on at 5 p.m. tomorrow. Bring snacks!") == [
        "Dr. Who is on at 5 p.m. tomorrow.", "Bring snacks!"]
    # still a sentence end: a word ending in a period that is no abbreviation, and a standalone one
    assert M.split_sentences("it was big. then u.s. troops came .\nnew line") == [
        "it was big.", "then u.s. troops came .", "new line"]


@pytest.mark.parametrize("text, sentences", [
    ('the man said , " we will win . " he left . then he slept .',
     ['the man said , " we will win . "', "he left .", "then he slept ."]),
    ('" we will win . we always do . " he said .', ['" we will win .', 'we always do . "', "he said ."]),
    ('he left . " we are back , " she said .', ["he left .", '" we are back , " she said .']),  # an opening quote
    ("she said : ‘ it was fun . ’ then she left .", ["she said : ‘ it was fun . ’", "then she left ."]),
    ("' we will win . ' he said . ' next time . '", ["' we will win . '", "he said .", "' next time . '"]),
    ('He said "we will win." He left.', ['He said "we will win."', "He left."]),  # untokenized
    ("A base (in the u.s.) is big. It is.", ["A base (in the u.s.) is big.", "It is."]),  # 'u.s.)' ends none
])
def test_a_closing_quote_stays_with_its_sentence(text, sentences):
    """A quotation mark token after a sentence end closes that sentence's quote when one is open (CNN/DM's
    ' " ' and ' \' ', the Daily Mail's ' ‘ ... ’ '); it went to the next sentence: on 1,500 CNN/DM
    validation articles 8,005 sentences began with a quote mark, 380 were nothing but punctuation."""
    assert M.split_sentences(text) == sentences


def test_rouge_names_the_package_when_rouge_score_is_missing(monkeypatch):
    """The GPU machines lack rouge-score: importing the metrics (and the train CLI) must not need
    it, and computing ROUGE must say which package to install."""
    import subprocess
    import sys

    monkeypatch.setitem(sys.modules, "rouge_score", None)  # `import rouge_score` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install rouge-score"):
        M.rouge(REFS, REFS)
    assert M.bleu(REFS, REFS) == pytest.approx(100.0)  # the rest still works
    # A fresh interpreter in which rouge_score cannot be imported at all imports the metrics and the
    # command lines, and fails with the clear message only when ROUGE is asked for.
    code = (
        "import sys; sys.modules['rouge_score'] = None\n"
        "import scratchformer.evaluation.metrics as M, scratchformer.train, scratchformer.evaluate\n"
        "assert 'rouge_score' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n    M.rouge(['a'], ['a'])\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ERR ROUGE needs the rouge-score package" in p.stdout and "pip install rouge-score" in p.stdout
