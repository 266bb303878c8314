"""Scoring given pairs (`evaluation.scoring`, `python -m scratchformer.score`): a target's log-probability
is the one decoding ranks it by, batched or alone; the command's records, output file and refusals."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from test_decoding import _eos_at, _model, _src
from test_predict import _make_run, _texts, _write_jsonl

from scratchformer import cli, generate, score
from scratchformer.data import DataError
from scratchformer.evaluation.loading import load_run
from scratchformer.evaluation.options import OptionError
from scratchformer.evaluation.scoring import target_log_probs
from scratchformer.model import BOS_ID, EOS_ID, PAD_ID, beam_search_nbest


def _teacher_forced(seqs: list[list[int]]):
    """tgt_in (BOS + each sequence but its last token), tgt_out (each sequence), padded, and their lengths."""
    T = max(len(s) for s in seqs)
    tgt_in = torch.tensor([[BOS_ID, *s[:-1]] + [PAD_ID] * (T - len(s)) for s in seqs])
    tgt_out = torch.tensor([s + [PAD_ID] * (T - len(s)) for s in seqs])
    return tgt_in, tgt_out, torch.tensor([len(s) for s in seqs])


@pytest.mark.parametrize("copy", [False, True])
def test_a_targets_log_probability_is_the_one_beam_search_ranks_it_by(copy):
    """The n-best hypotheses of beam search (4 sources x 4 beams, some ended by EOS, some cut at max_len),
    scored all in one batch and each alone: the sums of their log-probabilities are the search's scores
    times len ** length_penalty."""
    m = _model(copy=copy)
    with torch.no_grad():  # some hypotheses end, some are cut at max_len
        m.generator.bias[EOS_ID] = 4.0 if copy else 1.0
    src, sl = _src()
    tokens, scores = beam_search_nbest(m, src, sl, nbest=4, beam_size=4, max_len=5, length_penalty=0.7)
    seqs = [row[: _eos_at(row) + 1] for row in tokens.flatten(0, 1).tolist()]
    seqs = [[t for t in s if t != PAD_ID] for s in seqs]  # a hypothesis cut at max_len: no EOS, PAD after it
    assert any(s[-1] == EOS_ID for s in seqs) and any(s[-1] != EOS_ID for s in seqs), "test needs both kinds"
    rows = src.repeat_interleave(4, 0), sl.repeat_interleave(4)
    batched = target_log_probs(m, *rows, *_teacher_forced(seqs))
    want = scores.flatten() * torch.tensor([len(s) for s in seqs], dtype=torch.float64) ** 0.7
    torch.testing.assert_close(batched, want, rtol=1e-5, atol=1e-5)
    for i, s in enumerate(seqs[:6]):
        alone = target_log_probs(m, rows[0][i : i + 1, : rows[1][i]], rows[1][i : i + 1], *_teacher_forced([s]))
        torch.testing.assert_close(alone, batched[i : i + 1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    runs = {task: _make_run(root / task, task) for task in ("translation", "classification")}
    return {**runs, "ends_early": _make_run(root / "ends_early", "translation", eos_bias=3.0)}


def test_score_writes_each_pairs_record_in_input_order(runs, tmp_path, capsys):
    """Each pair's record: its id (or its place), the sum of its target's log-probabilities (EOS counted) as
    the library computes it for the pair alone, the token count, score = log_prob / tokens ** lp; stdout or
    --output (refused when it exists, without --overwrite); a summary on stderr."""
    texts = _texts(9, 4)
    rows = [{"src": s, "tgt": t, **({"id": f"p{i}"} if i % 2 else {})} for i, (s, t) in
            enumerate(zip(texts, _texts(9, 5), strict=True))]
    pairs = _write_jsonl(tmp_path / "pairs.jsonl.gz", rows)
    run = str(runs["translation"])
    records = score.main(["--checkpoint", run, "--input", str(pairs), "--length-penalty", "0.5", "--max-tokens", "40"])
    out = capsys.readouterr()
    assert [json.loads(line) for line in out.out.splitlines()] == records
    assert [r["id"] for r in records] == [f"p{i}" if i % 2 else i + 1 for i in range(9)]
    model, toks, _ = load_run(run)
    for row, r in zip(rows, records, strict=True):
        src = torch.tensor([toks.src.encode(row["src"]) + [2]])
        tgt = toks.tgt.encode(row["tgt"]) + [2]
        want = target_log_probs(model, src, torch.tensor([src.shape[1]]), *_teacher_forced([tgt])).item()
        assert r["tokens"] == len(tgt) and r["log_prob"] == pytest.approx(want, abs=2e-6)
        assert r["score"] == pytest.approx(r["log_prob"] / len(tgt) ** 0.5, abs=2e-6)
    total, tokens = sum(r["log_prob"] for r in records), sum(r["tokens"] for r in records)
    assert f"9 pairs, {tokens} target tokens, mean log-probability {total / tokens:.4f} a token (perplexity " \
           f"{math.exp(-total / tokens):.3f})" in out.err
    output = tmp_path / "scores.jsonl"
    one_a_batch = score.main(["--checkpoint", run, "--input", str(pairs), "--output", str(output), "--length-penalty",
                              "0.5", "--batch-size", "1"])
    assert [json.loads(line) for line in output.read_text().splitlines()] == one_a_batch
    for alone, r in zip(one_a_batch, records, strict=True):  # batched otherwise: the same to rounding
        assert alone == {**r, "score": pytest.approx(r["score"], abs=2e-6), "log_prob": pytest.approx(r["log_prob"],
                                                                                                      abs=2e-6)}
    with pytest.raises(FileExistsError, match=re.escape(f"{output} exists; pass --overwrite")):
        score.main(["--checkpoint", run, "--input", str(pairs), "--output", str(output)])
    score.main(["--checkpoint", run, "--input", str(pairs), "--output", str(output), "--overwrite"])
    assert [json.loads(line)["score"] for line in output.read_text().splitlines()] == \
        [pytest.approx(r["log_prob"] / r["tokens"], abs=2e-6) for r in records]


def test_scoring_generates_output_gives_the_score_generate_printed(runs):
    """generate --json's outputs, scored: the scores it printed for them (greedy and beam 3's), of a model
    whose outputs end early (not cut at --max-len)."""
    run = str(runs["ends_early"])
    model, toks, _ = load_run(run)
    checked = 0
    for beam in ("1", "3"):
        for r in generate.main(["--checkpoint", run, *[a for t in _texts(8, 6, 5) for a in ("--text", t)], "--json",
                                "--beam-size", beam, "--max-len", "8"]):
            src = torch.tensor([toks.src.encode(r["input"]) + [2]])
            tgt = toks.tgt.encode(r["output"]) + [2]
            got = target_log_probs(model, src, torch.tensor([src.shape[1]]), *_teacher_forced([tgt])).item()
            if len(tgt) <= 8:  # ended by EOS within --max-len, not cut there
                assert got / len(tgt) == pytest.approx(r["score"], abs=2e-6), r
                checked += 1
    assert checked >= 6


def test_score_refuses_what_it_cannot_score_naming_it(runs, tmp_path):
    run = str(runs["translation"])
    pairs = _write_jsonl(tmp_path / "pairs.jsonl", [{"src": "one two", "tgt": "drei"}])
    with pytest.raises(OptionError, match=r"scoring reads a target sequence's log-probability; this model is "
                                          r"classification"):
        score.main(["--checkpoint", str(runs["classification"]), "--input", str(pairs)])
    missing = _write_jsonl(tmp_path / "missing.jsonl", [{"src": "one", "tgt": "x"}, {"src": "two"}])
    with pytest.raises(DataError, match=r"missing\.jsonl:2: .*tgt"):
        score.main(["--checkpoint", run, "--input", str(missing)])
    long = _write_jsonl(tmp_path / "long.jsonl", [{"src": "one", "tgt": "two"}, {"id": "big", "src": "one",
                                                                                 "tgt": " ".join(["seven"] * 5000)}])
    with pytest.raises(DataError, match=r"long\.jsonl: pair 2 \(id 'big'\) holds \d+ source and \d+ target tokens, "
                                        r"more than the model's \d+ positions"):
        score.main(["--checkpoint", run, "--input", str(long)])
    best = str(runs["translation"] / "best.pt")
    kept = Path(best).read_bytes()
    for flags, error, message in [(["--length-penalty", "inf"], OptionError, "--length-penalty must be a number in "
                                                                             "[-50, 50]"),
                                  (["--length-penalty=1000"], OptionError, "got 1000.0"),  # 5 ** 1000 overflowed
                                  (["--length-penalty=-1000"], OptionError, "got -1000.0"),  # and 5 ** -1000 was 0
                                  (["--output", best, "--overwrite"], cli.UsageError, "is a checkpoint: write the "
                                                                                      "scores elsewhere"),
                                  (["--max-tokens", "0"], OptionError, "--max-tokens must be >= 1"),
                                  (["--output", str(pairs)], cli.UsageError, "is the --input: write the scores "
                                                                             "elsewhere"),
                                  (["--output", str(tmp_path)], cli.UsageError, "is a folder")]:
        with pytest.raises(error, match=re.escape(message)):
            score.main(["--checkpoint", run, "--input", str(pairs), *flags])
    assert Path(best).read_bytes() == kept
