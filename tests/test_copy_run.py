"""`train --copy` end to end on a toy task (the run's model copies, evaluates and generates), and
the encoder check of scripts/source_use.py on it: a collapsed encoder is measured as collapsed, at
the layer where it collapses."""

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, translation_folder

from scratchformer import cli, generate, train
from scratchformer import data as D
from scratchformer.checkpoint import load_checkpoint, save_checkpoint
from scratchformer.data.batching import collate, encode_examples
from scratchformer.evaluation.loading import load_run

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "source_use.py"
_spec = importlib.util.spec_from_file_location("source_use", SCRIPT)
source_use = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(source_use)


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


def test_source_use_nll_is_the_mean_over_real_target_tokens_with_own_and_rolled_sources(run):
    """The two NLLs per target token, against the same model run one example at a time (no padding
    to leave out): with its own source, and with the source of the example before it (the rolled
    batch: example i reads source i - 1, the first the last's). A loss counting the padded targets,
    or sources not rolled (a gap of 0 whatever the model), differs."""
    folder, data = run
    threads, out = torch.get_num_threads(), io.StringIO()
    try:  # in this process (a subprocess imports torch again: seconds), which it sets to one thread on a CPU
        with contextlib.redirect_stdout(out):
            code = cli.run(source_use.main, ["--checkpoint", str(folder / "best.pt"), "--data", str(data), "-n", "6"])
    finally:
        torch.set_num_threads(threads)
    text = out.getvalue()
    assert code == 0, text
    own, other = map(float, re.search(r"own source ([\d.]+), another example's source ([\d.]+)", text).groups())
    model, toks, ckpt = load_run(str(folder / "best.pt"), "cpu", "eager")
    examples = D.load_split(D.resolve_source("synthetic", str(data), None), "validation", 6)
    ds, _ = encode_examples(examples, ckpt["task"], toks.src, toks.tgt, ckpt["args"]["max_src_len"],
                            ckpt["args"]["max_tgt_len"])
    items = [ds[i] for i in range(len(ds))]
    assert len(items) == 6 and len({len(it[2]) for it in items}) > 1  # targets of several lengths: a batch pads

    def nll(pairs):
        total = count = 0
        with torch.no_grad():
            for i, src_of in pairs:
                b = collate([(i, items[src_of][1], items[i][2])])
                logits = model(b.src, b.src_lengths, b.tgt_in, b.tgt_lengths)
                total += F.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), reduction="sum").item()
                count += b.tgt_out.numel()
        return total / count

    n = len(items)
    assert own == pytest.approx(nll([(i, i) for i in range(n)]), abs=1.5e-3)
    assert other == pytest.approx(nll([(i, (i - 1) % n) for i in range(n)]), abs=1.5e-3)
    assert abs(other - own) > 2e-3
    # example 0's encoder output, alone (no padded positions to leave out): the norm of its mean over
    # positions, and the mean distance of each position from that mean
    common, spread = map(float, re.search(r"example 0: common ([\d.]+), spread ([\d.]+)", text).groups())
    with torch.no_grad():
        b = collate([items[0]])
        memory = model.encode(b.src, b.src_lengths)[0]
    mean = memory.mean(0)
    assert common == pytest.approx(mean.norm().item(), abs=6e-3)
    assert spread == pytest.approx((memory - mean).norm(dim=-1).mean().item(), abs=6e-4)
