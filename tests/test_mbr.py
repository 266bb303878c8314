"""Minimum Bayes risk decoding (`evaluation.mbr`, `generate --mbr N`, `evaluate --mbr N`): the choice is
the candidate of highest mean chrF against all candidates, as a direct computation with sacrebleu's own
sentence_chrf finds it; generate's choice is that among the very candidates --nbest lists (the same
beams, the same seeded samples); evaluate scores the outputs generate writes (also of --sample)."""

import codecs
import itertools
import json
import random
import re
from pathlib import Path

import pytest
import sacrebleu
from test_average import _pick, _pick_refused
from test_cli import _eval_run
from test_predict import _make_run, _read, _texts, _write_jsonl

import scratchformer.evaluation.plots as plots
from scratchformer import evaluate, generate
from scratchformer.evaluation.mbr import chrf_matrix, mbr_pick
from scratchformer.evaluation.options import OptionError
from scratchformer.special_tokens import SPECIAL_TOKENS


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


def test_the_chrf_matrix_is_sacrebleus_sentence_chrf_of_every_ordered_pair():
    """MBR's chrF (n-grams counted once per candidate, matches once per pair) against sacrebleu's own
    sentence_chrf, both ways round, on texts of every kind: empty, shorter than 6 characters, with
    punctuation, accents and CJK, repeated characters."""
    rng = random.Random(1)
    pieces = ["ein", "Mann", "fährt", "Fahrrad", ",", ".", "(hi)", "日本", "語", "aaaa", "a", "x-y", "Straße", "!"]
    texts = ["", " ", "a", "ab", "aaaaaaa", "日本語", "Ein Mann.", "ein mann"]
    texts += [" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(30)]
    u = chrf_matrix(texts)
    for i, h in enumerate(texts):
        for j, r in enumerate(texts):
            if i != j:
                assert u[i][j] == pytest.approx(sacrebleu.sentence_chrf(h, [r]).score, abs=1e-9), (h, r)
    assert all(u[i][i] == 100.0 for i in range(len(texts)))
    assert u[6][7] != u[7][6], "chrF weighs recall over precision: not symmetric"


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
    # the default utility given by name is the same decoding: resumed (it was refused as "unset (now chrf)"),
    # and so is a record that left the default unresolved, as records did until 2026-12-07
    generate.main([*flags, "--input", str(src), "--output", str(out), "--mbr", "4", "--mbr-utility", "chrf",
                   "--resume"])
    meta = Path(f"{out}.meta.json")
    record = json.loads(meta.read_text())
    assert record["options"]["--mbr-utility"] == "chrf"
    record["options"]["--mbr-utility"] = None
    meta.write_text(json.dumps(record))
    generate.main([*flags, "--input", str(src), "--output", str(out), "--mbr", "4", "--resume"])
    with pytest.raises(OptionError, match=r"was written with --mbr-utility chrf \(now bleu\)"):
        generate.main([*flags, "--input", str(src), "--output", str(out), "--mbr", "4", "--mbr-utility", "bleu",
                       "--resume"])
    assert [p["prediction"] for p in _read(out)] == [c["output"] for c in chosen]


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
    with pytest.raises(OptionError, match=re.escape("--mbr-utility bleu is --mbr's: give --mbr N, or drop it")):
        generate.main(base + ["--mbr-utility", "bleu"])


@pytest.mark.parametrize("decoding, name", [
    (["--beam-size", "4", "--mbr", "4"], "mbr4-chrf-beam4"),
    (["--sample", "--top-k", "20", "--seed", "5"], "sample-k20-seed5"),
    (["--sample", "--temperature", "1.3", "--mbr", "4", "--mbr-utility", "bleu"], "mbr4-bleu-sample-t1.3"),
])
def test_evaluate_scores_the_outputs_generate_writes_for_the_same_ids(tmp_path, monkeypatch, decoding, name):
    """evaluate --mbr N / --sample writes the predictions that generate's batch inference writes for the
    split's sources under the predictions' ids (an input's draws are keyed by its id); its BLEU and chrF are
    sacrebleu's of them; its scores name the decoding and its options (pick_checkpoint compares "decoding");
    the attention map is drawn over the prediction it wrote."""
    run = _eval_run(tmp_path)
    drawn = {}
    monkeypatch.setattr(plots, "plot_attention",
                        lambda w, rows, cols, path, title: drawn.update(rows=rows, title=title))
    m = evaluate.main(["--checkpoint", str(run), "--split", "validation", "--out", str(tmp_path / "ev"),
                       "--attention", "3", *decoding])
    rows = _read(tmp_path / "ev" / "predictions.validation.jsonl")
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": r["id"], "src": r["source"]} for r in rows])
    generate.main(["--checkpoint", str(run), "--input", str(src), "--output", str(tmp_path / "gen.jsonl"), *decoding])
    predictions = [r["prediction"] for r in rows]
    assert [r["prediction"] for r in _read(tmp_path / "gen.jsonl")] == predictions
    assert len(set(predictions)) > 3, "test needs outputs that differ"
    refs = [r["reference"] for r in rows]
    assert m["bleu"] == pytest.approx(sacrebleu.corpus_bleu(predictions, [refs]).score)
    assert m["chrf"] == pytest.approx(sacrebleu.corpus_chrf(predictions, [refs]).score)
    saved = json.loads((tmp_path / "ev" / "metrics.validation.json").read_text())
    assert saved["decoding"] == m["decoding"] == name
    assert saved.get("mbr") == (4 if "--mbr" in decoding else None)
    assert (saved.get("sampling") or {}).get("seed") == (5 if "--seed" in decoding else 0 if "--sample" in decoding
                                                          else None)
    # the rows' text (a token holding part of a character is shown as its bytes' escapes), as decoding joins it
    shown = b"".join(codecs.escape_decode(t.encode())[0] for t in drawn["rows"] if t not in SPECIAL_TOKENS)
    assert shown.decode("utf-8", "replace").strip() == predictions[3] and f"over its {name} output" in drawn["title"]


def test_beam_search_and_mbr_over_it_are_told_apart_when_a_checkpoint_is_picked(tmp_path):
    """pick_checkpoint compares the decodings its candidates were scored with: an MBR evaluation of one
    beside a beam evaluation of the other is refused (their decoding names differ), not ranked."""
    run = _eval_run(tmp_path)
    flags = ["--split", "validation", "--beam-size", "4"]
    evaluate.main(["--checkpoint", str(run / "best.pt"), "--out", str(run / "best"), *flags])
    (run / "averaged.pt").write_bytes((run / "best.pt").read_bytes())
    evaluate.main(["--checkpoint", str(run / "averaged.pt"), "--out", str(run / "averaged"), *flags, "--mbr", "4"])
    _pick_refused(_pick(run), f"the candidates of {run} were scored differently (decoding)")
