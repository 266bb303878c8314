"""Data: file parsing and its errors, truncation, batching (exactly once, budgets, padding)."""

import errno
import gzip
import json
import lzma
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchformer import data as D
from scratchformer.data import files
from scratchformer.data.batching import _fit, _pad
from scratchformer.evaluation.predict import read_inputs
from scratchformer.model import BOS_ID, EOS_ID, PAD_ID, ModelConfig, Transformer
from scratchformer.training.build import load_data, run_split
from scratchformer.training.config import TrainConfig
from scratchformer.training.optim import label_smoothed_loss

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def write_jsonl(path, rows):
    """rows as JSON lines (strings as they are), gzip- or xz-compressed when the name says so."""
    text = "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(path.suffix)
    if opener:
        with opener(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


class CharTok:
    """A stand-in tokenizer: one id per character (ids >= 4)."""

    def encode_batch(self, texts):
        return [[4 + (ord(c) % 50) for c in t] for t in texts]


# --- synthetic task ----------------------------------------------------------------------------


def test_synthetic_is_seeded_and_reverses():
    a = D.synthetic_examples("train", 50, seed=7)
    assert [e.src for e in a] == [e.src for e in D.synthetic_examples("train", 50, seed=7)]
    assert [e.src for e in a] != [e.src for e in D.synthetic_examples("train", 50, seed=8)]
    # validation is drawn from its own stream, not a prefix of train
    assert [e.src for e in D.synthetic_examples("validation", 20, seed=7)] != [e.src for e in a[:20]]
    for e in a:
        words = e.src.split()
        assert e.tgt.split() == [D.DE_NUMBERS[D.EN_NUMBERS.index(w)] for w in reversed(words)]
    # each is named by its place in its split, the form a prediction of data without ids takes
    assert [e.id for e in a] == [f"train-{i}" for i in range(50)]


def test_synthetic_words_and_lengths_span_their_whole_range():
    """Each of the ten digits is drawn (nine too), each has its German word (sieben is seven, acht eight), and
    a sequence has from min_len to max_len words, both ends included."""
    german = {"zero": "null", "one": "eins", "two": "zwei", "three": "drei", "four": "vier", "five": "fünf",
              "six": "sechs", "seven": "sieben", "eight": "acht", "nine": "neun"}
    examples = D.synthetic_examples("train", 600, seed=5)
    assert {w for e in examples for w in e.src.split()} == set(german)
    for e in examples:
        assert e.tgt.split() == [german[w] for w in reversed(e.src.split())]
    assert {len(e.src.split()) for e in examples} == set(range(3, 11))
    assert {len(e.src.split()) for e in D.synthetic_examples("test", 100, seed=5, min_len=1, max_len=2)} == {1, 2}


def test_the_synthetic_source_is_a_translation_task_of_three_splits():
    """The synthetic source has train, validation and test, nothing else (has_split says so; asked for "dev" it
    names the splits, it raised a bare KeyError), and is read as translation only."""
    source = D.resolve_source()
    assert [D.has_split(source, s) for s in ("train", "validation", "test", "dev")] == [True, True, True, False]
    for call in (lambda: D.load_split(source, "dev"), lambda: D.synthetic_examples("dev", 3)):
        with pytest.raises(D.DataError, match=re.escape("synthetic task has splits ['train', 'validation', 'test'], "
                                                        "not 'dev'")):
            call()
    with pytest.raises(D.DataError, match="the synthetic task is a translation task, not classification"):
        D.resolve_source("synthetic", task="classification")


# --- parsing and errors ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["train.jsonl", "train.jsonl.gz", "train.jsonl.xz"])
def test_read_jsonl_translation(tmp_path, name):
    p = write_jsonl(tmp_path / name, [{"src": "a b", "tgt": "c"}, "", {"src": "Grüße", "tgt": "x"}])
    rows = D.read_split(p, "translation")
    assert [(r.src, r.tgt) for r in rows] == [("a b", "c"), ("Grüße", "x")]  # blank line skipped
    assert D.find_split_file(tmp_path, "train") == p  # a folder's split is found by any of the names
    assert [i.text for i in read_inputs(p, "translation")] == ["a b", "Grüße"]  # generate --input reads it too


@pytest.mark.parametrize(
    "line, task, message",
    [
        ('{"src": "a", "tgt": ', "translation", "bad JSON"),
        ('{"src": "a"}', "translation", "missing field 'tgt'"),
        ('{"src": null, "tgt": "b"}', "translation", "field 'src' is null"),  # was "missing field 'src' (...; have src"
        ('{"src": 3, "tgt": "b"}', "translation", "field 'src' must be a string, got int"),
        ('{"src": "  ", "tgt": "b"}', "translation", "field 'src' is empty"),
        ('{"document": "d", "summary": ["s"]}', "summarization", "field 'summary' must be a string, got list"),
        ('{"text": "t", "label": "pos"}', "classification", "field 'label' must be an integer"),
        ('{"text": "t", "label": true}', "classification", "field 'label' must be an integer"),
        ('{"text": "t", "label": -1}', "classification", "field 'label' must be >= 0, got -1"),
        ('["not", "an", "object"]', "translation", "expected a JSON object"),
        ('{"src": "smile \\ud83d", "tgt": "b"}', "translation",  # half an emoji: the tokenizer failed on it, unnamed
         "field 'src' holds an unpaired surrogate (\\ud83d at character 7"),
        ('{"document": "d", "summary": "\\udc00 x"}', "summarization", "field 'summary' holds an unpaired surrogate"),
    ],
)
def test_read_jsonl_errors_name_file_and_line(tmp_path, line, task, message):
    good = {"translation": {"src": "a", "tgt": "b"}, "summarization": {"document": "d", "summary": "s"},
            "classification": {"text": "t", "label": 0}}[task]
    p = write_jsonl(tmp_path / "train.jsonl", [good, good, line])
    with pytest.raises(D.DataError) as e:
        D.read_split(p, task)
    print(e.value)
    assert f"{p}:3:" in str(e.value) and message in str(e.value)


def test_a_split_in_two_files_and_a_file_for_a_folder_are_refused_by_name(tmp_path):
    """train.jsonl beside train.jsonl.gz: either might be the one meant (one was read, unnamed); --data
    naming a file, not the folder of its splits."""
    p = write_jsonl(tmp_path / "train.jsonl", [{"src": "a", "tgt": "b"}])
    assert D.find_split_file(tmp_path, "train") == p
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write('{"src": "c", "tgt": "d"}\n')
    with pytest.raises(D.DataError, match=r"2 files hold the train split \(train.jsonl, train.jsonl.gz\): keep one"):
        D.find_split_file(tmp_path, "train")
    with pytest.raises(D.DataError, match=r"2 files hold the train split"):
        D.resolve_source(data=str(tmp_path))  # its task is read from the first record of a split
    with pytest.raises(D.DataError, match=r"--data .*train.jsonl: a file: give the folder that holds the splits"):
        D.resolve_source(data=str(p))


def test_empty_and_missing_split(tmp_path):
    p = write_jsonl(tmp_path / "validation.jsonl", ["", "  "])
    with pytest.raises(D.DataError, match="split is empty"):
        D.read_split(p, "translation")
    for name in ("nope.jsonl", "nope.parquet", "nope.csv"):  # whatever the format, known or not
        with pytest.raises(D.DataError, match=re.escape(f"{tmp_path / name}: no such file")):
            D.read_split(tmp_path / name, "translation")
    src = D.resolve_source(data=str(tmp_path), task="translation")
    with pytest.raises(D.DataError, match=r"no test split \(looked for test.jsonl[^;]*\)$"):
        D.load_split(src, "test")
    # a blind test's inputs (../shared/data/*/test_inputs.jsonl.gz, references withheld): said where they are
    write_jsonl(tmp_path / "test_inputs.jsonl", [{"src": "a"}])
    with pytest.raises(D.DataError, match=r"no test split \(looked for .*\); test_inputs.jsonl holds its inputs "
                                          r"without references: `generate --input` predicts them"):
        D.load_split(src, "test")


@pytest.mark.parametrize("split", ["", " ", "../mt/validation", "raw/../../mt/validation", "/abs/test", "a\\b",
                                   ".hidden", "..", "val..x", "a\0b"])
def test_a_split_is_a_plain_name(tmp_path, split):
    """A split names a file in the data folder: one with a path in it read a file outside it (../mt/validation
    read mt/validation.jsonl beside the folder), an empty one said "no  split". Every entry of the data
    layer refuses it by name, for a local folder, the synthetic task and the hub alike."""
    write_jsonl((tmp_path / "mt").mkdir() or tmp_path / "mt" / "validation.jsonl", [{"src": "a", "tgt": "b"}])
    (tmp_path / "raw" / "raw").mkdir(parents=True)
    write_jsonl(tmp_path / "raw" / "train.jsonl", [{"src": "a", "tgt": "b"}])
    local = D.resolve_source(data=str(tmp_path / "raw"), task="translation")
    message = re.escape(f"split {split!r}: not a split name (train, validation, test, ...)")
    for source in (local, D.resolve_source(), D.DataSource("hub", "multi30k", "translation")):
        for call in (D.load_split, D.has_split):
            with pytest.raises(D.DataError, match=message):
                call(source, split)
    with pytest.raises(D.DataError, match=message):
        D.find_split_file(tmp_path / "raw", split)
    assert D.check_split("validation") == "validation" and D.check_split("train[:10%]") == "train[:10%]"


# One reader (`data.files.read_lines`) serves the split files and the inputs of batch inference: both
# must turn every file fault into a DataError naming the file, and the line where there is one.
READERS = {
    "read_split": lambda p: D.read_split(p, "translation"),
    "read_inputs": lambda p: read_inputs(p, "translation"),
}
GOOD = b'{"src": "a b", "tgt": "c"}\n'


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("name, content, message", [
    # Latin-1 bytes on line 3: the line and the byte are named, not a bare UnicodeDecodeError.
    ("train.jsonl", GOOD * 2 + '{"src": "café", "tgt": "c"}\n'.encode("latin-1"),
     r"train\.jsonl:3: not UTF-8 text \(byte 0xe9 at byte 13 of the line\); save the file as UTF-8"),
    ("train.tsv", "a\tb\nné\tx\n".encode("latin-1"), r"train\.tsv:2: not UTF-8 text \(byte 0xe9"),
    ("train.jsonl.gz", _gz(GOOD + b'{"src": "\xff", "tgt": "c"}\n'), r"train\.jsonl\.gz:2: not UTF-8 text"),
    ("train.jsonl", "\ufeff".encode() + GOOD[:1] + b"\xa0" + GOOD[1:], r"train\.jsonl:1: not UTF-8"),
    # A plain file named .gz, a cut-short download, a flipped byte inside the compressed data.
    ("train.jsonl.gz", GOOD * 3, r"train\.jsonl\.gz: not a gzip file, though named \.gz \(no gzip header\)"),
    ("train.jsonl.gz", _gz(GOOD * 200)[:40], r"train\.jsonl\.gz: the gzip stream is cut short after \d+ complete"),
    ("train.jsonl.gz", _gz(GOOD * 200)[:-6] + b"\xff" * 6, r"train\.jsonl\.gz: corrupt gzip data after \d+"),
    # Bytes after the last member that are no gzip header: corrupt data after the lines read, not "not a gzip file"
    ("train.jsonl.gz", _gz(GOOD * 3) + b"junk!", r"train\.jsonl\.gz: corrupt gzip data after 3 complete line\(s\)"),
    # A flipped byte in the deflate data itself: zlib's error, not gzip's, named alike
    ("train.jsonl.gz", _gz(GOOD * 200)[:10] + b"\xff" + _gz(GOOD * 200)[11:],
     r"train\.jsonl\.gz: corrupt gzip data after 0 complete line\(s\) \(Error -3 while decompressing"),
    # The same three for xz (scripts/pack_gpu_data.sh packs CNN/DailyMail so).
    ("train.jsonl.xz", GOOD * 3, r"train\.jsonl\.xz: not an xz file, though named \.xz \(no xz header\)"),
    ("train.jsonl.xz", lzma.compress(GOOD * 200)[:40], r"train\.jsonl\.xz: the xz stream is cut short after \d+"),
    ("train.jsonl.xz", lzma.compress(GOOD * 200)[:-6] + b"\xff" * 6, r"train\.jsonl\.xz: corrupt xz data after \d+"),
])
def test_file_faults_name_the_file_and_line(tmp_path, reader, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(D.DataError, match=message) as e:
        READERS[reader](path)
    print(e.value)
    assert str(e.value).startswith(str(path))
    assert path.read_bytes() == content and sorted(tmp_path.iterdir()) == [path]  # reading changed nothing


@pytest.mark.parametrize("reader", READERS)
def test_byte_order_mark_and_crlf_are_read(tmp_path, reader):
    path = tmp_path / "train.jsonl"
    path.write_bytes("\ufeff".encode() + GOOD.replace(b"\n", b"\r\n") * 2)
    assert len(READERS[reader](path)) == 2


def test_read_lines_yields_each_line_as_written_less_its_line_ending(tmp_path):
    """read_lines drops a line's ending (\\n or \\r\\n) and the byte-order mark that leads the file, nothing
    else: spaces and tabs at either end are text (a TSV line 'world<TAB>' is two columns, the second empty),
    and U+FEFF at the start of a later line is a character of that line, not a mark."""
    path = tmp_path / "lines.txt"
    path.write_bytes("\ufeffone \t\r\n  two\n\ufeffthree\r\nlast\t".encode())
    assert list(files.read_lines(path)) == [(1, "one \t"), (2, "  two"), (3, "\ufeffthree"), (4, "last\t")]
    tsv = tmp_path / "train.tsv"
    tsv.write_text("hello\thallo\nworld\t\n", encoding="utf-8")
    with pytest.raises(D.DataError, match=re.escape(f"{tsv}:2: field 'tgt' is empty")):
        D.read_split(tsv, "translation")


@pytest.mark.parametrize("reader", READERS)
def test_a_folder_or_missing_file_is_named(tmp_path, monkeypatch, reader):
    with pytest.raises(D.DataError, match=r"nope\.jsonl: no such file"):
        READERS[reader](tmp_path / "nope.jsonl")
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(D.DataError, match=r"dir\.jsonl: is a folder, not a file"):
        READERS[reader](tmp_path / "dir.jsonl")
    path = write_jsonl(tmp_path / "locked.jsonl", [{"src": "a", "tgt": "b"}])

    def refuse(f, mode="r"):  # simulated: the tests run as root, who reads anything
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(f))

    monkeypatch.setattr(files, "open", refuse, raising=False)
    with pytest.raises(D.DataError, match=r"locked\.jsonl: cannot read \(Permission denied\)"):
        READERS[reader](path)


def test_infer_task_reads_through_the_same_reader(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b'{"t\xe9xt": "a", "label": 0}\n')
    with pytest.raises(D.DataError, match=r"train\.jsonl:1: not UTF-8"):
        D.resolve_source(data=str(tmp_path))
    (tmp_path / "meta.json").write_text('["not", "an object"]')
    with pytest.raises(D.DataError, match=r"meta\.json: expected a JSON object, got list"):
        D.resolve_source(data=str(tmp_path))
    (tmp_path / "meta.json").write_text('{"task": "classification",\n "labels": }')
    with pytest.raises(D.DataError, match=r"meta\.json:2: bad JSON"):
        D.resolve_source(data=str(tmp_path))
    # with --task the task is not inferred, but the class names are still read, through read_json; labels
    # keyed by name once failed in int() ("invalid literal"), unnamed
    for task in (None, "classification"):
        with pytest.raises(D.DataError, match=r"meta\.json:2: bad JSON"):
            D.resolve_source(data=str(tmp_path), task=task)
    (tmp_path / "meta.json").write_text('{"task": "classification", "labels": {"negative": 0, "positive": 1}}')
    with pytest.raises(D.DataError, match=r"meta\.json: 'labels' must map class ids to names, .*got \['negative', "):
        D.resolve_source(data=str(tmp_path), task="classification")
    (tmp_path / "meta.json").write_text('{"task": "classification", "labels": {"1": "pos", "0": "neg"}}')
    assert D.resolve_source(data=str(tmp_path), task="classification").labels == {0: "neg", 1: "pos"}


def test_meta_json_task_must_be_known_and_its_byte_order_mark_is_read(tmp_path):
    """A meta.json task that is not one of TASKS ("extractiv") was ignored and the task guessed from the
    fields (summarization): now refused naming the file, the task and the tasks, with --task too (the
    file is read for its class names). A meta.json an editor saved with a byte-order mark was "bad JSON
    (Unexpected UTF-8 BOM)", while split files with one are read: read alike."""
    write_jsonl(tmp_path / "train.jsonl", [{"document": "A text .", "summary": "A ."}])
    meta = tmp_path / "meta.json"
    for task in ("extractiv", 3, ""):
        meta.write_text(json.dumps({"task": task}))
        for given in (None, "summarization"):
            with pytest.raises(D.DataError, match=re.escape(f"{meta}: unknown task {task!r} (the tasks: "
                                                            f"{', '.join(D.TASKS)})")):
                D.resolve_source(data=str(tmp_path), task=given)
    meta.write_bytes("\ufeff".encode() + json.dumps({"task": "extractive", "labels": {"0": "x"}}).encode())
    source = D.resolve_source(data=str(tmp_path))
    assert (source.task, source.labels) == ("extractive", {0: "x"})
    meta.write_bytes(b'{"task":\n "caf\xe9"}')
    with pytest.raises(D.DataError, match=re.escape(f"{meta}:2: not UTF-8 text (byte 0xe9")):
        D.resolve_source(data=str(tmp_path))


def test_read_tsv_positional_and_header(tmp_path):
    p = tmp_path / "train.tsv"
    p.write_text("hello\thallo\nworld\twelt\n", encoding="utf-8")
    assert [(r.src, r.tgt) for r in D.read_split(p, "translation")] == [("hello", "hallo"), ("world", "welt")]
    p.write_text("label\ttext\n1\tgood\n0\tbad\n", encoding="utf-8")
    assert [(r.src, r.tgt) for r in D.read_split(p, "classification")] == [("good", 1), ("bad", 0)]
    p.write_text("label\ttext\nx\tgood\n", encoding="utf-8")
    with pytest.raises(D.DataError, match=f"{p}:2: field 'label' must be an integer"):
        D.read_split(p, "classification")
    p.write_text("a\tb\tc\n", encoding="utf-8")
    with pytest.raises(D.DataError, match=f"{p}:1: expected 2 tab-separated columns"):
        D.read_split(p, "translation")
    # the header is the first row that is not blank (it was read as an example after a blank first
    # line); a lone carriage return or a quote inside a field is text (csv raised its own error there);
    # errors name the file's line
    p.write_bytes(b"\n  \nsrc\ttgt\nfoo\tbar\r\nsay \"hi\tsag \"hallo\nit\rs\tes\n\na\tb\tc\n")
    with pytest.raises(D.DataError, match=f"{p}:8: expected 2 tab-separated columns, got 3"):
        D.read_split(p, "translation")
    p.write_bytes(b"\n  \nsrc\ttgt\nfoo\tbar\r\nsay \"hi\tsag \"hallo\nit\rs\tes\n")
    assert [(r.src, r.tgt) for r in D.read_split(p, "translation")] == [
        ("foo", "bar"), ('say "hi', 'sag "hallo'), ("it\rs", "es")]
    # only the first row can be a header: a later row holding the field names is an example
    p.write_text("hello\thallo\nsrc\ttgt\n", encoding="utf-8")
    assert [(r.src, r.tgt) for r in D.read_split(p, "translation")] == [("hello", "hallo"), ("src", "tgt")]


def test_a_records_id_is_text_whatever_its_json_type(tmp_path):
    """Example.id is a str (or None without one): 7 and "7" are one id in the predictions written."""
    rows = [{"id": 7, "src": "a", "tgt": "b"}, {"id": "x", "src": "c", "tgt": "d"}, {"src": "e", "tgt": "f"}]
    assert [e.id for e in D.read_split(write_jsonl(tmp_path / "train.jsonl", rows), "translation")] == ["7", "x", None]


@pytest.mark.parametrize("ids, first, second, rid", [
    ([7, "x", "7"], 0, 2, "7"),  # 7 and "7" are one id
    ([None, "validation-0", None], 0, 1, "validation-0"),  # an own id equal to one an example without gets
])
def test_two_examples_of_an_evaluated_split_sharing_an_id_are_refused(tmp_path, ids, first, second, rid):
    """Their predictions (predictions.validation.jsonl) would be written under one id and could not be
    told apart: validation was read as given. A train split is read as given (nothing is written by id)."""
    rows = [{"src": f"s{i}", "tgt": "t", **({"id": x} if x is not None else {})} for i, x in enumerate(ids)]
    for split in ("train", "validation"):
        write_jsonl(tmp_path / f"{split}.jsonl", rows)
    src = D.resolve_source(data=str(tmp_path), task="translation")
    assert len(D.load_split(src, "train")) == 3
    with pytest.raises(D.DataError, match=rf"validation.jsonl: examples {first} and {second} \(counting from 0\) "
                                          rf"share the id '{rid}'"):
        D.load_split(src, "validation")
    assert len(D.load_split(src, "validation", limit=second)) == second  # those before the second are fine


def test_infer_task_from_a_tsv_header(tmp_path):
    # docs/training.md: the task comes from meta.json or the fields of the first record; a TSV's header
    # row names its fields (only JSON lines were read: a TSV folder always needed --task)
    (tmp_path / "train.tsv").write_text("\nid\tsummary\tdocument\n1\tshort\ta long text\n", encoding="utf-8")
    src = D.resolve_source(data=str(tmp_path))
    assert src.task == "summarization"
    assert [(e.src, e.tgt) for e in D.load_split(src, "train")] == [("a long text", "short")]
    (tmp_path / "train.tsv").write_text("hello\thallo\n", encoding="utf-8")  # positional: which task is it?
    with pytest.raises(D.DataError, match="cannot tell the task .*; pass --task"):
        D.resolve_source(data=str(tmp_path))
    assert D.resolve_source(data=str(tmp_path), task="translation").task == "translation"


def test_infer_task_and_carve(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(40)])
    src = D.resolve_source(data=str(tmp_path))
    assert src.task == "classification" and not D.has_split(src, "validation")
    rows = D.load_split(src, "train")
    tr, va = D.carve_validation(rows, 0.25, seed=3)
    assert len(va) == 10 and len(tr) == 30
    assert {e.src for e in tr}.isdisjoint({e.src for e in va})
    assert [e.src for e in D.carve_validation(rows, 0.25, seed=3)[1]] == [e.src for e in va]  # seeded
    tr, va = D.carve_validation(rows[:5], 0.01, seed=3)  # a fraction of fewer than one example: still one
    assert len(va) == 1 and len(tr) == 4 and va[0] not in tr


