"""Batch inference (`scratchformer.evaluation.predict`, `generate --output`) on tiny random models.

The models are randomly initialised (seeded) and saved as run folders with the real checkpoint and
tokenizer code; their outputs are gibberish but differ from input to input, so a misplaced
prediction shows.
"""

import gzip
import io
import json
import logging
import lzma
import os
import random
import re
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from conftest import held_by_another_process
from torch._dynamo.testing import CompileCounterWithBackend

from scratchformer import cli, evaluate, generate
from scratchformer.checkpoint import load_checkpoint, save_checkpoint, write_lines_atomic
from scratchformer.data import DataError, split_sentences
from scratchformer.data.tokenizer import BPETokenizer, TokenizerPair
from scratchformer.evaluation import evaluate as E
from scratchformer.evaluation import loading, resume
from scratchformer.evaluation import predict as P
from scratchformer.evaluation.evaluate import decode_batch, decode_max_len, predict_labels
from scratchformer.evaluation.loading import load_models, load_run
from scratchformer.evaluation.options import OptionError
from scratchformer.model import EOS_ID, ModelConfig, Sampling, beam_search, build_model

_FORMAT = P.format_prediction  # the real one, which `_dying_format` stands in for
WORDS = "one two three four five six seven eight nine red house big small cat dog runs".split()
MAX_SRC, MAX_TGT = 16, 10


def _texts(n: int, seed: int, max_words: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words))) for _ in range(n)]


def _dying_format(n: int, exc: type[BaseException] = KeyboardInterrupt):
    """A stand-in for P.format_prediction that raises `exc` at its (n + 1)-th call: a run killed (or
    Ctrl-C'd) after its first n predictions."""
    calls = []

    def format_prediction(pred, task):
        calls.append(pred)
        if len(calls) > n:
            raise exc
        return _FORMAT(pred, task)

    return format_prediction


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny matmuls on a shared 2-core machine: extra OpenMP threads only spin (30x slower here).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _make_run(folder: Path, task: str, seed: int = 0, eos_bias: float | None = None) -> Path:
    """An untrained model's run folder; eos_bias: the output layer's EOS bias (a model whose outputs end early)."""
    torch.manual_seed(seed)
    tok = BPETokenizer.train(_texts(200, 99), vocab_size=300, min_frequency=1)
    shape = dict(n_decoder_layers=0, num_classes=2, final_norm=True) if task == "classification" else {}
    cfg = ModelConfig(src_vocab_size=tok.vocab_size, d_model=32, n_heads=2, n_encoder_layers=1, d_ff=64,
                      dropout=0.0, kernel="eager", **{"n_decoder_layers": 1, **shape})
    model = build_model(cfg)
    if eos_bias is not None:
        with torch.no_grad():
            model.generator.bias[EOS_ID] = eos_bias
    folder.mkdir(parents=True)
    save_checkpoint(folder / "best.pt", {
        "model": model.state_dict(), "config": cfg.to_dict(), "tokenizers": TokenizerPair(tok).to_dict(),
        "task": task, "args": {"max_src_len": MAX_SRC, "max_tgt_len": MAX_TGT}, "data": {}, "progress": {"step": 0},
    })
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    runs = {task: _make_run(root / task, task) for task in ("translation", "summarization", "classification")}
    return {**runs, "ends_early": _make_run(root / "ends_early", "translation", eos_bias=4.0)}


def _write_jsonl(path: Path, rows) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _records(texts):
    return [P.InputRecord(f"s-{i}", t, i + 1) for i, t in enumerate(texts)]


# ---------------------------------------------------------------------------------------------
# Order, batching, decoding
# ---------------------------------------------------------------------------------------------


def test_order_and_ids_survive_many_batches(runs, tmp_path):
    # Shuffled lengths and a budget of ~2 inputs per batch: length sorting reorders heavily.
    texts = _texts(40, 1)
    rows = [{"id": f"test-{i}", "src": t} for i, t in enumerate(texts)]
    src = _write_jsonl(tmp_path / "in.jsonl.gz", rows)
    out = tmp_path / "preds.jsonl"
    summary = P.predict_file(runs["translation"], src, out, beam_size=1, max_tokens=24, len_ratio=0)
    preds = _read(out)
    assert [p["id"] for p in preds] == [r["id"] for r in rows] and summary["predicted"] == 40
    # Each prediction is the one its input gets alone.
    model, toks, ck = load_run(runs["translation"])
    alone = P.predict_records(model, toks, ck, _records(texts), device="cpu", beam_size=1, batch_size=1, len_ratio=0)
    assert [p["prediction"] for p in preds] == alone
    assert len(set(alone)) > 20  # the inputs are told apart, so a shuffled output would fail


@pytest.mark.parametrize("beam_size", [1, 4])
def test_batch_size_1_and_32_agree(runs, beam_size):
    model, toks, ck = load_run(runs["translation"])
    recs = _records(_texts(32, 2))
    kw = dict(device="cpu", beam_size=beam_size, len_ratio=0, max_tokens=None)
    one = P.predict_records(model, toks, ck, recs, batch_size=1, **kw)
    many = P.predict_records(model, toks, ck, recs, batch_size=32, **kw)
    assert one == many


def test_greedy_is_beam_search_with_one_beam(runs):
    # The batched greedy path against beam_search(beam_size=1) run input by input.
    model, toks, ck = load_run(runs["translation"])
    texts = _texts(12, 3)
    got = P.predict_records(model, toks, ck, _records(texts), device="cpu", beam_size=1, max_tokens=64, len_ratio=0)
    want = []
    for t in texts:
        ids = toks.src.encode(t)[: MAX_SRC - 1] + [2]
        src = torch.tensor([ids])
        out = beam_search(model, src, torch.tensor([len(ids)]), beam_size=1, max_len=MAX_TGT)
        want.append(toks.tgt.decode(out[0].tolist()))
    assert got == want


def test_decode_max_len_ratio():
    Ls = torch.tensor([3, 5])
    assert decode_max_len("translation", Ls, 100).tolist() == [16, 20]  # the default ratio 2: 2 * Ls + 10, per row
    assert decode_max_len("translation", Ls, 18).tolist() == [16, 18]  # never past max_tgt_len
    assert decode_max_len("translation", Ls, 100, len_ratio=1.5).tolist() == [15, 18]  # ceil(4.5), ceil(7.5) + 10
    assert decode_max_len("translation", Ls, 100, len_ratio=0) == 100  # no ratio
    assert decode_max_len("summarization", Ls, 100) == 100
    assert decode_max_len("summarization", Ls, 100, len_ratio=1.0).tolist() == [13, 15]
    # --min-len M: no cap below M (an output of a short source stopped at its cap, short of M, unsaid)
    assert decode_max_len("translation", Ls, 100, min_len=18).tolist() == [18, 20]
    assert decode_max_len("translation", Ls, 17, min_len=50).tolist() == [17, 17]  # max_tgt_len still bounds


@pytest.mark.parametrize("beam_size", [1, 3])
def test_min_len_holds_where_the_length_ratio_caps_an_output_shorter(runs, beam_size):
    """--min-len 30 on a two-token source, whose translation cap is 2 * 2 + 10 = 14, and a model that
    ends every output at once (EOS favoured): the output holds 30 tokens (it stopped at the cap, 14)."""
    model, toks, ck = load_run(runs["ends_early"])
    src = torch.tensor([toks.src.encode("red")[:1] + [EOS_ID]])
    out = decode_batch(model, src, torch.tensor([2]), "translation", max_tgt_len=40, beam_size=beam_size,
                       min_len=30)
    body = out[0].tolist()
    assert len(body) >= 30 and EOS_ID not in body[:30], body


@pytest.mark.parametrize("beam_size", [1, 4])
def test_the_length_cap_is_each_inputs_own(tmp_path, beam_size):
    """Under the translation default (up to 2 * Ls + 10 tokens), a model that never ends an output by
    itself runs each output to its cap: an input's prediction is the one it gets alone, whatever the
    source lengths of its batch (the cap once came from the batch's longest source)."""
    model, toks, ck = load_run(_make_run(tmp_path / "never_ends", "translation", eos_bias=-20.0))
    texts = ["one", " ".join(WORDS[:12]), "red cat", " ".join(WORDS[3:14])]
    kw = dict(device="cpu", beam_size=beam_size, max_len=48, max_src_len=MAX_SRC)
    together = P.predict_records(model, toks, ck, _records(texts), batch_size=len(texts), **kw)
    alone = [P.predict_records(model, toks, ck, _records([t]), batch_size=1, **kw)[0] for t in texts]
    assert together == alone
    lengths = [len(toks.tgt.encode(p)) for p in alone]
    assert lengths[0] < lengths[1] and lengths[2] < lengths[3], lengths  # the caps differ from row to row


def test_classification_labels_are_ints(runs, tmp_path):
    texts = _texts(30, 4)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    out = tmp_path / "preds.jsonl"
    P.predict_file(runs["classification"], src, out, max_tokens=32)
    preds = _read(out)
    assert [p["id"] for p in preds] == list(range(30))
    assert all(type(p["prediction"]) is int and p["prediction"] in (0, 1) for p in preds)
    model, toks, ck = load_run(runs["classification"])
    assert [p["prediction"] for p in preds] == P.predict_records(model, toks, ck, _records(texts), device="cpu",
                                                                 batch_size=1)


def test_a_label_is_the_class_the_model_finds_most_probable(runs):
    """Each input's label is the argmax of the classifier's own logits for it alone."""
    model, toks, ck = load_run(runs["classification"])
    texts = _texts(12, 8)
    got = P.predict_records(model, toks, ck, _records(texts), device="cpu", max_tokens=32)
    dataset = P.encode_records(_records(texts), "classification", toks, MAX_SRC)
    with torch.no_grad():
        probs = [torch.softmax(model(torch.as_tensor(s, dtype=torch.int64)[None], torch.tensor([len(s)]))[0], -1)
                 for s in dataset.src]
    assert got == [int(p.argmax()) for p in probs]
    labels, confidences = predict_labels(model, dataset, device="cpu", max_tokens=32)
    assert labels == got and confidences == pytest.approx([float(p.max()) for p in probs], abs=1e-5)


