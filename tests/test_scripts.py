"""The analysis scripts under scripts/ that no other test file covers, run as commands: a user error
is one `error:` line and exit status 2 (`scratchformer.cli.run`), and nothing already written is lost.
(pick_checkpoint.py: tests/test_average.py; source_use.py: tests/test_copy_run.py.)"""

import contextlib
import gzip
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, TINY_CLASSIFIER, translation_folder

from scratchformer import cli, train
from scratchformer.data.tokenizer import BPETokenizer

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _script(name, *args):
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True)


def _refused(done, *phrases):
    """The script ended with one `error:` line holding every phrase, exit status 2."""
    assert done.returncode == 2 and done.stderr.startswith("error: "), (done.returncode, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and all(p in done.stderr for p in phrases), done.stderr


# --- scripts/samsum_short.py ---------------------------------------------------------------------

def _write_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def samsum(tmp_path):
    """A SAMSum-like folder (3 short and 3 long training dialogues, 2 validation) and a tokenizer."""
    data = tmp_path / "samsum"
    data.mkdir()
    train_rows = [{"id": str(i), "document": "A: hi . " * (2 if i % 2 else 40), "summary": "hi"} for i in range(6)]
    _write_gz(data / "train.jsonl.gz", train_rows)
    _write_gz(data / "validation.jsonl.gz", [{"id": "v0", "document": "B: yes .", "summary": "yes"}] * 2)
    tok = tmp_path / "tokenizer.json"
    BPETokenizer.train([r["document"] for r in train_rows], vocab_size=300).save(tok)
    return data, tok


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_samsum_short_refuses_to_write_over_its_input(samsum, tmp_path):
    """--out the --data folder rewrote the source's train split with the short dialogues only (half
    of it lost), then crashed (SameFileError); a file of it under another folder the same."""
    data, tok = samsum
    before = _files(data)
    (tmp_path / "link").symlink_to(data)
    for out, extra in ((data, ()), (tmp_path / "link", ("--overwrite",))):
        _refused(_script("samsum_short.py", "--data", data, "--tokenizer", tok, "--max-src-tokens", 30,
                         "--out", out, *extra), "is the --data folder")
    other = tmp_path / "other"
    other.mkdir()
    (other / "train.jsonl.gz").symlink_to(data / "train.jsonl.gz")
    _refused(_script("samsum_short.py", "--data", data, "--tokenizer", tok, "--max-src-tokens", 30, "--out", other,
                     "--overwrite"), f"is the input {data / 'train.jsonl.gz'}")
    assert _files(data) == before


def test_samsum_short_keeps_an_existing_folder_without_overwrite(samsum, tmp_path):
    data, tok = samsum
    out = tmp_path / "short"
    done = _script("samsum_short.py", "--data", data, "--tokenizer", tok, "--max-src-tokens", 30, "--out", out)
    assert done.returncode == 0 and "3 of 6 training dialogues" in done.stdout, done.stderr
    with gzip.open(out / "train.jsonl.gz", "rt") as f:
        assert [json.loads(line)["id"] for line in f] == ["1", "3", "5"]
    assert (out / "validation.jsonl.gz").read_bytes() == (data / "validation.jsonl.gz").read_bytes()
    first = _files(out)
    again = ("--data", data, "--tokenizer", tok, "--max-src-tokens", 1000, "--out", out)
    _refused(_script("samsum_short.py", *again), "already holds train.jsonl.gz, validation.jsonl.gz, meta.json",
             "--overwrite")
    assert _files(out) == first
    done = _script("samsum_short.py", *again, "--overwrite")
    assert done.returncode == 0 and "6 of 6 training dialogues" in done.stdout, done.stderr
    assert sorted(_files(out)) == ["meta.json", "train.jsonl.gz", "validation.jsonl.gz"]  # no temp files left


def test_samsum_short_bad_input_is_one_error_line(samsum, tmp_path):
    data, tok = samsum
    (tmp_path / "afile").write_text("x")
    for args, phrase in (((tmp_path, tok, tmp_path / "o1"), "no train.jsonl.gz"),
                         ((data, tmp_path / "afile", tmp_path / "o2"), "not a valid tokenizer file"),
                         ((data, tok, tmp_path / "afile"), "is a file, not a folder")):
        _refused(_script("samsum_short.py", "--data", args[0], "--tokenizer", args[1], "--out", args[2]), phrase)
    _refused(_script("samsum_short.py", "--data", data, "--tokenizer", tok, "--out", tmp_path / "o3",
                     "--max-src-tokens", 0), "--max-src-tokens must be >= 1")
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))