def test_carving_takes_the_nearest_whole_number_of_examples():
    """carve_validation takes round(n * fraction) examples, not its floor: 10 at 0.29 is 2.9, 3 examples; 20 at
    0.16 is 3.2, 3; 10 at 0.71 is 7.1, 7. A fraction of 0 or 1 (or beyond) is refused: it leaves one side empty."""
    rows = [D.Example(f"t{i}", i % 2) for i in range(20)]
    for n, fraction, n_val in ((10, 0.29, 3), (20, 0.16, 3), (10, 0.71, 7)):
        train, valid = D.carve_validation(rows[:n], fraction, seed=1)
        assert (len(train), len(valid)) == (n - n_val, n_val)
    for fraction in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"validation fraction must be in \(0, 1\)"):
            D.carve_validation(rows, fraction, seed=1)


@pytest.mark.skipif(not (SHARED / "multi30k").is_dir(), reason="../shared/data is absent (CI puts it beside the clone)")
def test_shared_multi30k_slice():
    src = D.resolve_source(data=str(SHARED / "multi30k"))
    assert src.task == "translation"
    rows = D.load_split(src, "validation", limit=200)
    assert len(rows) == 200 and all(r.src and r.tgt for r in rows)


# --- encoding ----------------------------------------------------------------------------------


