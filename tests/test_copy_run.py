"""`train --copy` end to end on a toy task (the run's model copies, evaluates and generates), and
the encoder check of scripts/source_use.py on it: a collapsed encoder is measured as collapsed, at
the layer where it collapses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, translation_folder

from scratchformer import generate, train
from scratchformer.checkpoint import load_checkpoint, save_checkpoint
from scratchformer.evaluation.evaluate import load_run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "source_use.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("copy")
    data = translation_folder(root)
    folder = root / "run"
    train.main(TINY + ["--data", str(data), "--copy", "--layers", "2", "--max-steps", "8", "--eval-every", "8",
                       "--lr", "3e-3", "--warmup-steps", "1", "--no-plots", "--out", str(folder)])
    return folder, data


def test_train_copy_builds_evaluates_and_generates(run, tmp_path):
    folder, data = run
    assert json.loads((folder / "config.json").read_text())["copy"] is True
    model, _, _ = load_run(str(folder / "best.pt"), "cpu", "eager")
    assert model.copy is not None
    final = json.loads((folder / "metrics.final.json").read_text())
    assert "bleu" in json.dumps(final)
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"x{i}", "src": s}) + "\n" for i, s in enumerate(["one two", "red house"])]
    src.write_text("".join(lines))
    out = tmp_path / "out.jsonl"
    generate.main(["--checkpoint", str(folder), "--input", str(src), "--output", str(out), "--beam-size", "2"])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["x0", "x1"]


def _source_use(checkpoint, data):
    cmd = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--data", str(data), "-n", "6"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _spreads(text):
    """{stage: spread} from the 'common/spread by stage' line."""
    line = next(li for li in text.splitlines() if "by stage" in li).split(": ", 1)[1]
    return {part.rsplit(" ", 1)[0]: float(part.rsplit("/", 1)[1]) for part in line.split(", ")}


def test_source_use_finds_where_an_encoder_collapses(run, tmp_path):
    folder, data = run
    healthy = _spreads(_source_use(folder / "best.pt", data))
    assert list(healthy) == ["embedding", "layer 1", "layer 2"] and min(healthy.values()) > 0.1, healthy
    # Collapse layer 2 by hand: a zero gain on its last LayerNorm leaves the bias at every position.
    ckpt = load_checkpoint(folder / "best.pt")
    ckpt["model"]["encoder.layers.1.norm2.weight"].zero_()
    save_checkpoint(tmp_path / "collapsed.pt", ckpt)
    text = _source_use(tmp_path / "collapsed.pt", data)
    collapsed = _spreads(text)
    assert collapsed["embedding"] == healthy["embedding"] and collapsed["layer 1"] == healthy["layer 1"]
    assert collapsed["layer 2"] == 0.0 and "spread 0.000" in text, text


def _source_use_refused(*args):
    """source_use.py refused: one `error:` line (returned), exit status 2, no figures printed."""
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 2 and not done.stdout and done.stderr.startswith("error: "), (done.returncode, done)
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_source_use_refuses_what_it_would_measure_wrongly(run, tmp_path):
    """It printed figures for a translation model on summarization data, a gap of 0 for a validation
    split of one example (rolled onto itself), and an AssertionError for --device cuda without CUDA."""
    folder, data = run
    summ = tmp_path / "summ"
    summ.mkdir()
    rows = [{"document": f"one two red house {i} .", "summary": "one"} for i in range(4)]
    (summ / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = _source_use_refused("--checkpoint", folder / "best.pt", "--data", summ, "-n", 4)
    assert "is a translation model" in err and f"--data {summ} holds summarization data" in err, err
    one = tmp_path / "one"
    one.mkdir()
    (one / "validation.jsonl").write_text(json.dumps({"src": "one two", "tgt": "eins zwei"}) + "\n")
    err = _source_use_refused("--checkpoint", folder / "best.pt", "--data", one, "-n", 4)
    assert "validation split holds 1 example(s)" in err and "at least 2" in err, err
    if not torch.cuda.is_available():
        err = _source_use_refused("--checkpoint", folder / "best.pt", "--data", data, "--device", "cuda")
        assert "--device cuda: no CUDA device here" in err, err
    assert "no checkpoint at" in _source_use_refused("--checkpoint", tmp_path / "nosuch.pt", "--data", data)