# --- scripts/graph_shapes.py ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A translation run and a classification run, both trained one step on a --data folder (so
    args.json's task is None: inferred from the data)."""
    root = tmp_path_factory.mktemp("shapes")
    mt = translation_folder(root)
    clf = root / "toy_clf"
    clf.mkdir()
    for split, n in (("train", 40), ("validation", 8)):
        rows = [{"text": f"text number {i} " + "good " * (i % 3), "label": i % 2} for i in range(n)]
        (clf / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, data, tiny in (("mt", mt, TINY), ("clf", clf, TINY_CLASSIFIER)):
        train.main(tiny + ["--data", str(data), "--max-steps", "1", "--no-plots", "--out", str(root / name)])
    assert json.loads((root / "clf" / "args.json").read_text())["task"] is None
    return root


def test_graph_shapes_replays_a_run_and_refuses_bad_input(runs, tmp_path):
    done = _script("graph_shapes.py", runs / "mt", "--steps", 4, "--pad-multiples", 1, 8)
    assert done.returncode == 0 and done.stdout.count("pad multiple") == 2, done.stderr
    # --data: the folder holding the run's data folder (toy_mt, not the dataset name "synthetic")
    moved = _script("graph_shapes.py", runs / "mt", "--steps", 4, "--pad-multiples", 1, 8, "--data", runs)
    assert moved.returncode == 0 and moved.stdout == done.stdout, moved.stderr
    _refused(_script("graph_shapes.py", runs / "mt", "--steps", 4, "--data", tmp_path), f"{tmp_path / 'toy_mt'}")
    for steps in (0, -3):
        _refused(_script("graph_shapes.py", runs / "mt", "--steps", steps), f"--steps must be >= 1, got {steps}")
    _refused(_script("graph_shapes.py", runs / "mt", "--steps", 4, "--pad-multiples", 8, 0),
             "--pad-multiples must be >= 1, got 0")
    _refused(_script("graph_shapes.py", tmp_path / "nosuch", "--steps", 4), "nosuch: no such run folder")
    _refused(_script("graph_shapes.py", runs / "mt" / "best.pt", "--steps", 4), "best.pt: a file, not a run folder")


def test_graph_shapes_refuses_a_classification_run_whose_task_was_inferred(runs):
    """args.json holds task None when the task came from the data: the refusal of encoder-only runs
    tested that None and let the run through, to an AttributeError on its missing target side."""
    _refused(_script("graph_shapes.py", runs / "clf", "--steps", 2), "a classification run",
             "no target side")


_spec = importlib.util.spec_from_file_location("graph_shapes", SCRIPTS / "graph_shapes.py")
graph_shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph_shapes)
LINE = re.compile(r"pad multiple +(\d+): +(\d+) shapes .*?, +(\d+) captured, (\d+) of (\d+) steps replayed .*?, "
                  r"([\d.]+)% of the padded tokens padding")


def _shapes(run, *args):
    """graph_shapes.py RUN ARGS in this process (`cli.run`: a refusal is exit status 2) -> (status, the parsed
    lines: (multiple, shapes, captured, replayed, steps, padding %) each, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.run(graph_shapes.main, [str(run), *map(str, args)])
    rows = [tuple(float(x) if i == 5 else int(x) for i, x in enumerate(m.groups()))
            for m in LINE.finditer(out.getvalue())]
    return code, rows, err.getvalue()


def test_graph_shapes_counts_what_one_step_launches_and_what_padding_adds(runs):
    """One step is one batch: its shape launched, none captured (a shape's graph is captured at its
    second step) and none replayed, whatever the epoch holds beside it. Lengths padded up to 64 (the
    toy sentences: 2-5 words, a few tokens each) make most of each batch padding: over 3/4 of it,
    and more than without padding; replayed steps are the steps less the shapes (each launched once)."""
    code, rows, err = _shapes(runs / "mt", "--steps", 1, "--pad-multiples", 1, 64)
    assert code == 0, err
    assert [r[1:5] for r in rows] == [(1, 0, 0, 1), (1, 0, 0, 1)], rows
    assert rows[1][5] > 75.0 and rows[0][5] < rows[1][5], rows
    code, rows, err = _shapes(runs / "mt", "--steps", 7, "--pad-multiples", 1)
    ((_, shapes, captured, replayed, steps, _),) = rows
    assert steps == 7 and replayed == steps - shapes and 0 < captured <= shapes, rows


def test_graph_shapes_refuses_accumulated_steps_and_replays_bpe_dropout_zero_as_none(runs, tmp_path):
    """A step of a --grad-accum run is several batches: refused, not replayed as one. --bpe-dropout 0
    on a run trained with BPE-dropout replays it without (0 is a value, not "the run's own"): the
    same lines as the same run trained without."""
    plain = _shapes(runs / "mt", "--steps", 5, "--pad-multiples", 1, 8)
    assert plain[0] == 0 and len(plain[1]) == 2, plain
    for key, value in (("grad_accum", 2), ("bpe_dropout", 0.1)):
        copy = tmp_path / key
        shutil.copytree(runs / "mt", copy)
        args = json.loads((copy / "args.json").read_text())
        (copy / "args.json").write_text(json.dumps({**args, key: value}))
        if key == "grad_accum":
            code, _, err = _shapes(copy, "--steps", 5)
            assert code == 2 and "grad_accum 2" in err, err
        else:
            assert _shapes(copy, "--steps", 5, "--pad-multiples", 1, 8, "--bpe-dropout", 0) == plain
