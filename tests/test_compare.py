"""`python -m scratchformer.compare`: the paired bootstrap against sacrebleu's own (BLEU, chrF) and
against the metrics recomputed on every resample (ROUGE, accuracy), rows matched by id, and the refusals."""

import json
import math
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.significance import PairedTest

from scratchformer import compare
from scratchformer.checkpoint import save_checkpoint
from scratchformer.evaluation import metrics as M
from scratchformer.evaluation.significance import Statistics, mcnemar

WORDS = "the a man woman dog runs sits on in red blue green street park ball table looks at".split()


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "." for _ in range(n)]


def _noisy(refs: list[str], rate: float, seed: int) -> list[str]:
    """Each reference with some of its words replaced: a system that is right at about 1 - rate."""
    rng = random.Random(seed)
    return [" ".join(w if rng.random() > rate else rng.choice(WORDS) for w in r.split()) for r in refs]


def _write(path, refs, preds, order=None):
    rows = [{"id": f"validation-{i}", "source": "x", "reference": r, "prediction": p}
            for i, (r, p) in enumerate(zip(refs, preds))]
    path.write_text("".join(json.dumps(rows[i]) + "\n" for i in order or range(len(rows))))
    return str(path)


def test_bleu_and_chrf_are_sacrebleus_paired_bootstrap(tmp_path):
    refs = _texts(120, 0)
    systems = [_noisy(refs, rate, seed) for seed, rate in enumerate((0.3, 0.25, 0.3))]  # the last: chance alone
    paths = [_write(tmp_path / f"s{i}.jsonl", refs, s) for i, s in enumerate(systems)]
    report = compare.main([*paths, "--samples", "300", "--seed", "7"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SACREBLEU_SEED", "7")
        _, expected = PairedTest([(p, s) for p, s in zip(paths, systems)], {"bleu": BLEU(), "chrf": CHRF()},
                                 [refs], test_type="bs", n_samples=300)()
    for metric, name in (("bleu", "BLEU"), ("chrf", "chrF2")):
        for path, theirs in zip(paths, expected[name]):
            ours = report["systems"][path][metric]
            assert ours["score"] == pytest.approx(theirs.score, abs=1e-9)
            assert ours["mean"] == pytest.approx(theirs.mean, abs=1e-4)  # sacrebleu's resamples: float32
            assert ours["ci"] == pytest.approx(theirs.ci, abs=1e-4)
            if path != paths[0]:
                assert ours["p"] == pytest.approx(theirs.p_value, abs=1e-12)
        assert report["systems"][paths[0]][metric]["p"] == 1.0
    assert report["systems"][paths[1]]["bleu"]["difference"] > 0


def _by_resample(metric, hyps_by_system, refs, samples, seed):
    """Every system's score on each resample, recomputed from the texts by `metrics` (independent of
    the per-example statistics compare sums)."""
    idx = np.random.default_rng(seed).choice(len(refs), size=(samples, len(refs)), replace=True)
    score = {"accuracy": lambda h, r: M.accuracy(h, r)}.get(metric, lambda h, r: M.rouge(h, r)[metric])
    return [np.array([score([h[i] for i in row], [refs[i] for i in row]) for row in idx]) for h in hyps_by_system]


@pytest.mark.parametrize("metric", ["rouge1", "rougeLsum", "accuracy"])
def test_rouge_and_accuracy_against_their_metric_on_every_resample(tmp_path, metric):
    n, samples, seed = 30, 40, 3
    if metric == "accuracy":
        rng = random.Random(0)
        refs = [rng.randint(0, 1) for _ in range(n)]
        systems = [[y if rng.random() < acc else 1 - y for y in refs] for acc in (0.7, 0.9)]
    else:
        refs = [t + " " + u for t, u in zip(_texts(n, 1), _texts(n, 2))]  # two sentences each
        systems = [_noisy(refs, 0.5, 3), _noisy(refs, 0.2, 4)]
    paths = [_write(tmp_path / f"s{i}.jsonl", refs, s) for i, s in enumerate(systems)]
    report = compare.main([*paths, "--samples", str(samples), "--seed", str(seed)] +
                          ([] if metric == "accuracy" else ["--metric", metric]))
    base, other = _by_resample(metric, systems, refs, samples, seed)
    full = [M.accuracy(s, refs) if metric == "accuracy" else M.rouge(s, refs)[metric] for s in systems]
    ours = report["systems"][paths[1]][metric]
    assert ours["score"] == pytest.approx(full[1], abs=1e-9)
    assert ours["difference"] == pytest.approx(full[1] - full[0], abs=1e-9)
    assert ours["mean"] == pytest.approx(other.mean(), abs=1e-9)
    diffs = np.sort(other - base)
    assert ours["difference_interval"] == pytest.approx([diffs[samples // 40], diffs[samples - samples // 40 - 1]])
    centred = np.abs(other - base) - np.abs(other - base).mean()
    assert ours["p"] == pytest.approx((np.sum(centred > abs(full[1] - full[0])) + 1) / (samples + 1))
    assert ours["p"] < 0.05  # 20 points of accuracy, 30% of the words: told apart on 40 examples
    if metric == "accuracy":  # McNemar's exact test, in exact arithmetic
        right = [[h == y for h, y in zip(s, refs)] for s in systems]
        k, n = sum(b and not a for a, b in zip(*right)), sum(a != b for a, b in zip(*right))
        assert ours["p_mcnemar"] == pytest.approx(
            min(1, 2 * Fraction(sum(math.comb(n, i) for i in range(min(k, n - k) + 1)), 2**n)), rel=1e-12)
    else:
        assert ours["p_mcnemar"] is None


def test_mcnemar_on_many_examples_and_on_none_that_differ():
    """2,000 discordant examples (2**-n underflows a float; p near 0.007), 7 (4 against 3) and none."""
    right_b = np.array([1] * 1060 + [0] * 940 + [1] * 500, dtype=bool)
    right_o = np.array([0] * 1060 + [1] * 940 + [1] * 500, dtype=bool)
    base, other = (Statistics(100.0 * r[:, None], None) for r in (right_b, right_o))
    k, n = 940, 2000
    exact = min(1, 2 * Fraction(sum(math.comb(n, i) for i in range(k + 1)), 2**n))
    assert 1e-3 < exact < 1e-2
    assert mcnemar(base, other) == pytest.approx(float(exact), rel=1e-9)
    near = Statistics(base.per_example.copy(), None)
    near.per_example[1057:1064, 0] = 100.0 - near.per_example[1057:1064, 0]  # 3 right -> wrong, 4 wrong -> right
    assert mcnemar(base, near) == 1.0  # 2 * P(X <= 3), X ~ Binomial(7, 1/2) = 1
    assert mcnemar(base, base) == 1.0


def test_rows_are_matched_by_id_and_an_identical_system_differs_by_nothing(tmp_path):
    refs = _texts(50, 5)
    hyps = _noisy(refs, 0.3, 6)
    a = _write(tmp_path / "a.jsonl", refs, hyps)
    shuffled = _write(tmp_path / "b.jsonl", refs, hyps, order=random.Random(0).sample(range(50), 50))
    report = compare.main([a, shuffled, "--samples", "100"])
    for metric in ("bleu", "chrf"):
        b = report["systems"][shuffled][metric]
        assert b["difference"] == 0 and tuple(b["difference_interval"]) == (0, 0) and b["p"] == 1.0
        assert b["score"] == report["systems"][a][metric]["score"]


def test_the_json_report_and_the_table(tmp_path, capsys):
    refs = _texts(30, 8)
    paths = [_write(tmp_path / f"s{i}.jsonl", refs, _noisy(refs, 0.3, i)) for i in range(2)]
    out = tmp_path / "comparison.json"
    report = compare.main([*paths, "--samples", "50", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    printed = capsys.readouterr().out
    assert "30 examples; paired bootstrap, 50 resamples, seed 12345" in printed
    assert printed.count("(baseline)") == 2  # a block per metric: BLEU, chrF
    assert compare.run([*paths, "--samples", "50", "--json", str(out)]) == 2  # exists: not replaced
    assert "--overwrite" in capsys.readouterr().err
    assert compare.run([*paths, "--samples", "50", "--json", str(out), "--overwrite"]) == 0
    kept = Path(paths[1]).read_text()  # a predictions file is never the report, even with --overwrite
    assert compare.run([*paths, "--samples", "50", "--json", paths[1], "--overwrite"]) == 2
    assert "is one of the predictions files to compare" in capsys.readouterr().err
    assert Path(paths[1]).read_text() == kept
    # nor a checkpoint (a model named by mistake: it was replaced by the report), nor a folder, named as --json
    ckpt = tmp_path / "best.pt"
    save_checkpoint(ckpt, {"model": {"w": torch.zeros(2)}})
    model = ckpt.read_bytes()
    assert compare.run([*paths, "--samples", "50", "--json", str(ckpt), "--overwrite"]) == 2
    assert f"--json {ckpt} is a checkpoint: write the comparison elsewhere" in capsys.readouterr().err
    assert ckpt.read_bytes() == model
    assert compare.run([*paths, "--samples", "50", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path} is a folder" in capsys.readouterr().err


def _refusal(capsys, argv) -> str:
    assert compare.run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_refusals_name_the_file_and_the_fault(tmp_path, capsys):
    refs = _texts(10, 9)
    a = _write(tmp_path / "a.jsonl", refs, refs)
    assert "two predictions files or more" in _refusal(capsys, [a])
    assert "given twice" in _refusal(capsys, [a, a])
    fewer = _write(tmp_path / "fewer.jsonl", refs[:9], refs[:9])
    assert "fewer.jsonl: not the examples of" in _refusal(capsys, [a, fewer])
    other_refs = _write(tmp_path / "other.jsonl", refs[::-1], refs)
    assert "another reference" in _refusal(capsys, [a, other_refs])
    (tmp_path / "gen.jsonl").write_text(json.dumps({"id": "validation-0", "prediction": "x"}) + "\n")
    assert "gen.jsonl:1: no 'reference'" in _refusal(capsys, [a, str(tmp_path / "gen.jsonl")])
    (tmp_path / "twice.jsonl").write_text((json.dumps({"id": 1, "reference": "a", "prediction": "a"}) + "\n") * 2)
    assert "twice.jsonl:2: id '1' again" in _refusal(capsys, [a, str(tmp_path / "twice.jsonl")])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    assert "bad.jsonl:1: bad JSON" in _refusal(capsys, [a, str(tmp_path / "bad.jsonl")])
    (tmp_path / "empty.jsonl").write_text("")
    assert "empty.jsonl: no predictions" in _refusal(capsys, [a, str(tmp_path / "empty.jsonl")])
    assert "no such file" in _refusal(capsys, [a, str(tmp_path / "missing.jsonl")])
    labels = [_write(tmp_path / f"labels{i}.jsonl", [0, 1] * 5, [i, 1] * 5) for i in range(2)]
    assert "--metric bleu does not score class ids" in _refusal(capsys, [*labels, "--metric", "bleu"])
    b = _write(tmp_path / "b.jsonl", refs, _noisy(refs, 0.3, 1))
    assert "--metric accuracy does not score texts" in _refusal(capsys, [a, b, "--metric", "accuracy"])
    assert "ints.jsonl: its predictions are not all texts" in _refusal(
        capsys, [a, _write(tmp_path / "ints.jsonl", refs, list(range(10)))])
    assert "its references are not all class ids" in _refusal(capsys, [_write(tmp_path / "texts.jsonl", refs, [1] * 10),
                                                                       _write(tmp_path / "t2.jsonl", refs, [0] * 10)])
    assert "--samples must be >= 1" in _refusal(capsys, [a, b, "--samples", "0"])