def test_summaries_one_sentence_per_line(runs, tmp_path):
    assert P.format_prediction("Amy is late. She will call Tom! ok", "summarization") == \
        "Amy is late.\nShe will call Tom!\nok"
    assert P.format_prediction("Ein Hund. Eine Katze.", "translation") == "Ein Hund. Eine Katze."
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "document": "Amy: hi\nTom: hello"}, {"document": "x y"}])
    out = tmp_path / "preds.jsonl"
    P.predict_file(runs["summarization"], src, out, beam_size=2)
    preds = _read(out)
    assert [p["id"] for p in preds] == ["a", 2]  # a record without an id gets its line number
    assert all(isinstance(p["prediction"], str) and "\n\n" not in p["prediction"] for p in preds)


@pytest.mark.parametrize("task", ["translation", "classification"])
def test_compile_compiles_the_loaded_model_and_predicts_the_same(runs, task):
    """load_run(compile=backend), what evaluate's and generate's --compile call: the model is
    compiled by that backend (an encoder-decoder's encode and decode, decoding then on static
    caches; a classifier's forward, the compiled wrapper), predicts what the uncompiled model
    predicts, and its record (the weights' digest, for --resume) is the uncompiled model's."""
    texts = _texts(3, 5)
    model, toks, ck = load_run(runs[task])
    want = P.predict_records(model, toks, ck, _records(texts), device="cpu", beam_size=1, len_ratio=0)
    torch._dynamo.reset()
    backend = CompileCounterWithBackend("eager")
    compiled, _, _ = load_run(runs[task], compile=backend)
    got = P.predict_records(compiled, toks, ck, _records(texts), device="cpu", beam_size=1, len_ratio=0)
    assert got == want and backend.frame_count >= 1
    if task == "classification":
        assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    else:
        assert compiled.static_caches
    assert P.run_record(compiled, ck, "src", {}) == P.run_record(model, ck, "src", {})
    if task == "classification":  # an ensemble of compiled members: the uncompiled ensemble's record
        ensemble = load_models([runs[task], runs[task]], compile=backend)[0]
        assert any("_orig_mod." in k for k in ensemble.state_dict())
        assert P.run_record(ensemble, ck, "src", {}) == P.run_record(load_models([runs[task]] * 2)[0], ck, "src", {})


class _Compiled(Exception):
    """Raised by a stand-in compile: the backend it was given."""


def test_compile_flags_of_evaluate_and_generate_reach_the_model(runs, tmp_path, monkeypatch):
    """`--compile BACKEND` (inductor when given alone) compiles the loaded model with that backend
    in evaluate, generate and generate --output. The compile is stood in for, and ends the command
    there (`test_compile_compiles_the_loaded_model_and_predicts_the_same` runs a real one)."""

    def compile_for_inference(model, backend):
        raise _Compiled(backend)

    monkeypatch.setattr(loading, "compile_for_inference", compile_for_inference)
    run, src = str(runs["translation"]), tmp_path / "in.txt"
    src.write_text("red house\n")
    commands = [(evaluate, ["--split", "validation"]), (generate, ["--text", "red house"]),
                (generate, ["--input", str(src), "--output", str(tmp_path / "out.jsonl")])]
    for command, flags in commands:
        for given, backend in ((["--compile", "aot_eager"], "aot_eager"), (["--compile"], "inductor")):
            with pytest.raises(_Compiled, match=f"^{backend}$"):
                command.main(["--checkpoint", run, *flags, *given])


# ---------------------------------------------------------------------------------------------
# Inputs: formats and errors
# ---------------------------------------------------------------------------------------------


def test_plain_text_and_stdin(runs, tmp_path, monkeypatch):
    txt = tmp_path / "in.txt"
    txt.write_text("one two\n\nred house big\n", encoding="utf-8")
    recs = P.read_inputs(txt, "translation")
    assert [(r.id, r.text) for r in recs] == [(1, "one two"), (3, "red house big")]  # blank lines skipped

    out = tmp_path / "from_file.jsonl"
    P.predict_file(runs["translation"], txt, out, beam_size=1)
    monkeypatch.setattr("sys.stdin", io.StringIO("one two\n\nred house big\n"))
    out2 = tmp_path / "from_stdin.jsonl"
    P.predict_file(runs["translation"], "-", out2, beam_size=1)
    assert _read(out) == _read(out2) and [p["id"] for p in _read(out2)] == [1, 3]

    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": "x", "src": "one two"}\n'))  # JSON lines are sniffed
    assert [(r.id, r.text) for r in P.read_inputs("-", "translation")] == [("x", "one two")]
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": "x", "src": "one two"}\n'))
    assert [r.text for r in P.read_inputs("-", "translation", fmt="text")] == ['{"id": "x", "src": "one two"}']
    # text that begins with "{" is sniffed as JSON lines: the error says so, and how to read it as text
    monkeypatch.setattr("sys.stdin", io.StringIO("{three} one two\nfour five\n"))
    with pytest.raises(DataError, match=r"^<stdin>:1: bad JSON .*; read as JSON lines because it begins with '\{': "
                                        r"--format text reads <stdin> as one input a line$"):
        P.read_inputs("-", "translation")
    monkeypatch.setattr("sys.stdin", io.StringIO('{"id": "x", "src": "one two"}\n{"id": "y"}\n'))
    with pytest.raises(DataError, match=r"^<stdin>:2: missing field 'src' \(fields present: 'id'\); choose one "
                                        r"with --field$"):  # past the first line: the error alone
        P.read_inputs("-", "translation")


def test_a_json_named_input_is_read_as_json_lines(tmp_path):
    """.json (and .jsonl, compressed or not) names JSON lines: records by their field and id, not text lines."""
    src = _write_jsonl(tmp_path / "in.json", [{"id": "a", "src": "one two"}, {"src": "red house"}])
    assert [(r.id, r.text) for r in P.read_inputs(src, "translation")] == [("a", "one two"), (2, "red house")]


def test_field_override(tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "en": "one"}])
    assert P.read_inputs(src, "translation", field="en")[0].text == "one"


def test_a_field_of_a_file_read_as_text_is_refused(tmp_path, monkeypatch):
    """--field names a field of JSON records: given for a file read as text (by its name, by
    --format text, or stdin whose first line is not a record) each JSON line was predicted whole,
    braces and all. Refused, saying why the file is text; the same file read as JSON lines is fine."""
    txt = tmp_path / "in.txt"
    txt.write_text('{"id": "a", "en": "one two"}\n')
    with pytest.raises(OptionError, match=r"--field en names a field of JSON records, and .*in.txt is read as text, "
                                          r"one input a line \(its name does not end in .jsonl\): give --format jsonl"):
        P.read_inputs(txt, "translation", field="en")
    with pytest.raises(OptionError, match=r"\(--format text\)"):
        P.read_inputs(txt, "translation", field="en", fmt="text")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"one two\n")))
    with pytest.raises(OptionError, match=r"<stdin> is read as text.*\(its first line does not begin with '\{'\)"):
        P.read_inputs("-", "translation", field="en")
    assert [(r.id, r.text) for r in P.read_inputs(txt, "translation", field="en", fmt="jsonl")] == [("a", "one two")]
    assert [r.text for r in P.read_inputs(txt, "translation")] == ['{"id": "a", "en": "one two"}']  # no --field


@pytest.mark.parametrize("content, message", [
    ('{"id": "a", "src": "one"}\n{"id": "b", "src": "two"\n', r"in\.jsonl:2: bad JSON"),
    ('{"id": "a", "src": "one"}\n\n{"id": "c", "text": "x"}\n',
     r"in\.jsonl:3: missing field 'src' \(fields present: 'id', 'text'\)"),
    ('{"id": "a", "src": "one"}\n{"id": "a", "src": "two"}\n', r"in\.jsonl:2: duplicate id 'a' \(first on line 1\)"),
    ('{"id": "a", "src": 7}\n', r"in\.jsonl:1: field 'src' must be a string"),
    ('{"id": "a", "src": "  "}\n', r"in\.jsonl:1: field 'src' is empty"),
    ('{"id": "a", "src": "ok"}\n{"id": "b", "src": "cut \\ud83d"}\n', r"in\.jsonl:2: field 'src' holds an unpaired "
     r"surrogate \(\\ud83d at character 5"),
    ('["one"]\n', r"in\.jsonl:1: expected a JSON object"),
    ("", r"in\.jsonl: no inputs \(the file is empty\)"),
    ("\n\n", r"in\.jsonl: no inputs \(the file holds only blank lines\)"),
    ('{"id": 1, "src": "one"}\n{"id": "1", "src": "two"}\n',  # two "1" ids to whoever reads the output
     r"in\.jsonl:2: duplicate id '1' \(first on line 1, as 1: ids are compared as text\)"),
    # an id a record has for want of one is its line number, as the message says (it said "duplicate id 3" alone)
    ('{"id": 3, "src": "one"}\n{"id": "x", "src": "two"}\n{"src": "three"}\n',
     r"in\.jsonl:3: duplicate id 3, line 3's number: its record has no \"id\" \(first on line 1\)$"),
    ('{"src": "one"}\n{"id": "1", "src": "two"}\n',
     r"in\.jsonl:2: duplicate id '1' \(first on line 1, line 1's number: its record has no \"id\", as 1: ids are "
     r"compared as text\)$"),
])
def test_bad_input_names_the_line(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DataError, match=message):
        P.read_inputs(path, "translation")


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        P.read_inputs(tmp_path / "nope.jsonl", "translation")
    bad = tmp_path / "in.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"in\.jsonl\.gz: not a gzip file, though named \.gz"):
        P.read_inputs(bad, "translation")


