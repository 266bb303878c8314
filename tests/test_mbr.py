"""Minimum Bayes risk decoding (`evaluation.mbr`, `generate --mbr N`): the choice is the candidate of
highest mean chrF against all candidates, as a direct computation with sacrebleu's own sentence_chrf
finds it; generate's choice is that among the very candidates --nbest lists (the same beams, the same
seeded samples)."""

import itertools
import random
import re

import pytest
import sacrebleu
from test_predict import _make_run, _read, _texts, _write_jsonl

from scratchformer import cli, generate
from scratchformer.evaluation.mbr import mbr_pick
from scratchformer.evaluation.options import OptionError


def _by_hand(candidates: list[str], utility: str = "chrf") -> int:
    """The first index of highest mean sentence chrF (or BLEU, effective order) against every candidate, the
    candidate itself included."""
    def score(h, r):
        return sacrebleu.sentence_chrf(h, [r]).score if utility == "chrf" else \
            sacrebleu.sentence_bleu(h, [r], use_effective_order=True).score

    expected = [sum(score(h, r) for r in candidates) / len(candidates) for h in candidates]
    return expected.index(max(expected))


def test_the_pick_is_the_candidate_of_highest_expected_chrf_against_them_all():
    rng = random.Random(0)
    words = "ein Mann eine Frau fährt läuft mit dem Fahrrad Hund auf der Straße im Park".split()
    for trial in range(40):
        base = [rng.choice(words) for _ in range(rng.randint(3, 9))]
        candidates = []
        for _ in range(rng.randint(2, 9)):  # edits of one sentence, some drawn twice
            c = list(base)
            for _ in range(rng.randint(0, 3)):
                c[rng.randrange(len(c))] = rng.choice(words)
            candidates.append(" ".join(c))
        candidates += rng.sample(candidates, rng.randint(0, 2))
        assert mbr_pick(candidates) == _by_hand(candidates), (trial, candidates)
        assert mbr_pick(candidates, "bleu") == _by_hand(candidates, "bleu"), (trial, candidates)


def test_the_majority_wins_and_the_pick_does_not_depend_on_the_candidates_order():
    candidates = ["a man rides a bike", "a dog runs", "a man rides a bike", "a man rides the bike", "a cat"]
    assert candidates[mbr_pick(candidates)] == "a man rides a bike"
    picks = {p[mbr_pick(list(p))] for p in itertools.permutations(candidates)}
    assert picks == {"a man rides a bike"}
    assert mbr_pick(["only one"]) == 0 and mbr_pick(["same", "same"]) == 0
    with pytest.raises(ValueError, match=r"MBR needs at least one candidate"):
        mbr_pick([])
    with pytest.raises(ValueError, match=r"unknown MBR utility 'ter'; choose one of chrf, bleu"):
        mbr_pick(["a", "b"], "ter")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _make_run(tmp_path_factory.mktemp("runs") / "translation", "translation")


@pytest.mark.parametrize("decoding", [["--beam-size", "4"], ["--sample", "--temperature", "1.3", "--seed", "3"]])
def test_generate_mbr_outputs_the_pick_among_the_candidates_nbest_lists(run, tmp_path, decoding):
    """generate --mbr 4 over 6 inputs: each output is mbr_pick's among the 4 outputs --nbest 4 lists for it
    (the beam's 4 best, or the same 4 seeded samples), with that candidate's score; batch inference writes
    the same; a --resume with another --mbr is refused."""
    texts = _texts(6, 11, 5)
    text_args = [a for t in texts for a in ("--text", t)]
    flags = ["--checkpoint", str(run), *decoding]
    lists = generate.main([*flags, *text_args, "--json", "--nbest", "4"])
    chosen = generate.main([*flags, *text_args, "--json", "--mbr", "4"])
    by_bleu = generate.main([*flags, *text_args, "--json", "--mbr", "4", "--mbr-utility", "bleu"])
    for r, c, b in zip(lists, chosen, by_bleu, strict=True):
        outputs = [h["output"] for h in r["nbest"]]
        assert {"output": c["output"], "score": c["score"]} == r["nbest"][_by_hand(outputs)]
        assert {"output": b["output"], "score": b["score"]} == r["nbest"][_by_hand(outputs, "bleu")]
    assert any(c["output"] != r["output"] for r, c in zip(lists, chosen, strict=True)), "test needs MBR to matter"
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": i + 1, "src": t} for i, t in enumerate(texts)])
    out = tmp_path / "mbr.jsonl"
    generate.main([*flags, "--input", str(src), "--output", str(out), "--mbr", "4", "--batch-size", "2"])
    assert [p["prediction"] for p in _read(out)] == [c["output"] for c in chosen]
    with pytest.raises(OptionError, match=r"was written with --mbr 4 \(now 3\)"):
        generate.main([*flags, "--input", str(src), "--output", str(out), "--mbr", "3", "--resume"])


def test_generate_mbr_refuses_what_it_cannot_choose_among(run):
    base = ["--checkpoint", str(run), "--text", "one two"]
    for flags, message in [(["--mbr", "1"], "--mbr N chooses among N candidates, the beam's N best (--beam-size 4): "
                                            "N must be >= 2 and <= --beam-size, got 1"),
                           (["--mbr", "5"], "N must be >= 2 and <= --beam-size, got 5"),
                           (["--mbr", "1", "--sample"], "--mbr N chooses among N candidates, N samples (--sample): N "
                                                        "must be >= 2, got 1"),
                           (["--mbr", "3", "--json", "--nbest", "2"], "--mbr 3 outputs one choice among its "
                                                                      "candidates; --nbest 2 lists the search's")]:
        with pytest.raises(OptionError, match=re.escape(message)):
            generate.main(base + flags)
    with pytest.raises(cli.UsageError, match=re.escape("--mbr-utility bleu is --mbr's: give --mbr N, or drop it")):
        generate.main(base + ["--mbr-utility", "bleu"])