def test_truncation_policy_and_counts():
    ex = [D.Example("abcdefghij", "klmnopqrst"), D.Example("ab", "cd")]
    ds, st = D.encode_examples(ex, "translation", CharTok(), None, max_src_len=5, max_tgt_len=4)
    assert st.src_truncated == 1 and st.tgt_truncated == 1 and st.examples == 2
    assert len(ds.src[0]) == 5 and ds.src[0][-1] == EOS_ID  # first 4 tokens + EOS
    assert len(ds.tgt[0]) == 3  # y has max_tgt_len - 1 tokens: BOS + y and y + EOS fit in 4
    assert len(ds.src[1]) == 3 and ds.src[1][-1] == EOS_ID
    ds, st = D.encode_examples([D.Example("abcdef", 1)], "classification", CharTok(), max_src_len=4)
    assert st.src_truncated == 1 and len(ds.src[0]) == 4 and ds.tgt == [1]


def test_classification_empty_text_is_one_eos():
    ds, st = D.encode_examples([D.Example("", 0), D.Example("abc", 1)], "classification", CharTok(), max_src_len=2)
    assert ds.src[0].tolist() == [EOS_ID] and len(ds.src[1]) == 2 and st.src_truncated == 1
    # a text that fits is its tokens alone: no EOS (the classifier reads its [CLS])
    ds, st = D.encode_examples([D.Example("abc", 1)], "classification", CharTok(), max_src_len=8)
    assert ds.src[0].tolist() == CharTok().encode_batch(["abc"])[0] and st.src_truncated == 0