def test_a_failure_before_writing_leaves_no_folder_it_made(runs, tmp_path):
    """--output in folders that do not exist yet: made for its lock, and removed again when the input
    fails before any line is written (they were left behind, empty); a folder that was there stays."""
    (tmp_path / "kept").mkdir()
    missing = tmp_path / "kept" / "new" / "deeper" / "p.jsonl"
    with pytest.raises(DataError, match="no such file"):
        P.predict_file(runs["translation"], tmp_path / "nope.jsonl", missing)
    assert not (tmp_path / "kept" / "new").exists() and (tmp_path / "kept").is_dir()
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    P.predict_file(runs["translation"], src, missing)  # a run that writes keeps its folders
    assert [p["id"] for p in _read(missing)] == ["a"]


def test_stdin_that_is_not_utf8_names_the_line(monkeypatch):
    stdin = io.TextIOWrapper(io.BytesIO(b"one two\nr\xe9d house\n"), encoding="utf-8")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(DataError, match=r"<stdin>:2: not UTF-8 text \(byte 0xe9"):
        P.read_inputs("-", "translation")


def test_too_long_inputs_truncated_with_warning_or_refused(runs, tmp_path, caplog):
    long_text = " ".join(["seven eight nine"] * 10)  # far over MAX_SRC tokens
    rows = [{"id": "a", "src": "one two"}, {"id": "b", "src": long_text}, {"id": "c", "src": long_text}]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        P.predict_file(runs["translation"], src, tmp_path / "preds.jsonl", beam_size=1)
    assert "2 of 3 inputs are longer than the model's maximum of 15 tokens" in caplog.text
    assert "(lines 2, 3)" in caplog.text
    assert len(_read(tmp_path / "preds.jsonl")) == 3
    model, toks, ck = load_run(runs["translation"])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=P.__name__):  # more than 5: the first 5 lines, and a mark of more
        P.encode_records(_records(["one", *[long_text] * 7]), "translation", toks, MAX_SRC)
    assert "7 of 8 inputs are longer" in caplog.text and "(lines 2, 3, 4, 5, 6, ...)" in caplog.text
    with pytest.raises(DataError, match=r"in\.jsonl:2: input has \d+ tokens, more than the model's maximum of 15"):
        P.predict_file(runs["translation"], src, tmp_path / "strict.jsonl", strict=True)
    # a limit of --max-src-len is named as that flag's ("the model's maximum 2" for --max-src-len 3)
    with pytest.raises(DataError, match=r"in\.jsonl:1: input has \d+ tokens, more than the 1 tokens that "
                                        r"--max-src-len 2 admits, its EOS aside \(--strict; 3 input\(s\)"):
        P.predict_file(runs["translation"], src, tmp_path / "strict.jsonl", strict=True, max_src_len=2)
    caplog.clear()  # and its warning reads ("... its EOS aside tokens and were truncated")
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        P.predict_records(model, toks, ck, _records(["one two three"]), device="cpu", beam_size=1, max_src_len=2)
    assert "1 of 1 inputs are longer than the 1 tokens that --max-src-len 2 admits, its EOS aside, and were " \
           "truncated (lines 1)" in caplog.text
    assert not (tmp_path / "strict.jsonl").exists()
    # An input of exactly the maximum is neither warned about nor refused.
    model, toks, ck = load_run(runs["translation"])
    words = []
    while len(toks.src.encode(" ".join(words + ["cat"]))) <= MAX_SRC - 1:
        words.append("cat")
    P.encode_records(_records([" ".join(words)]), "translation", toks, MAX_SRC, strict=True)


def test_strict_names_the_first_document_that_does_not_fit_not_one_that_fits_exactly(runs):
    """An extractive document takes a marker per sentence besides its tokens. One of exactly max_src_len
    marked tokens fits (the encoder keeps all of it: --strict takes it), so --strict, refusing a longer
    one after it, names that one's line, not the first's."""

    _, toks, _ = load_run(runs["translation"])
    fits = "the cat sat . a dog ran ."
    n = sum(len(ids) + 1 for ids in toks.src.encode_batch(split_sentences(fits)))
    P.encode_records(_records([fits]), "extractive", toks, n, strict=True)
    with pytest.raises(DataError, match=r"^input:2: document does not fit in the model's \d+ tokens \(--strict; 1 "):
        P.encode_records(_records([fits, fits + " birds sang ."]), "extractive", toks, n, strict=True)


# ---------------------------------------------------------------------------------------------
# Output: atomic writes, resume
# ---------------------------------------------------------------------------------------------


