"""`train --copy` end to end on a toy task (the run's model copies, evaluates and generates), and
the encoder check of scripts/source_use.py on it: a collapsed encoder is measured as collapsed, at
the layer where it collapses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