@pytest.mark.parametrize("eos", ["always", "if empty", "never"])
def test_vectorised_truncation_matches_a_loop(eos):
    """`_fit` (every sequence cut and ended at once) against the policy written per sequence, on
    random lengths with empty sequences, whole and on a slice of a Ragged."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(4, 100, size=int(n)).tolist() for n in rng.integers(0, 12, size=60)]
    ragged = D.Ragged.of(seqs)
    for part, sub in ((ragged, seqs), (ragged[7:31], seqs[7:31])):
        for keep in (1, 3, 11, 20):
            got, cut = _fit(part, keep, eos)
            want = [s[:keep] + ([EOS_ID] if eos == "always" or (eos == "if empty" and not s) else []) for s in sub]
            assert [g.tolist() for g in got] == want and cut == sum(len(s) > keep for s in sub)
            assert got.flat.dtype == np.int32 and len(got) == len(sub)


def test_ragged_indexing():
    r = D.Ragged.of([[1, 2], [], [3, 4, 5]])
    assert [x.tolist() for x in r] == [[1, 2], [], [3, 4, 5]] and r[-1].tolist() == [3, 4, 5]
    assert [x.tolist() for x in r[1:]] == [[], [3, 4, 5]] and len(r[2:2]) == 0 and r.lengths().tolist() == [2, 0, 3]
    with pytest.raises(IndexError):
        r[3]
    with pytest.raises(ValueError, match="contiguous"):
        r[::2]


def test_a_ragged_array_indexes_and_slices_as_the_list_of_its_sequences():
    """Ragged answers as the list it was made of: r[i] for every i in [-n, n) and IndexError beyond either end
    (r[-4] of 3 is no sequence), r[a:b] for every a and b (a start past its stop is empty, not of length -1),
    a step other than 1 refused (-1 too: the offsets cannot run backwards), and the ids held as int32."""
    seqs = [[1, 2], [], [3, 4, 5]]
    r = D.Ragged.of(seqs)
    assert r.flat.dtype == np.int32 and r.offsets.tolist() == [0, 2, 2, 5]
    for i in range(-3, 3):
        assert r[i].tolist() == seqs[i]
    for i in (-4, 3):
        with pytest.raises(IndexError):
            r[i]
    for a in range(-4, 5):
        for b in range(-4, 5):
            part = r[a:b]
            assert len(part) == len(seqs[a:b]) and [x.tolist() for x in part] == seqs[a:b], (a, b)
    for step in (2, -1):
        with pytest.raises(ValueError, match="contiguous"):
            r[::step]


def test_collate_pads_right():
    items = [(0, np.array([5, 6, EOS_ID]), np.array([7])), (1, np.array([8, EOS_ID]), np.array([9, 10, 11]))]
    b = D.collate(items)
    assert b.src.tolist() == [[5, 6, EOS_ID], [8, EOS_ID, PAD_ID]]
    assert b.src_lengths.tolist() == [3, 2]
    assert b.tgt_in.tolist() == [[BOS_ID, 7, PAD_ID, PAD_ID], [BOS_ID, 9, 10, 11]]
    assert b.tgt_out.tolist() == [[7, EOS_ID, PAD_ID, PAD_ID], [9, 10, 11, EOS_ID]]
    assert b.tgt_lengths.tolist() == [2, 4] and b.src.dtype == torch.int64
    c = D.collate([(3, np.array([5]), 1), (4, np.array([6, 7]), 0)])
    assert c.labels.tolist() == [1, 0] and c.tgt_in is None and c.src.tolist() == [[5, 0], [6, 7]]


def test_collate_equals_padding_row_by_row():
    """The vectorised padding (one scatter of every token) against rows filled one at a time:
    random lengths, empty sequences among them, int32 arrays and lists, every multiple."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        seqs = [rng.integers(4, 500, size=rng.integers(0, 9)).astype(np.int32) for _ in range(rng.integers(1, 7))]
        if trial % 2:
            seqs = [s.tolist() for s in seqs]
        for prefix, suffix, multiple in [(None, None, 1), (BOS_ID, None, 4), (None, EOS_ID, 3), (BOS_ID, EOS_ID, 8)]:
            rows = [([prefix] if prefix is not None else []) + list(s) + ([suffix] if suffix is not None else [])
                    for s in seqs]
            width = -(-max(map(len, rows)) // multiple) * multiple
            want = torch.tensor([r + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.int64)
            got, lengths = _pad(seqs, prefix, suffix, multiple)
            assert torch.equal(got, want) and lengths.tolist() == [len(r) for r in rows], (seqs, prefix, suffix)
            assert got.dtype == lengths.dtype == torch.int64


def test_collate_pads_to_a_multiple_and_the_loss_is_unchanged():
    """pad_multiple rounds each padded length up (src, tgt_in and tgt_out alike), keeps the lengths
    and the tokens, and the model's loss on the wider batch is the loss on the tight one."""
    items = [(0, np.array([5, 6, 7, 8, 9, EOS_ID]), np.array([7, 8])), (1, np.array([8, EOS_ID]), np.array([9] * 5))]
    tight, wide = D.collate(items), D.collate(items, pad_multiple=4)
    assert wide.src.shape == (2, 8) and wide.tgt_in.shape == wide.tgt_out.shape == (2, 8)
    for name in ("src", "tgt_in", "tgt_out"):
        t, w = getattr(tight, name), getattr(wide, name)
        assert torch.equal(w[:, : t.shape[1]], t) and (w[:, t.shape[1]:] == PAD_ID).all(), name
    assert torch.equal(wide.src_lengths, tight.src_lengths) and torch.equal(wide.tgt_lengths, tight.tgt_lengths)
    assert D.collate(items, pad_multiple=6).src.shape == (2, 6)  # already a multiple: unchanged
    torch.manual_seed(0)
    m = Transformer(ModelConfig(src_vocab_size=16, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                                d_ff=64, dropout=0.0, kernel="eager")).eval()

    def loss(b):
        logits = m(b.src, b.src_lengths, b.tgt_in, b.tgt_lengths)
        return label_smoothed_loss(logits.flatten(0, 1), b.tgt_out.flatten(), 0.1)[0]

    torch.testing.assert_close(loss(wide), loss(tight), atol=1e-6, rtol=1e-6)


# --- batching ----------------------------------------------------------------------------------

LENGTHS = np.random.default_rng(0).integers(1, 60, size=997).tolist()  # prime count: ragged last batch


@pytest.mark.parametrize("batch_size, max_tokens", [(32, None), (None, 500), (16, 300), (1, None), (None, 59)])
def test_sampler_each_example_once_and_budget(batch_size, max_tokens):
    s = D.BucketBatchSampler(LENGTHS, batch_size=batch_size, max_tokens=max_tokens, seed=1)
    for epoch in range(2):
        s.set_epoch(epoch)
        batches = list(s)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(LENGTHS)))  # exactly once per epoch
        for b in batches:
            if batch_size:
                assert len(b) <= batch_size
            if max_tokens and len(b) > 1:
                assert len(b) * max(LENGTHS[i] for i in b) <= max_tokens
        assert len(s) == len(batches)