def test_existing_output_needs_resume_or_overwrite(runs, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    out = tmp_path / "preds.jsonl"
    out.write_text("old\n")
    with pytest.raises(FileExistsError, match="--resume"):
        P.predict_file(runs["translation"], src, out)
    assert out.read_text() == "old\n"
    P.predict_file(runs["translation"], src, out, overwrite=True, beam_size=1)
    assert [p["id"] for p in _read(out)] == ["a"]


def test_an_output_another_process_writes_is_refused_until_it_ends(runs, tmp_path):
    """Two `generate --output F` started in one instant both ran (each found no F and no F.partial):
    one's predictions were lost, or mixed into the other's. While a process writes F it holds
    .F.lock (an flock): another, --overwrite and --resume included, is refused naming its pid,
    nothing written; once it ends (a kill too: the system drops the lock) the next goes on, and a
    finished run leaves no lock file."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one two"}, {"id": "b", "src": "red"}])
    out = tmp_path / "preds.jsonl"
    P.predict_file(runs["translation"], src, out, beam_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "preds.jsonl", "preds.jsonl.meta.json"]
    holder = held_by_another_process(resume.lock_path(out))
    try:
        before = _snapshot_of(tmp_path)
        for flags in ({}, {"overwrite": True}, {"resume": True}):
            with pytest.raises(OptionError, match=rf"--output {re.escape(str(out))} is being written by another "
                                                  rf"process \(pid {holder.pid}\); wait for it to end"):
                P.predict_file(runs["translation"], src, out, beam_size=1, **flags)
            assert _snapshot_of(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
    P.predict_file(runs["translation"], src, out, beam_size=2, overwrite=True)
    assert [p["id"] for p in _read(out)] == ["a", "b"] and not resume.lock_path(out).exists()


@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
def test_output_onto_its_own_input_is_refused(runs, tmp_path, monkeypatch, flag):
    """generate --input F --output F (or F's own .partial, by another path): refused, F untouched;
    until 2026-12-01 --overwrite (which the refusal without it suggested) replaced the inputs with
    their predictions."""
    src = tmp_path / "in.txt"
    src.write_text("one two\nred house\n")
    monkeypatch.chdir(tmp_path)
    for output in ("in.txt", f"{tmp_path}/./in.txt"):
        with pytest.raises(OptionError, match=r"over its own --input .*in.txt: the inputs would be lost"):
            generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", output,
                           "--beam-size", "1", *flag])
    part = tmp_path / "in.jsonl.partial"
    part.write_text('{"src": "one"}\n')
    with pytest.raises(OptionError, match=r"in.jsonl.partial over its own --input"):
        P.predict_file(runs["translation"], part, tmp_path / "in.jsonl", overwrite=True, beam_size=1)
    for written in (resume.record_path(tmp_path / "in.jsonl"), resume.lock_path(tmp_path / "in.jsonl")):  # beside it
        written.write_text('{"src": "one"}\n')
        with pytest.raises(OptionError, match=rf"{re.escape(written.name)} over its own --input"):
            P.predict_file(runs["translation"], written, tmp_path / "in.jsonl", overwrite=True, beam_size=1)
        assert written.read_text() == '{"src": "one"}\n'
    assert src.read_text() == "one two\nred house\n" and part.read_text() == '{"src": "one"}\n'


@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
def test_output_onto_a_checkpoint_is_refused(runs, tmp_path, flag):
    """generate --checkpoint R --output R/best.pt --overwrite replaced the model with its predictions
    (a typo): an output, snapshot, record or lock that would be written over a checkpoint (by its
    first bytes, whatever its name) is refused, the checkpoint untouched."""
    src = tmp_path / "in.txt"
    src.write_text("one two\n")
    model = runs["translation"] / "best.pt"
    before = model.read_bytes()
    (tmp_path / "other.pt").write_bytes(before)
    for output, written in ((model, model), (tmp_path / "p.jsonl", tmp_path / "p.jsonl.partial")):
        if written != model:
            written.write_bytes(before)  # a checkpoint under a snapshot's name
        with pytest.raises(OptionError, match=rf"--output {re.escape(str(output))} would write "
                                              rf"{re.escape(str(written))} over a checkpoint: the model would be lost"):
            generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", str(output),
                           "--beam-size", "1", *flag])
        assert written.read_bytes() == before
    generate.main(["--checkpoint", str(tmp_path / "other.pt"), "--input", str(src), "--output",
                   str(tmp_path / "fine.jsonl"), "--beam-size", "1"])
    assert [p["id"] for p in _read(tmp_path / "fine.jsonl")] == [1]


def test_output_naming_a_folder_is_refused_before_any_work(runs, tmp_path, monkeypatch):
    """--output DIR --overwrite predicted every input, then failed to rename the file over the folder
    (its snapshots in DIR.partial, which no --resume of a file name finds)."""
    src = tmp_path / "in.txt"
    src.write_text("one two\n")
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(P, "predict_records", lambda *a, **k: pytest.fail("predicted before the refusal"))
    with pytest.raises(OptionError, match=r"--output .*out is a folder: name the predictions file"):
        P.predict_file(runs["translation"], src, tmp_path / "out", overwrite=True, beam_size=1)


def test_atomic_write_leaves_the_old_file_on_a_crash(tmp_path, monkeypatch):
    out = tmp_path / "preds.jsonl"
    out.write_text('{"id": "a", "prediction": "old"}\n')

    def lines():
        yield '{"id": "a", "prediction": "new"}'
        raise KeyboardInterrupt  # killed mid-write

    with pytest.raises(KeyboardInterrupt):
        write_lines_atomic(out, lines())
    assert out.read_text() == '{"id": "a", "prediction": "old"}\n'
    assert os.listdir(tmp_path) == ["preds.jsonl"]  # no temp file left behind
    write_lines_atomic(out, ['{"id": "a", "prediction": "new"}'])
    (tmp_path / "plain").write_text("")
    assert out.stat().st_mode == (tmp_path / "plain").stat().st_mode  # the umask's mode (mkstemp's is 0600)
    os.remove(tmp_path / "plain")

    def no_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with pytest.raises(OSError):
        write_lines_atomic(tmp_path / "fresh.jsonl", ['{"id": "b", "prediction": "x"}'])
    assert os.listdir(tmp_path) == ["preds.jsonl"]


def test_killed_run_resumes_from_its_snapshot(runs, tmp_path, monkeypatch):
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(20, 5))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    clean = tmp_path / "clean.jsonl"
    P.predict_file(runs["translation"], src, clean, beam_size=1, max_tokens=24, len_ratio=0)

    out = tmp_path / "preds.jsonl"

    class Killed(BaseException):
        """A hard kill (SIGKILL): nothing runs after it, unlike KeyboardInterrupt."""

    kw = dict(beam_size=1, max_tokens=24, len_ratio=0)  # batches hold ~2 inputs: a few are done, then the kill
    monkeypatch.setattr(P, "format_prediction", _dying_format(8, Killed))
    with pytest.raises(Killed):
        P.predict_file(runs["translation"], src, out, save_every=0, **kw)  # a snapshot after every batch
    assert not out.exists()  # no half output
    snapshot = _read(resume.partial_path(out))
    assert 0 < len(snapshot) <= 8

    # Ctrl-C saves what is done even between snapshots; --resume goes on from there.
    monkeypatch.setattr(P, "format_prediction", _dying_format(4))
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(runs["translation"], src, out, save_every=1e9, resume=True, **kw)
    assert not out.exists()
    snapshot2 = _read(resume.partial_path(out))
    assert all(line in snapshot2 for line in snapshot) and len(snapshot) < len(snapshot2) < 20

    monkeypatch.setattr(P, "format_prediction", _FORMAT)
    summary = P.predict_file(runs["translation"], src, out, resume=True, **kw)
    assert summary["kept"] == len(snapshot2) and summary["predicted"] == 20 - len(snapshot2)
    assert _read(out) == _read(clean) and not resume.partial_path(out).exists()


def test_resume_keeps_the_lines_already_written(runs, tmp_path):
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(6, 6))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "preds.jsonl"
    kept = ['{"id": "r4", "prediction": "KEEP ME"}', '{"id": "r1", "prediction": "me too"}']
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")  # no record beside it: kept, with a warning
    summary = P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)
    assert summary["predicted"] == 4 and summary["kept"] == 2
    lines = out.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["r0", "r1", "r2", "r3", "r4", "r5"]
    assert lines[1] == kept[1] and lines[4] == kept[0]  # verbatim
    # Nothing left to do: the output is rewritten unchanged.
    again = P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)
    assert again["predicted"] == 0 and out.read_text(encoding="utf-8").splitlines() == lines

    out.write_text('{"id": "r0", "prediction": "x"}\n{"id": "r1", "predic', encoding="utf-8")
    with pytest.raises(DataError, match=r"preds\.jsonl:2: bad JSON in the existing output \(Unterminated string "
                                        r"starting at column 14\)"):  # the column was cut off
        P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)


def test_resume_refuses_lines_it_would_mix_in(runs, tmp_path):
    """--resume kept another model's predictions, or another decoding's, beside the new ones, the lines
    of ids not in the input (after them), and the last of an id twice; none of it said."""
    rows = [{"id": "a", "src": "one two", "tgt": "two"}, {"id": "b", "src": "red house big", "tgt": "big"}]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "preds.jsonl"
    P.predict_file(runs["translation"], _write_jsonl(tmp_path / "first.jsonl", rows[:1]), out, beam_size=1)
    record = json.loads(resume.record_path(out).read_text())
    assert record["options"]["--beam-size"] == 1 and record["output"] is True
    before = _snapshot_of(tmp_path)
    translation, other = runs["translation"] / "best.pt", runs["ends_early"] / "best.pt"
    with pytest.raises(OptionError, match=rf"--resume: {out} holds predictions of {translation}, whose weights are "
                       rf"not those of {other}: the output would mix two models' predictions"):
        P.predict_file(runs["ends_early"], src, out, beam_size=1, resume=True)
    for kw, said in ((dict(beam_size=2), r"--beam-size 1 \(now 2\)"), (dict(len_ratio=0), r"--len-ratio 2.0 \(now 0\)"),
                     (dict(max_len=5), rf"--max-len {MAX_TGT} \(now 5\)"),
                     (dict(field="tgt"), r"--field src \(now tgt\)")):
        with pytest.raises(OptionError, match=rf"--resume: {out} was written with {said}.*: the output would mix two "
                           r"decodings; give the options it was written with"):
            P.predict_file(runs["translation"], src, out, resume=True, **{"beam_size": 1, **kw})
    assert _snapshot_of(tmp_path) == before
    # the same weights in another file, and a default given explicitly: the same model and options
    averaged_from = [{"path": str(translation), "step": 0}]  # the average of one: another file, the same weights
    save_checkpoint(tmp_path / "copy.pt", {**load_checkpoint(translation), "averaged_from": averaged_from})
    summary = P.predict_file(tmp_path / "copy.pt", src, out, beam_size=1, len_ratio=2.0, max_len=MAX_TGT, resume=True)
    assert summary["kept"] == 1 and summary["predicted"] == 1
    for lines, said in (('{"id": "a", "prediction": "x"}\n{"id": "zzz", "prediction": "y"}\n',
                         r"hand\.jsonl:2: id 'zzz' is not one of the input's: the output was written for other inputs"),
                        ('{"id": "a", "prediction": "x"}\n{"id": "a", "prediction": "y"}\n',
                         r"hand\.jsonl:2: id 'a' twice in the existing output"),
                        ('{"id": "a", "prediction": "x"}\n{"id": "b"}\n',
                         r'hand\.jsonl:2: not an \{"id", "prediction"\} line')):
        (tmp_path / "hand.jsonl").write_text(lines)
        with pytest.raises(DataError, match=said):
            P.predict_file(runs["translation"], src, tmp_path / "hand.jsonl", beam_size=1, resume=True)
        assert (tmp_path / "hand.jsonl").read_text() == lines


def test_resume_after_a_cut_overwrite_keeps_none_of_the_output_it_replaces(runs, tmp_path, monkeypatch):
    """--overwrite with another model, killed: its snapshot is resumed, the old output's lines are not."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(6, 3))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out, clean = tmp_path / "preds.jsonl", tmp_path / "clean.jsonl"
    kw = dict(beam_size=1, batch_size=1)
    P.predict_file(runs["translation"], src, out, **kw)
    P.predict_file(runs["ends_early"], src, clean, **kw)
    monkeypatch.setattr(P, "format_prediction", _dying_format(2))
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(runs["ends_early"], src, out, overwrite=True, **kw)
    monkeypatch.setattr(P, "format_prediction", _FORMAT)
    summary = P.predict_file(runs["ends_early"], src, out, resume=True, **kw)
    assert summary["kept"] == 2 and _read(out) == _read(clean)


def test_an_overwrite_cut_before_its_first_prediction_leaves_no_snapshot_of_the_run_it_replaces(
        runs, tmp_path, monkeypatch):
    """--overwrite removes the snapshot of the run it replaces when it starts: cut before it snapshots
    anything, a --resume then predicts every input anew, as a clean run does."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(6, 9))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out, clean = tmp_path / "preds.jsonl", tmp_path / "clean.jsonl"
    kw = dict(beam_size=1, batch_size=1)
    P.predict_file(runs["ends_early"], src, clean, **kw)
    monkeypatch.setattr(P, "format_prediction", _dying_format(3))  # another model's run, cut: its snapshot
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(runs["translation"], src, out, **kw)
    assert len(_read(resume.partial_path(out))) == 3
    monkeypatch.setattr(P, "format_prediction", _dying_format(0))  # the overwrite, cut at its first prediction
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(runs["ends_early"], src, out, overwrite=True, **kw)
    assert not resume.partial_path(out).exists() and not out.exists()
    monkeypatch.setattr(P, "format_prediction", _FORMAT)
    summary = P.predict_file(runs["ends_early"], src, out, resume=True, **kw)
    assert summary["kept"] == 0 and summary["predicted"] == 6 and _read(out) == _read(clean)


def _snapshot_of(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_resume_refuses_a_prediction_whose_input_changed(runs, tmp_path, capsys):
    """--resume kept a line by its id alone: a line put above the others (their ids are line numbers)
    left id 1 with the prediction of the input that was there before, "3 inputs, 1 predicted, 2 kept".
    The record beside the output names each line's input (16 hex digits of its SHA-256)."""
    src, out = tmp_path / "in.txt", tmp_path / "t.jsonl"
    argv = ["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", str(out), "--beam-size", "1",
            "--no-progress"]
    src.write_text("red dog\nblue cat\n")
    assert generate.main(argv)["predicted"] == 2
    inputs = json.loads(resume.record_path(out).read_text())["inputs"]
    assert set(inputs) == {"1", "2"} and all(re.fullmatch("[0-9a-f]{16}", d) for d in inputs.values())
    src.write_text("the man rides a bike\nred dog\nblue cat\n")
    before = _snapshot_of(tmp_path)
    assert generate.run([*argv, "--resume"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: --resume: {out} holds a prediction for id 1 made from another input than the input's line 1 now "
        "holds (2 of its 2 predictions' inputs changed): the output would pair inputs with predictions of others; "
        "restore the input it was written for, or --overwrite (or write a new --output)")
    assert _snapshot_of(tmp_path) == before  # nothing written
    src.write_text("red dog\nblue cat\nthe man rides a bike\n")  # the same inputs on their lines, and one more
    assert generate.main([*argv, "--resume"])["kept"] == 2
    assert generate.main([*argv, "--overwrite"])["predicted"] == 3

    # JSON records: a changed input under the same id; a field the model does not read changes nothing
    rows = [{"id": "a", "src": "one two", "tgt": "x"}, {"id": "b", "src": "red house", "tgt": "y"}]
    src, out = _write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "p.jsonl"
    P.predict_file(runs["translation"], src, out, beam_size=1)
    _write_jsonl(src, [rows[0], {**rows[1], "tgt": "z"}, {"id": "c", "src": "six"}])
    assert P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)["kept"] == 2
    _write_jsonl(src, [rows[0], {**rows[1], "src": "red house big"}, {"id": "c", "src": "six"}])
    with pytest.raises(OptionError, match=rf"--resume: {out} holds a prediction for id 'b' made from another input "
                       r"than the input's line 2 now holds \(1 of its 3 predictions' inputs changed\)"):
        P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)


def test_an_input_changed_only_in_its_trailing_spaces_is_another_input(runs, tmp_path):
    """The record's digest is of the input's exact text: spaces at its end are tokens the model reads."""
    src, out = tmp_path / "in.jsonl", tmp_path / "p.jsonl"
    _write_jsonl(src, [{"id": "a", "src": "red dog"}])
    P.predict_file(runs["translation"], src, out, beam_size=1)
    _write_jsonl(src, [{"id": "a", "src": "red dog   "}])
    with pytest.raises(OptionError, match=rf"--resume: {out} holds a prediction for id 'a' made from another input"):
        P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)


@pytest.mark.parametrize("resumed, save_every", [(False, 0), (True, 1e9)])
def test_a_kill_at_any_write_leaves_what_resume_finishes(runs, tmp_path, monkeypatch, resumed, save_every):
    """The record names the inputs of the lines before they are written (each snapshot's, and the
    output's before its rename): a kill at any write, of a fresh run snapshotting every batch or of a
    --resume keeping an output's lines (and no snapshot), leaves nothing that --resume refuses or
    finishes wrong."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(6, 7))]
    src, clean, first = (_write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "clean.jsonl",
                         tmp_path / "first.jsonl")
    kw = dict(beam_size=1, batch_size=2)
    P.predict_file(runs["translation"], src, clean, **kw)
    P.predict_file(runs["translation"], _write_jsonl(tmp_path / "two.jsonl", rows[:2]), first, **kw)
    real, n = resume.write_lines_atomic, 0

    class Killed(BaseException):
        """A hard kill (SIGKILL): nothing runs after it."""

    while True:
        n, out, writes = n + 1, tmp_path / f"preds{n + 1}.jsonl", []
        if resumed:  # an output holding r0 and r1, and its record
            out.write_bytes(first.read_bytes())
            resume.record_path(out).write_bytes(resume.record_path(first).read_bytes())

        def dies(path, lines, n=n, writes=writes, out=out):
            writes.append(path.name.removeprefix(out.name))
            if len(writes) == n:
                raise Killed
            real(path, lines)

        monkeypatch.setattr(resume, "write_lines_atomic", dies)
        try:
            P.predict_file(runs["translation"], src, out, resume=resumed, save_every=save_every, **kw)
            break  # no write left to kill
        except Killed:
            pass
        finally:
            monkeypatch.undo()
        P.predict_file(runs["translation"], src, out, resume=True, **kw)
        assert _read(out) == _read(clean), writes
    snapshots = 0 if save_every else 3  # the record at the start, (record, snapshot) a batch, record, output, record
    assert writes == [".meta.json", *[".meta.json", ".partial"] * snapshots, ".meta.json", "", ".meta.json"]


def test_a_snapshots_changed_input_is_refused(runs, tmp_path, monkeypatch):
    """A killed run's snapshot is resumed only for the inputs it was made from."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(6, 7))]
    src, kw = _write_jsonl(tmp_path / "in.jsonl", rows), dict(beam_size=1, batch_size=2)
    out = tmp_path / "cut.jsonl"
    monkeypatch.setattr(P, "format_prediction", _dying_format(4))  # Ctrl-C after two batches: 4 predictions saved
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(runs["translation"], src, out, save_every=1e9, **kw)
    monkeypatch.undo()
    _write_jsonl(src, [*rows[:3], {**rows[3], "src": "nine nine"}, *rows[4:]])
    with pytest.raises(OptionError, match=rf"--resume: {resume.partial_path(out)} holds a prediction for id 'r3'"):
        P.predict_file(runs["translation"], src, out, resume=True, **kw)
    _write_jsonl(src, rows)
    assert P.predict_file(runs["translation"], src, out, resume=True, **kw)["kept"] == 4


def test_a_record_without_inputs_resumes_unchecked(runs, tmp_path):
    """The record of an output written before inputs were recorded: its lines are kept as before, and
    the record rewritten names their inputs from then on."""
    src, out = tmp_path / "in.txt", tmp_path / "t.jsonl"
    src.write_text("red dog\nblue cat\n")
    P.predict_file(runs["translation"], src, out, beam_size=1)
    record = json.loads(resume.record_path(out).read_text())
    resume.record_path(out).write_text(json.dumps({k: v for k, v in record.items() if k != "inputs"}))
    src.write_text("red dog\nsix\nnine\n")
    assert P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)["kept"] == 2
    assert set(json.loads(resume.record_path(out).read_text())["inputs"]) == {"1", "2", "3"}


def test_a_line_whose_input_the_record_does_not_name_is_refused(runs, tmp_path):
    """A record that names inputs names every kept line's: a line of an id it lacks (the output edited,
    or written beside another record) is refused, not kept unchecked."""
    src, out = tmp_path / "in.txt", tmp_path / "t.jsonl"
    src.write_text("red dog\nblue cat\nsix\n")
    P.predict_file(runs["translation"], src, out, beam_size=1)
    record = json.loads(resume.record_path(out).read_text())
    del record["inputs"]["2"]
    resume.record_path(out).write_text(json.dumps(record))
    with pytest.raises(OptionError, match=rf"--resume: {out} holds a prediction for id 2 made from another input "
                       r"than the input's line 2 now holds \(1 of its 3 predictions' inputs changed\)"):
        P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)