@pytest.mark.parametrize("multiple", [8, 16])
def test_sampler_budget_counts_lengths_padded_to_the_multiple(multiple):
    """With pad_multiple the token budget holds for the padded batch (lengths rounded up), every
    example still comes once, and the batches take fewer distinct (rows, padded length) shapes."""
    def shapes(sampler, m):
        return {(len(b), max(-(-LENGTHS[i] // m) * m for i in b)) for b in sampler}

    s = D.BucketBatchSampler(LENGTHS, max_tokens=500, seed=1, pad_multiple=multiple)
    batches = list(s)
    assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
    for b in batches:
        if len(b) > 1:
            assert len(b) * max(-(-LENGTHS[i] // multiple) * multiple for i in b) <= 500
    assert len(shapes(batches, multiple)) < len(shapes(D.BucketBatchSampler(LENGTHS, max_tokens=500, seed=1), 1))
    with pytest.raises(ValueError, match="pad_multiple must be >= 1, got 0"):
        D.BucketBatchSampler(LENGTHS, max_tokens=500, pad_multiple=0)


def test_sampler_seeded_shuffle_and_resume_offset():
    s = D.BucketBatchSampler(LENGTHS, max_tokens=400, seed=5)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    assert list(s) != e0  # a new order each epoch
    t = D.BucketBatchSampler(LENGTHS, max_tokens=400, seed=5)
    t.set_epoch(0, start=7)
    assert list(t) == e0[7:]  # resume skips the batches already consumed
    u = D.BucketBatchSampler(LENGTHS, max_tokens=400, shuffle=False)
    assert sorted(i for b in u for i in b) == list(range(len(LENGTHS)))


def test_sampler_buckets_by_length_and_shuffles_the_batch_order():
    """Within a pool the examples are sorted by length before they are cut: with one pool for all,
    the batches' length ranges do not overlap (each batch's longest is at most the next one's
    shortest), so little is padding; and the batches then come in a seeded random order, not by length."""
    lengths = np.asarray(LENGTHS)
    s = D.BucketBatchSampler(LENGTHS, max_tokens=500, seed=3, pool_batches=10_000)
    batches = list(s)
    ranges = sorted((int(lengths[b].min()), int(lengths[b].max())) for b in batches)
    assert all(hi <= next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:]))
    padded = sum(len(b) * int(lengths[b].max()) for b in batches)
    assert padded - lengths.sum() < 0.1 * padded  # lengths 1-59 in ~500-token batches: few pad tokens
    longest = [int(lengths[b].max()) for b in batches]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    unshuffled = D.BucketBatchSampler(LENGTHS, max_tokens=500, shuffle=False, pool_batches=10_000)
    assert [i for b in unshuffled for i in b] == sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i])


def test_a_batch_counts_the_target_tokens_its_loss_is_summed_over():
    """num_tgt_tokens, the divisor of the step's summed loss, is the number of non-PAD tgt_out tokens
    (y + EOS per example), whatever the padding; a classifier's batch counts examples."""
    items = [(0, np.array([5, EOS_ID]), np.array([7])), (1, np.array([8, 9, EOS_ID]), np.array([9, 10, 11]))]
    for multiple in (1, 8):
        b = D.collate(items, pad_multiple=multiple)
        assert b.num_tgt_tokens == int((b.tgt_out != PAD_ID).sum()) == (1 + 1) + (3 + 1)
    assert D.collate([(0, np.array([5]), 0), (1, np.array([6, 7]), 1), (2, np.array([6]), 0)]).num_tgt_tokens == 3


def test_the_first_examples_keep_their_references():
    ex = [D.Example(f"src {i}", f"tgt {i}") for i in range(5)]
    ds, _ = D.encode_examples(ex, "translation", CharTok(), None, 64, 64)
    head = ds.first(2)
    assert len(head) == 2 and head.refs == ["tgt 0", "tgt 1"]
    assert [t.tolist() for t in head.tgt] == [ds.tgt[0].tolist(), ds.tgt[1].tolist()]


def test_sampler_distributed_partition():
    full = D.BucketBatchSampler(LENGTHS, batch_size=10, seed=2)
    parts = [D.BucketBatchSampler(LENGTHS, batch_size=10, seed=2, num_replicas=3, rank=r) for r in range(3)]
    lens = {len(p) for p in parts}
    assert len(lens) == 1  # every rank takes the same number of steps
    seen = [i for p in parts for b in p for i in b]
    assert set(seen) == set(range(len(LENGTHS)))  # every example covered (a few repeated as padding)
    assert len(seen) - len(LENGTHS) <= 2 * 10
    assert len(full) <= sum(len(p) for p in parts) < len(full) + 3


@pytest.mark.parametrize("replicas", [2, 3, 4, 5])
def test_rank_r_takes_batches_r_r_plus_R_of_one_processs_epoch_padded_with_its_first(replicas):
    """As DistributedSampler does (the sampler's docstring): the epoch's batches are one process's
    (the same seed on every rank, which the ranks must share: drawn per rank, examples would be
    trained twice or never), padded with its first batches up to a multiple of R (none when it is one:
    100 batches here, so R = 2, 4, 5 add none, R = 3 adds 2), and rank r takes batches r, r + R, r + 2R,
    ... (each epoch). Rank R and beyond are refused."""
    one = D.BucketBatchSampler(LENGTHS, batch_size=10, seed=2)
    ranks = [D.BucketBatchSampler(LENGTHS, batch_size=10, seed=2, num_replicas=replicas, rank=r)
             for r in range(replicas)]
    for epoch in (0, 1):
        for s in (one, *ranks):
            s.set_epoch(epoch)
        batches = list(one)
        assert len(batches) == 100
        padded = batches + batches[:(replicas - 100 % replicas) % replicas]
        for r, s in enumerate(ranks):
            assert list(s) == [padded[r + i * replicas] for i in range(len(padded) // replicas)]
    with pytest.raises(ValueError, match=rf"rank {replicas} must be in \[0, {replicas}\)"):
        D.BucketBatchSampler(LENGTHS, batch_size=10, num_replicas=replicas, rank=replicas)


@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_every_rank_gets_a_batch_when_there_are_fewer_batches_than_ranks(n):
    """n examples, 2 a batch, 8 ranks: the epoch's batches repeat cyclically until every rank has
    one (they were padded by at most their own number: with fewer than half as many batches as ranks
    the last ranks had none, refused training there, and the others hung in all-reduce)."""
    one = list(D.BucketBatchSampler([4] * n, batch_size=2, seed=0))
    ranks = [list(D.BucketBatchSampler([4] * n, batch_size=2, seed=0, num_replicas=8, rank=r)) for r in range(8)]
    assert [len(b) for b in ranks] == [1] * 8
    assert [b[0] for b in ranks] == [one[r % len(one)] for r in range(8)]


def test_loader_batches():
    ex = D.synthetic_examples("train", 40)
    ds, _ = D.encode_examples(ex, "translation", CharTok(), None, 64, 64)
    s = D.BucketBatchSampler(ds.lengths(), max_tokens=200, seed=0)
    ids = []
    for b in D.make_loader(ds, s):
        assert b.src.shape[0] == b.tgt_in.shape[0] == len(b)
        assert int(b.src_lengths.max()) == b.src.shape[1]  # dynamic padding: no all-pad column
        ids += b.ids.tolist()
    assert sorted(ids) == list(range(40))


def test_a_hub_dataset_without_validation_is_carved_in_training_and_evaluation_alike(monkeypatch):
    """HF imdb has no validation split: training carves one from train, trimmed to --max-valid-examples
    (the hub's carve ignored it), and evaluation's `run_split` carves the same examples again (it asked
    the hub for the split and failed)."""
    class FakeDatasets:
        @staticmethod
        def load_dataset(path, split, name=None):
            if split != "train":
                raise ValueError(f"Unknown split {split!r}")
            return [{"text": f"review {i}", "label": i % 2} for i in range(200)]

    monkeypatch.setitem(__import__("sys").modules, "datasets", FakeDatasets)
    monkeypatch.setattr(D.datasets, "local_folder", lambda name: None)
    src = D.resolve_source("imdb")
    cfg = TrainConfig(max_valid_examples=4, valid_fraction=0.1, seed=3)
    train, valid = load_data(cfg, src, type("Log", (), {"info": staticmethod(lambda msg: None)})())
    assert len(valid) == 4 and len(train) == 180 and {e.src for e in train}.isdisjoint(e.src for e in valid)
    assert [e.src for e in run_split(src, "validation", cfg, limit=4)] == [e.src for e in valid]


def test_hub_loading_maps_fields(monkeypatch):
    """Hub datasets are mapped to our fields (a fake `datasets` module: no network in CI)."""
    calls = []

    class FakeDatasets:
        @staticmethod
        def load_dataset(path, split, name=None):
            calls.append((path, name, split))
            if path == "iwslt2017":
                return [{"translation": {"en": "Hello", "de": "Hallo"}}]
            if path == "cnn_dailymail":
                return [{"article": "An article .", "highlights": "A highlight .", "id": "abc"}]
            return []

    monkeypatch.setitem(__import__("sys").modules, "datasets", FakeDatasets)
    monkeypatch.setattr(D.datasets, "local_folder", lambda name: None)  # pretend nothing is on disk
    src = D.resolve_source("iwslt2017")
    assert (src.kind, src.task) == ("hub", "translation")
    rows = D.load_split(src, "validation")
    assert (rows[0].src, rows[0].tgt) == ("Hello", "Hallo")
    assert calls[-1] == ("iwslt2017", "iwslt2017-en-de", "validation")
    rows = D.load_split(D.resolve_source("cnn_dailymail"), "train")
    assert (rows[0].src, rows[0].tgt, rows[0].id) == ("An article .", "A highlight .", "abc")
    assert calls[-1] == ("cnn_dailymail", "3.0.0", "train")
    imdb = D.resolve_source("imdb")
    assert imdb.labels == {0: "negative", 1: "positive"}  # the hub's class names, stored in checkpoints
    with pytest.raises(D.DataError, match="split 'test' is empty"):
        D.load_split(imdb, "test")
    with pytest.raises(D.DataError, match="unknown dataset 'nope'"):
        D.resolve_source("nope")


def test_a_named_dataset_found_nowhere_names_the_folders_looked_in_and_the_hubs_error(tmp_path, monkeypatch):
    """--dataset multi30k run from another folder than the checkout's: the error said only "not
    available locally", not where it had looked nor that SCRATCHFORMER_DATA points there; with the
    `datasets` package but no network its ConnectionError (an OSError) was a traceback, and so was
    datasets 4's RuntimeError for a hub dataset that is a loading script (iwslt2017's)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCHFORMER_DATA", str(tmp_path / "elsewhere"))
    here = Path(os.getcwd())
    looked = re.escape(", ".join(str(p / "multi30k") for p in (tmp_path / "elsewhere", here / "data",
                                                               here.parent / "shared" / "data")))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets: ImportError
    src = D.resolve_source("multi30k")
    with pytest.raises(D.DataError, match=rf"^no local copy of 'multi30k' \(looked in {looked}: SCRATCHFORMER_DATA=DIR "
                       r"looks in DIR/multi30k first; --data FOLDER reads a folder\), and loading it from the Hugging "
                       r"Face hub needs the 'datasets' package \(pip install datasets\) and a network$"):
        D.load_split(src, "train")

    def offline(path, split, name=None):
        raise ConnectionError("Couldn't reach 'bentrevett/multi30k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(D.DataError, match=rf"^no local copy of 'multi30k' \(looked in {looked}: .*\), and the Hugging "
                       r"Face hub did not give bentrevett/multi30k \[train\]: ConnectionError: Couldn't reach"):
        D.load_split(src, "train")

    def scripted(path, split, name=None):  # datasets >= 4.0 on a hub dataset that is still a loading script
        raise RuntimeError(f"Dataset scripts are no longer supported, but found {path}.py")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=scripted, __version__="4.1.0"))
    with pytest.raises(D.DataError, match=r"^no local copy of 'iwslt2017' \(looked in .*\), and datasets 4\.1\.0 "
                       r"could not load iwslt2017 \[validation\]: Dataset scripts are no longer supported, but found "
                       r"iwslt2017\.py; datasets 4\.0 and later run no loading script: pip install 'datasets<4', or "
                       r"put the data's files in a folder and pass --data DIR$"):
        D.load_split(D.resolve_source("iwslt2017"), "validation")
    (tmp_path / "data" / "multi30k").mkdir(parents=True)  # ./data/NAME, then the first of the places
    assert D.local_folder("multi30k") == Path("data/multi30k")
    (tmp_path / "elsewhere" / "multi30k").mkdir(parents=True)
    assert D.local_folder("multi30k") == tmp_path / "elsewhere" / "multi30k"


@pytest.mark.parametrize("limit", [0, -1, 2.5, True, "3"])
def test_a_limit_is_none_or_a_positive_int_for_every_source(tmp_path, limit):
    """load_split's and read_split's limit: 0 and -1 read one record of a local file (the reader
    appended before it compared) and none of the synthetic task's, 2.5 read three: every source now
    refuses what is not None or an int >= 1, naming it."""
    folder = tmp_path / "mt"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"src": "a{i}", "tgt": "b{i}"}}\n' for i in range(5)))
    for source in (D.resolve_source(data=str(folder)), D.resolve_source("synthetic")):
        with pytest.raises(ValueError, match=rf"limit must be None \(every record\) or an int >= 1, got {limit!r}"):
            D.load_split(source, "train", limit=limit)
    with pytest.raises(ValueError, match="limit must be None"):
        D.read_split(folder / "train.jsonl", "translation", limit=limit)
    assert [len(D.load_split(D.resolve_source(data=str(folder)), "train", limit=n)) for n in (1, 2, None)] == [1, 2, 5]


def fake_pyarrow(monkeypatch, rows):
    """A stand-in for pyarrow (not installed here): every parquet file read holds `rows`."""
    parquet = types.SimpleNamespace(read_table=lambda path: types.SimpleNamespace(to_pylist=lambda: list(rows)))
    monkeypatch.setitem(sys.modules, "pyarrow", types.SimpleNamespace(parquet=parquet))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)


def test_a_limit_reads_the_first_records_of_every_source(tmp_path, monkeypatch):
    """limit=n is the split's first n records, in every format (JSON lines plain or packed, TSV, parquet), from
    the hub and from the synthetic task; a limit past the split's size is the whole split (the synthetic
    validation split has 300 examples: limit 1000 made 1000)."""
    rows = [{"src": f"a{i}", "tgt": f"b{i}"} for i in range(5)]
    srcs = [r["src"] for r in rows]
    folder = tmp_path / "mt"
    folder.mkdir()
    paths = [write_jsonl(folder / "train.jsonl", rows), write_jsonl(folder / "train.jsonl.gz", rows),
             folder / "train.tsv", folder / "train.parquet"]
    paths[2].write_text("".join(f"{r['src']}\t{r['tgt']}\n" for r in rows), encoding="utf-8")
    paths[3].write_bytes(b"PAR1")
    fake_pyarrow(monkeypatch, rows)
    for path in paths:
        for n in (1, 2, 4, 5, 9, None):
            assert [e.src for e in D.read_split(path, "translation", limit=n)] == srcs[:n], (path.name, n)

    class FakeDatasets:
        @staticmethod
        def load_dataset(path, split, name=None):
            return [{"en": r["src"], "de": r["tgt"]} for r in rows]

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    monkeypatch.setattr(D.datasets, "local_folder", lambda name: None)
    hub = D.resolve_source("multi30k")
    for n in (1, 2, 4, 5, 9, None):
        assert [e.src for e in D.load_split(hub, "train", limit=n)] == srcs[:n], n
    synthetic = D.resolve_source()
    whole = [e.src for e in D.load_split(synthetic, "validation")]
    assert len(whole) == 300
    for n in (1, 7, 300, 1000):
        assert [e.src for e in D.load_split(synthetic, "validation", limit=n)] == whole[:n], n


def test_a_parquet_row_at_fault_is_named_by_its_number_from_1(tmp_path, monkeypatch):
    """A bad parquet record is named as "row N", N counted from 1 as the lines of the other formats are."""
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    fake_pyarrow(monkeypatch, [{"src": "a", "tgt": "b"}, {"src": "c", "tgt": " "}, {"src": "e", "tgt": "f"}])
    with pytest.raises(D.DataError, match=re.escape(f"{path}: row 2: field 'tgt' is empty")):
        D.read_split(path, "translation")


def test_the_task_is_inferred_from_the_first_split_file_that_names_fields(tmp_path):
    """Without meta.json the task comes from the first record of the first split file there is, whichever split
    (a folder of only validation or test data, for evaluation); a parquet file names no fields, so a folder of
    parquet alone needs --task (its bytes are not read as text), as does one whose first record is no object or
    that holds no record (a bare TypeError, a StopIteration)."""
    for split in ("validation", "test"):
        folder = tmp_path / split
        folder.mkdir()
        write_jsonl(folder / f"{split}.jsonl", [{"text": "good", "label": 1}])
        assert D.resolve_source(data=str(folder)).task == "classification"
    folder = tmp_path / "pq"
    folder.mkdir()
    (folder / "train.parquet").write_bytes(b"PAR1\x15\x04\xff\xfe\x00PAR1")
    with pytest.raises(D.DataError, match=r"cannot tell the task \(no meta\.json 'task' and no recognised fields\)"):
        D.resolve_source(data=str(folder))
    assert D.resolve_source(data=str(folder), task="translation").task == "translation"
    # a first record that is no JSON object (a number, null), or no record at all, names no fields either
    for name, lines in (("number", ["3"]), ("null", ["null"]), ("blank", ["", "  "])):
        (tmp_path / name).mkdir()
        write_jsonl(tmp_path / name / "train.jsonl", lines)
        with pytest.raises(D.DataError, match=r"cannot tell the task"):
            D.resolve_source(data=str(tmp_path / name))


@pytest.mark.parametrize("key", ["\u00b2", "\u0661"])
def test_class_ids_in_meta_json_are_ascii_digits(tmp_path, key):
    """meta.json's "labels" are keyed by class ids in ASCII digits: '²' is a digit to str.isdigit() but no int
    (int() raised a bare ValueError) and '١' (Arabic-Indic one) an int to int() though no id written as ours
    are; either is refused, naming the file."""
    write_jsonl(tmp_path / "train.jsonl", [{"text": "good", "label": 1}])
    (tmp_path / "meta.json").write_text(json.dumps({"labels": {"0": "bad", key: "good"}}), encoding="utf-8")
    with pytest.raises(D.DataError, match=r"meta\.json: 'labels' must map class ids to names"):
        D.resolve_source(data=str(tmp_path))


def test_a_named_dataset_is_found_under_the_data_roots_in_their_order(tmp_path, monkeypatch):
    """--dataset NAME is the folder NAME (iwslt2017: iwslt2017_en_de, the name shared/data uses) under
    $SCRATCHFORMER_DATA, else ./data, else ../shared/data, the first that has it; its class names are read
    from its meta.json as those of a --data folder are."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    env = tmp_path / "env"
    monkeypatch.setenv("SCRATCHFORMER_DATA", str(env))
    roots = [tmp_path / "shared" / "data", work / "data", env]  # least preferred first
    for root in roots:
        (root / "iwslt2017_en_de").mkdir(parents=True)
        write_jsonl(root / "iwslt2017_en_de" / "train.jsonl", [{"src": "a", "tgt": "b"}])
        source = D.resolve_source("iwslt2017")
        assert (source.kind, source.task) == ("local", "translation")
        assert Path(source.folder).resolve() == root / "iwslt2017_en_de"
    (env / "reviews").mkdir()
    write_jsonl(env / "reviews" / "train.jsonl", [{"text": "good", "label": 1}])
    (env / "reviews" / "meta.json").write_text('{"labels": {"0": "bad", "1": "good"}}', encoding="utf-8")
    named, given = D.resolve_source("reviews"), D.resolve_source(data=str(env / "reviews"))
    assert named.labels == given.labels == {0: "bad", 1: "good"}
    (env / "multi30k").write_text("not a folder", encoding="utf-8")  # a file of the name is no local copy
    assert D.resolve_source("multi30k").kind == "hub"


def test_an_unknown_task_is_named_by_every_reader(tmp_path):
    """A task that is not one of TASKS is a ValueError naming it and the tasks (read_split raised a bare KeyError
    from the field table)."""
    path = write_jsonl(tmp_path / "train.jsonl", [{"src": "a", "tgt": "b"}])
    for call in (lambda: D.read_split(path, "extractiv"),
                 lambda: D.resolve_source(data=str(tmp_path), task="extractiv")):
        with pytest.raises(ValueError, match=re.escape(f"unknown task 'extractiv'; choose one of {D.TASKS}")):
            call()


def test_the_data_entry_points_name_a_wrong_argument_type():
    with pytest.raises(TypeError, match=r"source must be a DataSource \(resolve_source\(dataset, data, task\)\), "
                                        r"got 'synthetic'"):
        D.load_split("synthetic", "train")
    with pytest.raises(TypeError, match=r"split must be a split's name \(a str: train, validation, test, \.\.\.\), "
                                        r"got None"):
        D.load_split(D.resolve_source(), None)
    with pytest.raises(TypeError, match=r"dataset must be a name \(str\) and data a folder"):
        D.resolve_source(None)