@pytest.mark.parametrize("suffix", [".bz2", ".zst"])
def test_an_output_compressed_otherwise_is_refused_before_any_work(runs, tmp_path, monkeypatch, suffix):
    """--output preds.jsonl.bz2 was written as plain text under that name."""
    monkeypatch.setattr(P, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    with pytest.raises(OptionError, match=rf"--output .*preds\.jsonl\{suffix}: \{suffix} compression cannot be "
                       r"written; name it \.jsonl, or \.jsonl\.gz or \.jsonl\.xz to compress it"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output",
                       str(tmp_path / f"preds.jsonl{suffix}")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


@pytest.mark.parametrize("suffix, opener", [(".gz", gzip.open), (".xz", lzma.open)])
def test_compressed_output_name_is_written_compressed_and_resumes(runs, tmp_path, suffix, opener):
    """--output preds.jsonl.gz (the name the test inputs suggest) is gzip data, which --resume and
    zcat read back (it was plain text under a .gz name, which resume then refused)."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(4, 4))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / f"preds.jsonl{suffix}"
    P.predict_file(runs["translation"], src, out, beam_size=1)
    with opener(out, "rt", encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    assert [p["id"] for p in written] == ["r0", "r1", "r2", "r3"]
    again = P.predict_file(runs["translation"], src, out, beam_size=1, resume=True)
    assert again["predicted"] == 0 and again["kept"] == 4
    with opener(out, "rt", encoding="utf-8") as f:
        assert [json.loads(line) for line in f] == written


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def test_generate_cli_batch_mode_and_text_mode(runs, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "in.jsonl.gz", [{"id": "a", "src": "one two"}, {"id": "b", "src": "red cat"}])
    out = tmp_path / "preds.jsonl"
    summary = generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", str(out),
                             "--beam-size", "2", "--max-tokens", "8"])
    assert summary["predicted"] == 2 and [p["id"] for p in _read(out)] == ["a", "b"]
    assert "2 inputs, 2 predicted" in capsys.readouterr().err
    with pytest.raises(FileExistsError, match="exists; pass --resume"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", str(out)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "text": "one"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:1: missing field 'src'"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", str(bad), "--output", str(out),
                       "--overwrite"])
    outs = generate.main(["--checkpoint", str(runs["classification"]), "--text", "red cat", "--text", "one"])
    assert [o["input"] for o in outs] == ["red cat", "one"] and all(o["label"] in (0, 1) for o in outs)


def test_generate_text_mode_warns_of_or_refuses_too_long_inputs(runs, tmp_path, caplog):
    """Without --output an input over the model's maximum is truncated with the warning batch
    inference gives (naming its line), and --strict refuses it; it was cut silently."""
    long_text = " ".join(["seven eight nine"] * 10)
    src = tmp_path / "in.txt"
    src.write_text(f"one two\n\n{long_text}\n")
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        outs = generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--beam-size", "1"])
    assert len(outs) == 2
    assert "1 of 2 inputs are longer than the model's maximum of 15 tokens and were truncated (lines 3)" in caplog.text
    with pytest.raises(DataError, match=r"--text:2: input has \d+ tokens, more than the model's maximum of 15"):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", "--text", long_text, "--strict"])


@pytest.mark.parametrize("flags, message", [
    (["--max-len", "-1"], "--max-len must be >= 1, got -1"),
    (["--max-len", "0"], "--max-len must be >= 1, got 0"),
    (["--beam-size", "0"], "--beam-size must be >= 1, got 0"),
    (["--beam-size", "-3"], "--beam-size must be >= 1, got -3"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--max-src-len", "0"], "--max-src-len must be >= 2 (an input's tokens, its EOS included), got 0"),
    (["--max-src-len", "1"], "--max-src-len must be >= 2 (an input's tokens, its EOS included), got 1"),
    (["--len-ratio", "-0.5"], "--len-ratio must be >= 0 (0: no ratio, only --max-len), got -0.5"),
    (["--len-ratio", "nan"], "--len-ratio must be >= 0"),
    (["--len-ratio", "inf"], "--len-ratio must be >= 0 (0: no ratio, only --max-len), got inf"),
    (["--length-penalty", "inf"], "--length-penalty must be a number in [-50, 50] (len ** it divides a hypothesis's "
                                  "score), got inf"),
    (["--beam-size", "2", "--length-penalty", "1e308"], "--length-penalty must be a number in [-50, 50] (len ** it "
                                                          "divides a hypothesis's score), got 1e+308"),
    (["--beam-size", "2", "--length-penalty", "-51"], "--length-penalty must be a number in [-50, 50] (len ** it "
                                                       "divides a hypothesis's score), got -51.0"),
    (["--no-repeat-ngram", "-1"], "--no-repeat-ngram must be >= 0 (0: off), got -1"),
    (["--min-len", "-1"], "--min-len must be >= 0 (0: off), got -1"),
    (["--summary-sentences", "0"], "--summary-sentences must be >= 1, got 0"),
    (["--summary-words", "0"], "--summary-words must be >= 1, got 0"),
    (["--save-every", "-1"], "--save-every must be >= 0 seconds"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--nbest", "0"], "--nbest must be in [1, --beam-size 4] (a search keeps --beam-size hypotheses), got 0"),
    (["--nbest", "3", "--beam-size", "2"], "--nbest must be in [1, --beam-size 2] (a search keeps --beam-size "
                                            "hypotheses), got 3"),
])
@pytest.mark.parametrize("mode", ["text", "batch"])
def test_generate_refuses_bad_options_before_any_work(runs, tmp_path, monkeypatch, flags, message, mode):
    """`generate --max-len -1` used to emit one token: every decoding option is checked once, at the
    entry, naming the flag, before the checkpoint is loaded or a file is written."""
    for mod in (generate, P):
        monkeypatch.setattr(mod, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    io_args = ["--text", "one"] if mode == "text" else ["--input", str(src), "--output", str(tmp_path / "p.jsonl")]
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match=re.escape(message)):
        generate.main(["--checkpoint", str(runs["translation"]), *io_args, *flags])
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("flag, values, run", [("--no-repeat-ngram", (1, 2), "translation"),
                                               ("--min-len", (6, 5), "ends_early")])
@pytest.mark.parametrize("beam", ["1", "3"])
def test_decoding_constraints_reach_the_decoder(runs, tmp_path, monkeypatch, beam, flag, values, run):
    """generate and evaluate hand --no-repeat-ngram and --min-len to the decoder (whose constraints
    `tests/test_decoding.py` checks against references), they change the outputs, and evaluate
    records them with its scores."""
    key = flag[2:].replace("-", "_")
    seen = []
    for name in ("beam_search", "greedy_decode"):
        real = getattr(E, name)
        monkeypatch.setattr(E, name, lambda *a, _real=real, **k: seen.append(k[key]) or _real(*a, **k))
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(12, 5))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    kw = ["--checkpoint", str(runs[run]), "--input", str(src), "--beam-size", beam, "--len-ratio", "0"]
    generate.main([*kw, "--output", str(tmp_path / "free.jsonl")])
    assert set(seen) == {0}
    seen.clear()
    generate.main([*kw, "--output", str(tmp_path / "constrained.jsonl"), flag, str(values[0])])
    assert set(seen) == {values[0]}
    assert _read(tmp_path / "free.jsonl") != _read(tmp_path / "constrained.jsonl")
    seen.clear()
    data = tmp_path / "data"
    data.mkdir()
    _write_jsonl(data / "validation.jsonl", [{"src": t, "tgt": t} for t in _texts(6, 7)])
    m = evaluate.main(["--checkpoint", str(runs[run]), "--data", str(data), "--task", "translation",
                       "--beam-size", beam, flag, str(values[1]), "--out", str(tmp_path / "ev")])
    assert set(seen) == {values[1]} and m[key] == values[1] and m["length_penalty"] == 1.0


@pytest.mark.parametrize("mode", ["text", "batch"])
def test_every_decoding_flag_reaches_beam_search_in_both_modes(runs, tmp_path, monkeypatch, mode):
    """generate's --length-penalty, --no-repeat-ngram and --min-len are handed to beam search, with
    --output (batch inference) and without (the text mode) alike: each is a keyword of every call."""
    seen = []
    real = E.beam_search
    monkeypatch.setattr(E, "beam_search", lambda *a, **k: seen.append(k) or real(*a, **k))
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one two"}, {"id": "b", "src": "red cat"}])
    io_args = ["--input", str(src)] + (["--output", str(tmp_path / "p.jsonl")] if mode == "batch" else [])
    generate.main(["--checkpoint", str(runs["translation"]), *io_args, "--beam-size", "3", "--length-penalty", "0.5",
                   "--no-repeat-ngram", "2", "--min-len", "1"])
    assert seen and all((k["beam_size"], k["length_penalty"], k["no_repeat_ngram"], k["min_len"]) == (3, 0.5, 2, 1)
                        for k in seen)


def test_batch_inference_takes_save_every_0_and_its_threads(runs, tmp_path):
    """--save-every 0 is a snapshot after every batch (not refused: "must be >= 0"), and --threads
    sets torch's CPU threads for the run."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one two"}])
    summary = generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output",
                             str(tmp_path / "p.jsonl"), "--beam-size", "1", "--save-every", "0", "--threads", "2"])
    assert summary["predicted"] == 1 and torch.get_num_threads() == 2  # the autouse fixture set 1


def test_a_classifiers_labels_are_predicted_on_the_device_given(runs, monkeypatch):
    """generate.generate hands its `device` to the classifier's prediction as to the other tasks'
    (a GPU run predicted labels on the CPU otherwise): the very object it was given."""
    model, toks, ck = load_run(runs["classification"])
    device, seen = torch.device("cpu"), []
    monkeypatch.setattr(generate, "predict_labels", lambda *a, **k: seen.append(k["device"]) or predict_labels(*a, **k))
    assert generate.generate(model, toks, ck, ["one two"], device=device)[0]["label"] in (0, 1)
    assert len(seen) == 1 and seen[0] is device


def test_min_len_longer_than_any_output_is_refused(runs, tmp_path):
    model, toks, ck = load_run(runs["translation"])  # as long as the longest: taken (no output ends early)
    out = P.predict_records(model, toks, ck, _records(["one two", "red"]), device="cpu", beam_size=1, len_ratio=0,
                            min_len=4, max_len=4)
    assert len(out) == 2 and all(isinstance(o, str) and o.strip() for o in out)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    with pytest.raises(ValueError, match="--min-len 500 exceeds the longest output"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output",
                       str(tmp_path / "p.jsonl"), "--min-len", "500"])
    assert not (tmp_path / "p.jsonl").exists()
    # evaluate refuses it before any work (it was after reading the split and a teacher-forced pass over it)
    with pytest.raises(OptionError, match=rf"^--min-len 500 exceeds the longest output, {MAX_TGT} tokens"), \
            patch.object(evaluate, "run_split", side_effect=AssertionError("the split was read")):
        evaluate.main(["--checkpoint", str(runs["translation"]), "--out", str(tmp_path / "ev"), "--min-len", "500"])
    assert not (tmp_path / "ev").exists()


def test_library_entries_check_options_too(runs, tmp_path):
    """predict_records / predict_file / generate.generate check the same options (one function)."""
    model, toks, ck = load_run(runs["translation"])
    with pytest.raises(OptionError, match="--max-len must be >= 1, got -1"):
        P.predict_records(model, toks, ck, _records(["one two"]), device="cpu", max_len=-1)
    with pytest.raises(OptionError, match="--beam-size must be >= 1, got 0"):
        generate.generate(model, toks, ck, ["one two"], device="cpu", beam_size=0)
    with pytest.raises(OptionError, match=rf"--max-len must be < the model's max_len {model.cfg.max_len}"):
        generate.generate(model, toks, ck, ["one two"], device="cpu", max_len=model.cfg.max_len)
    with pytest.raises(OptionError, match=r"--length-penalty 2 ranks beam search's hypotheses; greedy decoding"):
        generate.generate(model, toks, ck, ["one two"], device="cpu", beam_size=1, length_penalty=2.0)
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "src": "one"}])
    # an extractive model's options, even at their default value, are refused by name for another model
    for kw, flag in ((dict(summary_words=60), "--summary-words"), (dict(summary_sentences=3), "--summary-sentences")):
        message = f"{flag} picks an extractive model's sentences; this model is translation"
        with pytest.raises(OptionError, match=message):
            generate.generate(model, toks, ck, ["one two"], device="cpu", **kw)
        with pytest.raises(OptionError, match=message):
            P.predict_records(model, toks, ck, _records(["one two"]), device="cpu", **kw)
        with pytest.raises(OptionError, match=message):
            P.predict_file(runs["translation"], src, tmp_path / "p.jsonl", **kw)
        with pytest.raises(OptionError, match=message):
            evaluate.main(["--checkpoint", str(runs["translation"]), flag, "3"])
    for task in ("summarization", "classification"):  # every model but an extractive one: an abstractive summary too
        other, other_toks, other_ck = load_run(runs[task])
        with pytest.raises(OptionError, match=f"--summary-sentences picks an extractive model's sentences; this "
                                              f"model is {task}"):
            generate.generate(other, other_toks, other_ck, ["one two"], device="cpu", summary_sentences=1)
    with pytest.raises(OptionError, match="--len-ratio must be >= 0"):
        P.predict_file(runs["translation"], src, tmp_path / "p.jsonl", len_ratio=-1.0)
    assert not (tmp_path / "p.jsonl").exists()
    # The edges still decode: one token, one beam, no ratio.
    out = generate.generate(model, toks, ck, ["one two"], device="cpu", beam_size=1, max_len=1)
    assert isinstance(out[0]["output"], str)
    for penalty in (-50.0, 50.0):  # the length penalty's bounds are taken
        out = generate.generate(model, toks, ck, ["one two"], device="cpu", beam_size=2, length_penalty=penalty,
                                max_len=2)
        assert isinstance(out[0]["output"], str)


def test_lengths_up_to_the_models_positions_are_taken_and_one_more_refused(runs):
    """A source takes at most max_len - 1 tokens (--max-src-len; a classifier adds [CLS]) and an output
    max_len - 1 (BOS before it): the bounds themselves are taken, one past them refused by name."""
    model, toks, ck = load_run(runs["translation"])
    n, recs = model.cfg.max_len, _records(["one two"])
    with pytest.raises(OptionError, match=rf"--max-src-len {n} exceeds the model's max_len {n} - 1"):
        P.predict_records(model, toks, ck, recs, device="cpu", max_src_len=n)
    with pytest.raises(OptionError, match=rf"--max-len must be in \[1, {n - 1}\], got {n}"):
        P.predict_records(model, toks, ck, recs, device="cpu", max_len=n)
    out = P.predict_records(model, toks, ck, recs, device="cpu", beam_size=1, max_src_len=n - 1, max_len=n - 1)
    assert len(out) == 1 and isinstance(out[0], str)


def test_generate_usage_errors(runs, tmp_path, monkeypatch):
    with pytest.raises(cli.UsageError, match="--output takes its inputs from --input FILE"):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", "--output", str(tmp_path / "p")])
    with pytest.raises(cli.UsageError, match=r"^--text 1 \(of 1\) is blank: each --text is an input, with its output "):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "  "])
    # a byte not UTF-8 (text pasted from a Latin-1 file) arrives as a lone surrogate: a TypeError in the tokenizer
    with pytest.raises(cli.UsageError, match=r"^--text 2 is not UTF-8 text: byte 0xff at character 4; convert it"):
        generate.main(["--checkpoint", "no-such-run", "--text", "one", "--text", "one \udcff two"])
    # one blank among others: refused too (skipped, the second output line was the third --text's)
    with pytest.raises(cli.UsageError, match=r"^--text 2 \(of 3\) is blank"):
        generate.main(["--checkpoint", "no-such-run", "--text", "one two", "--text", "", "--text", "red house"])
    monkeypatch.setattr("sys.stdin", io.StringIO("\n  \n"))
    with pytest.raises(DataError, match="<stdin>: no inputs"):
        generate.main(["--checkpoint", str(runs["translation"])])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, named", [
    (["--len-ratio", "0"], "--len-ratio is"),
    (["--max-src-len", "4", "--precision", "bf16"], "--max-src-len, --precision are"),
    (["--resume"], "--resume is"), (["--threads", "1", "--no-progress"], "--threads, --no-progress are"),
    (["--overwrite"], "--overwrite is"),
])
def test_batch_inference_flags_without_output_are_refused(runs, monkeypatch, flags, named):
    """The text mode (--text, or --input without --output) decoded without them, silently:
    `--len-ratio 0` still capped a translation at 2 Ls + 10 tokens, `--max-src-len 4` truncated at the
    training's length, `--precision bf16` ran fp32."""
    monkeypatch.setattr(generate, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    with pytest.raises(cli.UsageError, match=re.escape(f"{named} for batch inference: give --output PREDS.jsonl")):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", *flags])


@pytest.mark.parametrize("flags, named", [(["--field", "src"], "--field reads"),
                                          (["--field", "x", "--format", "jsonl"], "--field, --format read")])
def test_input_reading_flags_with_text_are_refused(runs, monkeypatch, flags, named):
    """--field and --format read --input's records: with --text they were ignored, silently."""
    monkeypatch.setattr(generate, "load_models", lambda *a, **k: pytest.fail("the checkpoint was loaded"))
    with pytest.raises(cli.UsageError, match=re.escape(f"{named} the records of --input; --text gives the text")):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", *flags])


def test_batch_flags_spelled_out_with_their_default_values_are_taken_without_output(runs):
    """A flag counts as given when its value is not the parser's default (`cli.given_flags`): one
    written out with its default value (--max-tokens 4096, --save-every 60, not small ints that
    Python keeps one object of) changes nothing, so the text mode takes it."""
    out = generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", "--beam-size", "1",
                         "--max-tokens", "4096", "--save-every", "60"])
    assert [o["input"] for o in out] == ["one"]


def test_a_model_that_decodes_nothing_refuses_decoding_flags(runs, tmp_path):
    """A classifier took --beam-size, --no-repeat-ngram, --min-len and --length-penalty and ignored them;
    now they are refused, naming them, in the text mode, batch inference and evaluate alike."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "text": "one two"}])
    clf = str(runs["classification"])
    message = r"--beam-size, --no-repeat-ngram are for decoding a sequence; this model is classification"
    flags = ["--beam-size", "2", "--no-repeat-ngram", "3"]
    with pytest.raises(OptionError, match=message):
        generate.main(["--checkpoint", clf, "--text", "one two", *flags])
    with pytest.raises(OptionError, match=message):
        generate.main(["--checkpoint", clf, "--input", str(src), "--output", str(tmp_path / "p.jsonl"), *flags])
    assert not (tmp_path / "p.jsonl").exists()
    # --max-len (and batch inference's --len-ratio), the output's length, were taken and ignored as well
    with pytest.raises(OptionError, match=r"^--max-len is for decoding a sequence; this model is classification"):
        generate.main(["--checkpoint", clf, "--text", "one two", "--max-len", "5"])
    with pytest.raises(OptionError, match=r"^--max-len, --len-ratio are for decoding a sequence; this model is "
                       r"classification and decodes none: drop them$"):
        generate.main(["--checkpoint", clf, "--input", str(src), "--output", str(tmp_path / "p.jsonl"), "--max-len",
                       "5", "--len-ratio", "1"])
    assert not (tmp_path / "p.jsonl").exists()
    with pytest.raises(OptionError, match=r"--min-len is for decoding a sequence; this model is classification"):
        evaluate.main(["--checkpoint", clf, "--min-len", "2", "--out", str(tmp_path / "e")])
    assert generate.main(["--checkpoint", clf, "--text", "one two"])[0]["label"] in (0, 1)  # the defaults run


def test_an_output_under_a_file_is_refused_before_any_work(runs, tmp_path):
    """It failed after every input was decoded, as "File exists"."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "src": "one two"}])
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OptionError, match=r"--output .*afile/sub/p\.jsonl: .*afile is a file, not a folder"):
        P.predict_file(runs["translation"], src, tmp_path / "afile" / "sub" / "p.jsonl")


def test_resume_with_overwrite_is_refused(runs, tmp_path):
    """--resume kept the output's predictions and --overwrite was ignored (a stale line stayed)."""
    src = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "src": "one two"}])
    out = tmp_path / "p.jsonl"
    out.write_text('{"id": 1, "prediction": "STALE"}\n')
    with pytest.raises(OptionError, match="--resume keeps the output's predictions and --overwrite replaces them"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--output", str(out),
                       "--resume", "--overwrite"])
    assert out.read_text() == '{"id": 1, "prediction": "STALE"}\n'


def test_the_text_mode_prints_one_line_per_input(runs, monkeypatch, capsys):
    """A summary decoded with a newline in it (a model trained on highlights one per line) printed as
    several lines; the text mode's contract is one line per input. So did an output holding another
    line end (a byte-level model can emit \\r or \\u2028), for a reader splitting lines as Python does."""
    outputs = ["one .\ntwo .", "three .", "four\r\nfive\rsix\x0bseven\x1c eight\u2028nine"]
    monkeypatch.setattr(generate, "generate", lambda *a, **k: [{"input": "a", "output": o} for o in outputs])
    generate.main(["--checkpoint", str(runs["summarization"]), "--text", "a", "--text", "b", "--text", "c"])
    assert capsys.readouterr().out.splitlines() == ["one . two .", "three .", "four five six seven  eight nine"]


@pytest.mark.parametrize("task", ["translation", "classification"])
def test_the_text_mode_answers_line_n_of_a_file_on_line_n(runs, task, monkeypatch, capsys):
    """A blank input line is not predicted; its output line is empty, where it was dropped and every
    later output printed a line early (`paste in.txt out.txt` paired the wrong lines). Each printed line
    is the one its input gets alone, and --json still prints one record per input that is not blank."""
    inputs = ["one two", "", "red house big", "  ", "", "three"]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(inputs) + "\n\n"))
    generate.main(["--checkpoint", str(runs[task])])
    printed = capsys.readouterr().out.splitlines()
    alone = {}
    for text in filter(str.strip, inputs):
        generate.main(["--checkpoint", str(runs[task]), "--text", text])
        alone[text] = capsys.readouterr().out.removesuffix("\n")
    assert printed == [alone.get(t, "") for t in inputs]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(inputs)))
    assert [r["input"] for r in generate.main(["--checkpoint", str(runs[task]), "--json"])] == list(alone)
    assert len(capsys.readouterr().out.splitlines()) == len(alone)


def test_generate_reads_a_jsonl_input_as_batch_inference_does(runs, tmp_path, capsys):
    """generate --input test_inputs.jsonl.gz without --output translates each record's text, as with
    --output (until 2026-12-01 it translated the raw JSON lines); --format text reads such a file as text."""
    src = _write_jsonl(tmp_path / "in.jsonl.gz", [{"id": "a", "src": "one two"}, {"id": "b", "src": "red house big"}])
    P.predict_file(runs["translation"], src, tmp_path / "p.jsonl", beam_size=2)
    got = generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--beam-size", "2"])
    assert [r["input"] for r in got] == ["one two", "red house big"]
    assert [r["output"] for r in got] == [p["prediction"] for p in _read(tmp_path / "p.jsonl")]
    assert capsys.readouterr().out.splitlines() == [r["output"] for r in got]
    raw = generate.main(["--checkpoint", str(runs["translation"]), "--input", str(src), "--format", "text"])
    assert raw[0]["input"] == '{"id": "a", "src": "one two"}'


def test_json_records_hold_each_outputs_score_and_nbest_the_searchs_best_outputs(runs, capsys):
    """generate --json: a translation's record holds its output's score, and with --nbest N the search's N
    best outputs, best first, the first the output itself; the outputs are the text mode's and the scores
    `beam_search_nbest`'s for the same input (whose scores tests/test_decoding.py checks against the full
    model's log-probabilities), rounded to 6 decimals. A classifier refuses --nbest; --output refuses --json."""
    from scratchformer.model import beam_search_nbest

    texts = ["one two three", "red house", "big big big one"]
    text_args = [a for t in texts for a in ("--text", t)]
    model, toks, _ = load_run(runs["translation"], "cpu")
    for beam, nbest in ((1, 1), (3, 1), (3, 3)):
        flags = ["--checkpoint", str(runs["translation"]), *text_args, "--beam-size", str(beam)]
        plain = generate.main(flags)
        capsys.readouterr()
        records = generate.main([*flags, "--json", "--nbest", str(nbest)])
        assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == records
        assert [r["output"] for r in records] == [r["output"] for r in plain]
        for text, r in zip(texts, records, strict=True):
            assert set(r) == {"input", "output", "score", *(["nbest"] if nbest > 1 else [])}
            ids = torch.tensor([toks.src.encode(text) + [EOS_ID]])
            tokens, scores = beam_search_nbest(model, ids, torch.tensor([ids.shape[1]]), nbest=nbest,
                                               beam_size=beam, max_len=E.decode_max_len("translation",
                                                                                         torch.tensor([ids.shape[1]]),
                                                                                         MAX_TGT)[0].item())
            outputs, want = toks.tgt.decode_batch(tokens[0].tolist()), scores[0].tolist()  # alone: batched within fp32
            got = r["nbest"] if nbest > 1 else [{"output": r["output"], "score": r["score"]}]
            assert [h["output"] for h in got] == outputs and got[0] == {"output": r["output"], "score": r["score"]}
            assert [h["score"] for h in got] == pytest.approx(want, abs=1e-5)
            assert all(round(h["score"], 6) == h["score"] for h in got)
            printed = [h["score"] for h in got]
            assert len({tuple(row) for row in tokens[0].tolist()}) == nbest and printed == sorted(printed, reverse=True)
    with pytest.raises(OptionError, match=r"--nbest is for decoding a sequence; this model is classification"):
        generate.main(["--checkpoint", str(runs["classification"]), "--text", "one", "--json", "--nbest", "2"])
    with pytest.raises(cli.UsageError, match=r"--nbest 2 lists each input's outputs in its --json record or --output "
                                             r"line: give --json, or --output"):
        generate.main(["--checkpoint", str(runs["translation"]), "--text", "one", "--nbest", "2"])
    with pytest.raises(cli.UsageError, match=r"--json prints the text mode's records; --output writes JSON lines of "
                                             r"its own \(with --nbest N, each line's n-best list\): drop --json"):
        generate.main(["--checkpoint", str(runs["translation"]), "--input", "-", "--output", "p.jsonl", "--json",
                       "--nbest", "2"])


def test_sampled_predictions_depend_on_the_seed_and_each_inputs_id_not_on_batching_or_a_resume(
        runs, tmp_path, monkeypatch):
    """Batch inference with --sample: the same predictions one input a batch or all in one, after a cut
    run's --resume, and for each id in a file of the inputs reversed; generate's text mode over the file
    draws them too; another seed draws others."""
    rows = [{"id": f"r{i}", "src": t} for i, t in enumerate(_texts(12, 5))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    flipped = _write_jsonl(tmp_path / "flipped.jsonl", rows[::-1])
    kw = dict(beam_size=1, sampling=Sampling(temperature=1.5, top_p=0.95, seed=7))
    run = runs["translation"]
    P.predict_file(run, src, tmp_path / "one.jsonl", batch_size=1, **kw)
    want = _read(tmp_path / "one.jsonl")
    P.predict_file(run, src, tmp_path / "all.jsonl", max_tokens=4096, **kw)
    assert _read(tmp_path / "all.jsonl") == want
    P.predict_file(run, flipped, tmp_path / "flipped_out.jsonl", max_tokens=4096, **kw)
    assert _read(tmp_path / "flipped_out.jsonl") == want[::-1]
    monkeypatch.setattr(P, "format_prediction", _dying_format(5))
    with pytest.raises(KeyboardInterrupt):
        P.predict_file(run, src, tmp_path / "cut.jsonl", batch_size=3, save_every=0, **kw)
    monkeypatch.setattr(P, "format_prediction", _FORMAT)
    summary = P.predict_file(run, src, tmp_path / "cut.jsonl", resume=True, batch_size=5, **kw)
    assert summary["kept"] == 3 and _read(tmp_path / "cut.jsonl") == want
    texts = generate.main(["--checkpoint", str(run), "--input", str(src), "--sample", "--temperature", "1.5",
                           "--top-p", "0.95", "--seed", "7"])
    assert [r["output"] for r in texts] == [p["prediction"] for p in want]
    P.predict_file(run, src, tmp_path / "seed8.jsonl", **{**kw, "sampling": Sampling(temperature=1.5, seed=8)})
    other = _read(tmp_path / "seed8.jsonl")
    assert sum(a != b for a, b in zip(want, other, strict=True)) >= 9, "another seed draws other outputs"
    greedy = P.predict_records(*load_run(run), _records([r["src"] for r in rows]), device="cpu", beam_size=1)
    assert sum(p["prediction"] != g for p, g in zip(want, greedy, strict=True)) >= 9, "samples are not greedy's"


def test_generate_sample_draws_nbest_samples_and_refuses_what_it_leaves_no_part(runs, capsys):
    """generate --sample --json --nbest N: N samples an input in the order drawn (N past --beam-size's default),
    the record's output and score the first's, which --nbest 1 draws alone; top-k 1 is greedy. Beam search's
    flags with --sample, and the sampling flags without it, are refused naming the flag."""
    run = str(runs["translation"])
    text_args = [a for t in ("one two three", "red house", "big big big one") for a in ("--text", t)]
    flags = ["--checkpoint", run, *text_args, "--json", "--sample", "--temperature", "2"]
    records = generate.main([*flags, "--nbest", "6"])
    firsts = generate.main([*flags, "--nbest", "1"])
    capsys.readouterr()
    for r, first in zip(records, firsts, strict=True):
        assert len(r["nbest"]) == 6 and r["nbest"][0] == {"output": r["output"], "score": r["score"]} == \
            {"output": first["output"], "score": first["score"]}
        assert len({h["output"] for h in r["nbest"]}) >= 4 and all(h["score"] < 0 for h in r["nbest"])
    greedy = generate.main(["--checkpoint", run, *text_args, "--beam-size", "1"])
    top1 = generate.main(["--checkpoint", run, *text_args, "--sample", "--top-k", "1", "--seed", "5"])
    assert [r["output"] for r in top1] == [r["output"] for r in greedy]
    base = ["--checkpoint", run, "--text", "one"]
    for extra, error, message in [
            (["--temperature", "0.7"], OptionError, "--temperature shapes --sample's draws: give --sample, or "
                                                    "drop it"),
            (["--top-k", "5", "--seed", "2"], OptionError, "--top-k, --seed shape --sample's draws: give --sample, "
                                                           "or drop them"),
            (["--sample", "--beam-size", "2"], OptionError, "--beam-size 2 is beam search's; --sample draws each "
                                                            "token: drop --beam-size"),
            (["--sample", "--length-penalty", "0.5"], OptionError, "--length-penalty 0.5 is beam search's"),
            (["--sample", "--temperature", "0"], OptionError, "--temperature must be a number > 0"),
            (["--sample", "--temperature", "nan"], OptionError, "--temperature must be a number > 0"),
            (["--sample", "--top-k", "-1"], OptionError, "--top-k must be >= 0 (0: every token), got -1"),
            (["--sample", "--top-p", "1.5"], OptionError, "--top-p must be in (0, 1] (1: every token), got 1.5"),
            (["--sample", "--seed", "-1"], OptionError, "--seed must be in [0, 2**63), got -1"),
            (["--sample", "--json", "--nbest", "0"], OptionError, "--nbest must be >= 1 (samples an input), got 0")]:
        with pytest.raises(error, match=re.escape(message)):
            generate.main(base + extra)
    # --sample's beam size of 1 is not named: the user gave no --beam-size (it was, first)
    with pytest.raises(OptionError, match=r"^--sample, --top-k are for decoding a sequence; this model is classif"):
        generate.main(["--checkpoint", str(runs["classification"]), "--text", "one", "--sample", "--top-k", "3"])
    model, toks, ckpt = load_run(runs["classification"])
    with pytest.raises(OptionError, match=r"--sample draws a decoded sequence; this model is classification"):
        P.predict_records(model, toks, ckpt, _records(["one"]), device="cpu", beam_size=1, sampling=Sampling())


@pytest.mark.parametrize("decoding", [["--beam-size", "3"], ["--sample", "--temperature", "1.5"]])
def test_batch_inference_writes_each_inputs_nbest_list_as_the_text_mode_gives_it(runs, tmp_path, decoding):
    """generate --output --nbest 3: each line holds its id, the prediction and its score, then the n-best list
    (the search's best 3, or 3 samples), the prediction its first; the same outputs and scores as --json's
    for the same inputs. A --resume with another --nbest is refused (the lines would differ in form)."""
    rows = [{"id": f"n{i}", "src": t} for i, t in enumerate(_texts(7, 8, 5))]
    src = _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "nbest.jsonl"
    flags = ["--checkpoint", str(runs["translation"]), *decoding, "--nbest", "3"]
    generate.main([*flags, "--input", str(src), "--output", str(out), "--batch-size", "2"])
    lines = _read(out)
    records = generate.main([*flags, "--input", str(src), "--json"])
    assert [line["id"] for line in lines] == [r["id"] for r in rows]
    for line, r in zip(lines, records, strict=True):
        assert list(line) == ["id", "prediction", "score", "nbest"] and len(line["nbest"]) == 3
        assert line["nbest"][0] == {"prediction": line["prediction"], "score": line["score"]}
        assert [(h["prediction"], h["score"]) for h in line["nbest"]] == \
            [(h["output"], pytest.approx(h["score"], abs=2e-6)) for h in r["nbest"]]
    if decoding[0] == "--beam-size":
        plain = tmp_path / "plain.jsonl"
        generate.main(["--checkpoint", str(runs["translation"]), "--beam-size", "3", "--input", str(src), "--output",
                       str(plain)])
        assert [p["prediction"] for p in _read(plain)] == [line["prediction"] for line in lines]
    with pytest.raises(OptionError, match=r"was written with --nbest 3 \(now unset\)"):
        generate.main([*flags[:-2], "--input", str(src), "--output", str(out), "--resume"])
