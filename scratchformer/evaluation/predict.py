"""Batch inference: a file of inputs -> ``{"id", "prediction"}`` JSON lines, written atomically.

Inputs (`read_inputs`): ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.xz`` records holding the task's input field (``src``
translation, ``document`` summarization (also extractive), ``text`` classification; another with ``field``) and an
optional ``id`` (a record without one gets its line number), or plain text with one input per
line (id = line number, blank lines skipped); ``-`` reads stdin (JSON lines if its first line begins
with ``{``, else text; ``--format`` decides otherwise). Bad input is a `DataError` naming the file and line.

Prediction (`predict_records`) reuses the evaluation path (`predict_seq2seq`, `predict_labels`,
`predict_extracts`): batches by token budget over length-sorted inputs, KV-cached greedy or beam search, outputs put
back in input order. Summaries come out one sentence per line (`metrics.split_sentences`, the
splitter of the Lead-3 baseline, so ROUGE-Lsum sees the boundaries); labels are ints. Inputs
longer than the model's maximum (the training ``max_src_len``) are truncated with a warning, or
refused (``strict``).

Output (`predict_file`): the final file appears only when complete (temp file in the same folder,
fsync, rename). While running, snapshots of the finished predictions go, atomically as well, to
``OUTPUT.partial``; ``resume`` keeps the lines of an existing output and of its snapshot and
predicts only the ids they lack, so a killed run loses at most one snapshot interval; the record
beside the output (`resume`) refuses lines of other weights or decoding options, or of inputs that changed.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import data as D
from ..checkpoint import fsync_dir, weights_digest
from ..data.extractive import MAX_ORACLE_SENTENCES
from ..data.files import check_text, display_name, read_lines, uncompressed_name
from ..locks import make_folders, release, remove_made
from ..model import Sampling, row_key
from .evaluate import LEN_RATIO, predict_extracts, predict_labels, predict_seq2seq
from .loading import load_models
from .metrics import split_sentences
from .options import OptionError, check_decode_flags, check_options, check_task_options
from .resume import Lines, check_output, hold_output, lock_path

log = logging.getLogger(__name__)

# The input field of each task's records (the source side of data.FIELDS).
INPUT_FIELDS = {task: fields[0] for task, fields in D.FIELDS.items()}


@dataclass
class InputRecord:
    id: str | int  # the record's id, or its line number
    text: str
    line: int  # 1-based line in the input file
    implied: bool = False  # the id is the line number (a text line, or a record without "id")


# ---------------------------------------------------------------------------------------------
# Reading inputs
# ---------------------------------------------------------------------------------------------


def _json_record(raw: str, where: str, field: str, lineno: int) -> InputRecord:
    try:
        rec = json.loads(raw)
    except json.JSONDecodeError as e:
        raise D.DataError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rec, dict):
        raise D.DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if field not in rec:
        have = ", ".join(repr(k) for k in rec) or "none"
        raise D.DataError(f"{where}: missing field {field!r} (fields present: {have}); choose one with --field")
    text = check_text(rec[field], field, where)
    rid = rec.get("id", lineno)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise D.DataError(f"{where}: field 'id' must be a string or an integer, got {type(rid).__name__}")
    return InputRecord(rid, text, lineno, "id" not in rec)


def read_inputs(path: str | Path, task: str, field: str | None = None, fmt: str = "auto") -> list[InputRecord]:
    """The inputs of a file, in file order. fmt: "auto" (by the name: ``.jsonl`` (``.gz``, ``.xz``) are
    JSON lines, anything else text; stdin is sniffed), "jsonl" or "text".

    Raises DataError (file:line) on malformed JSON, a missing or empty field, a duplicate id, an
    empty file or undecodable text; OptionError for a `field` of a file read as text.
    """
    if task not in INPUT_FIELDS:
        raise OptionError(f"unknown task {task!r}; choose one of {sorted(INPUT_FIELDS)}")
    given, field = field, field or INPUT_FIELDS[task]
    name = display_name(path)
    records: list[InputRecord] = []
    seen: dict[str, InputRecord] = {}  # by the id as text: 1 and "1" are one id to whoever reads the output
    blank = 0
    why = "--format text" if fmt == "text" else "its first line does not begin with '{'"
    if fmt == "auto" and str(path) != "-":
        fmt = "jsonl" if uncompressed_name(name).endswith((".jsonl", ".json")) else "text"
        why = "its name does not end in .jsonl"
    for lineno, raw in read_lines(path):  # DataError (file:line) for missing, undecodable or broken files
        if not raw.strip():
            blank += 1
            continue
        sniffed = fmt == "auto"  # stdin: the first non-blank line decides
        fmt = ("jsonl" if raw.lstrip().startswith("{") else "text") if sniffed else fmt
        if fmt == "jsonl":
            try:
                rec = _json_record(raw, f"{name}:{lineno}", field, lineno)
            except D.DataError as e:
                if not sniffed:
                    raise
                raise D.DataError(f"{e}; read as JSON lines because it begins with '{{': --format text reads "
                                  f"{name} as one input a line") from None
        elif given:  # each line would be translated whole, its JSON included
            raise OptionError(f"--field {given} names a field of JSON records, and {name} is read as text, one input "
                              f"a line ({why}): give --format jsonl, or drop --field")
        else:
            rec = InputRecord(lineno, raw, lineno, True)
        if (first := seen.setdefault(str(rec.id), rec)) is not rec:
            also = "" if first.id == rec.id else f", as {first.id!r}: ids are compared as text"
            own = ", line {}'s number: its record has no \"id\"".format
            raise D.DataError(f"{name}:{lineno}: duplicate id {rec.id!r}{own(lineno) if rec.implied else ''} (first on "
                              f"line {first.line}{own(first.line) if first.implied else ''}{also})")
        records.append(rec)
    if not records:
        raise D.DataError(f"{name}: no inputs ({'the file holds only blank lines' if blank else 'the file is empty'})")
    return records


# ---------------------------------------------------------------------------------------------
# Encoding and prediction
# ---------------------------------------------------------------------------------------------


def encode_records(records: list[InputRecord], task: str, toks, max_src_len: int, *, strict: bool = False,
                   source: str = "input", from_flag: bool = False) -> D.EncodedDataset:
    """Tokenize inputs as evaluation does (`data.encode_examples`). Longer than max_src_len tokens
    (seq2seq: max_src_len - 1 plus EOS): truncated with a warning naming how many, or with
    `strict` a DataError naming the first offending line. `from_flag`: max_src_len is --max-src-len's
    (else the model's maximum), as the messages say."""
    examples = [D.Example(r.text, 0 if task == "classification" else "", r.id) for r in records]
    dataset, stats = D.encode_examples(examples, task, toks.src, toks.tgt, max_src_len, max(2, max_src_len))
    if stats.src_truncated and task == "extractive":  # a document's sentences are taken while they fit
        if strict:  # the first document whose marked sentences (a marker each) overflow
            first = next(r.line for r in records
                         if sum(len(ids) + 1 for ids in toks.src.encode_batch(split_sentences(r.text))) > max_src_len)
            fits = f"--max-src-len {max_src_len}" if from_flag else f"the model's {max_src_len} tokens"
            raise D.DataError(f"{source}:{first}: document does not fit in {fits} "
                              f"(--strict; {stats.src_truncated} document(s) in all are too long)")
        most = f"--max-src-len {max_src_len}" if from_flag else f"the model's maximum of {max_src_len} tokens"
        log.warning(f"{stats.src_truncated} of {len(records)} documents are longer than {most}: their sentences "
                    "past it are not candidates; --strict refuses them")
    elif stats.src_truncated:
        # Truncated rows end at exactly max_src_len tokens; re-encode only those to tell which were over.
        limit = max_src_len if task == "classification" else max_src_len - 1
        cands = [i for i, s in enumerate(dataset.src) if len(s) == max_src_len]
        lens = [len(ids) for ids in toks.src.encode_batch([records[i].text for i in cands])]
        over = [(records[i].line, n) for i, n in zip(cands, lens, strict=True) if n > limit]
        first_line, first_n = over[0]
        most = f"the model's maximum of {limit} tokens"
        if from_flag:  # "tokens" before the flag: after it, "... its EOS aside tokens and were truncated"
            most = f"the {limit} tokens that --max-src-len {max_src_len} admits" + (
                ", its EOS aside" if limit < max_src_len else "")
        if strict:
            raise D.DataError(f"{source}:{first_line}: input has {first_n} tokens, more than {most} (--strict; "
                              f"{len(over)} input(s) in all are too long)")
        shown = ", ".join(str(line) for line, _ in over[:5]) + (", ..." if len(over) > 5 else "")
        log.warning(f"{len(over)} of {len(records)} inputs are longer than {most}{',' * most.endswith('aside')} "
                    f"and were truncated (lines {shown}); --strict refuses them instead")
    return dataset


def format_prediction(pred, task: str):
    """A prediction as written: labels as ints, summaries one sentence per line, translations as is."""
    if task == "classification":
        return int(pred)
    if task == "summarization":  # an extract is already one sentence per line
        return "\n".join(split_sentences(pred))
    return pred


def _lengths(model, ckpt: dict, max_src_len: int | None, max_len: int | None) -> tuple[int, int]:
    """The source and output lengths `predict_records` runs at (default: the training's), refused
    (OptionError) where the model cannot take them."""
    args = ckpt["args"]
    max_src_len = max_src_len or args["max_src_len"]
    if max_src_len + 1 > model.cfg.max_len:
        raise OptionError(f"--max-src-len {max_src_len} exceeds the model's max_len {model.cfg.max_len} - 1")
    max_len = max_len or args["max_tgt_len"]
    if ckpt["task"] not in D.ENCODER_ONLY and not 1 <= max_len < model.cfg.max_len:
        raise OptionError(f"--max-len must be in [1, {model.cfg.max_len - 1}], got {max_len}")
    return max_src_len, max_len


def _progress_bar(total: int):
    """A tqdm bar on stderr counting the examples predicted, in examples/s."""
    from tqdm import tqdm

    return tqdm(total=total, unit="ex", desc="predict", dynamic_ncols=True, file=sys.stderr)


@torch.no_grad()
def predict_records(model, toks, ckpt: dict, records: list[InputRecord], *, device, beam_size: int = 4,
                    length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_len: int = 0,
                    max_len: int | None = None, len_ratio: float | None = None, max_tokens: int | None = 4096,
                    batch_size: int | None = None, precision: str = "fp32",
                    max_src_len: int | None = None, strict: bool = False, source: str = "input",
                    summary_sentences: int | None = None, summary_words: int | None = None,
                    sampling: Sampling | None = None, nbest: int | None = None, mbr: int | None = None,
                    mbr_utility: str | None = None, on_result=None, progress: bool = False) -> list:
    """Predictions for `records`, in their order (see `format_prediction`).

    max_len: longest output in tokens (default: the training max_tgt_len); len_ratio: the cap
    ceil(len_ratio * Ls) + 10 (`evaluate.decode_max_len`; None = the task's default, 0 = none).
    no_repeat_ngram: n > 0 puts no n-gram twice in an output; min_len: at least that many tokens
    before EOS. summary_sentences / summary_words: an extractive model's picking (`predict_extracts`).
    sampling: outputs drawn (`model.sample_decode`, beam_size 1), each input's keyed by its id (`model.row_key`):
    the same in any batch, or resumed. nbest n: each prediction a dict with its n-best list (`_with_nbest`).
    mbr n: each prediction the MBR choice among n candidates (`mbr.mbr_pick`; mbr_utility None: chrf).
    max_tokens / batch_size: the batch budget (padded source tokens / inputs). `on_result(records,
    predictions)` is called after every batch; `progress` shows a tqdm bar in examples/s.
    """
    check_options(beam_size=beam_size, length_penalty=length_penalty, max_len=max_len, len_ratio=len_ratio,
                  max_tokens=max_tokens, batch_size=batch_size, max_src_len=max_src_len,
                  no_repeat_ngram=no_repeat_ngram, min_len=min_len, summary_sentences=summary_sentences,
                  summary_words=summary_words, sampling=sampling, mbr=mbr)
    task = ckpt["task"]
    check_task_options(task, summary_sentences, summary_words, sampling)
    from_flag = max_src_len is not None
    max_src_len, max_len = _lengths(model, ckpt, max_src_len, max_len)
    dataset = encode_records(records, task, toks, max_src_len, strict=strict, source=source, from_flag=from_flag)
    bar = _progress_bar(len(records)) if progress else None
    preds: list = [None] * len(records)

    def on_batch(indices, outputs):
        batch_preds = [_with_nbest(p, task) if nbest else format_prediction(p, task) for p in outputs]
        for i, p in zip(indices, batch_preds, strict=True):
            preds[i] = p
        if on_result is not None:
            on_result([records[i] for i in indices], batch_preds)
        if bar is not None:
            bar.update(len(indices))

    try:
        if task == "classification":
            predict_labels(model, dataset, device=device, max_tokens=max_tokens, batch_size=batch_size,
                           precision=precision, on_batch=on_batch)
        elif task == "extractive":
            predict_extracts(model, dataset, device=device, sentences=summary_sentences, words=summary_words,
                             max_tokens=max_tokens, batch_size=batch_size, precision=precision, on_batch=on_batch)
        else:
            predict_seq2seq(model, dataset, toks.tgt, device=device, max_tgt_len=max_len, beam_size=beam_size,
                            length_penalty=length_penalty, no_repeat_ngram=no_repeat_ngram, min_len=min_len,
                            max_tokens=max_tokens, batch_size=batch_size, precision=precision, len_ratio=len_ratio,
                            on_batch=on_batch, sampling=sampling, nbest=nbest or 0, mbr=mbr or 0,
                            mbr_utility=mbr_utility,
                            keys=[row_key(r.id) for r in records] if sampling is not None else None)
    finally:
        if bar is not None:
            bar.close()
    return preds


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def _with_nbest(hypotheses: list[dict], task: str) -> dict:
    """A line's fields from `predict_seq2seq`'s n-best list [{"output", "score"}]: the first's prediction
    and score, then every one's as "nbest", each prediction as `format_prediction` writes it."""
    hyps = [{"prediction": format_prediction(h["output"], task), "score": h["score"]} for h in hypotheses]
    return {**hyps[0], "nbest": hyps}


def _json_line(rid, pred) -> str:
    """A prediction's line: {"id", "prediction"}, or with an n-best list its fields (`_with_nbest`) after the id."""
    return json.dumps({"id": rid, **(pred if isinstance(pred, dict) else {"prediction": pred})}, ensure_ascii=False)


# The options that change a prediction (flag -> `predict_records`' keyword), recorded beside an output
# (`resume.check_resume`); the precision, backend and batching change none.
RECORDED = {"--beam-size": "beam_size", "--length-penalty": "length_penalty", "--no-repeat-ngram": "no_repeat_ngram",
            "--min-len": "min_len", "--max-len": "max_len", "--len-ratio": "len_ratio", "--max-src-len": "max_src_len",
            "--summary-sentences": "summary_sentences", "--summary-words": "summary_words", "--sample": "sampling",
            "--nbest": "nbest", "--mbr": "mbr", "--mbr-utility": "mbr_utility"}


def run_record(model, ckpt: dict, field: str, predict_kw: dict) -> dict:
    """What predictions come from: the checkpoint (its path(s), and its weights' digest) and the
    `RECORDED` options, defaults resolved (a default given explicitly is the same option)."""
    defaults = inspect.signature(predict_records).parameters
    options = {flag: predict_kw.get(k, defaults[k].default) for flag, k in RECORDED.items()}
    options["--max-src-len"], options["--max-len"] = _lengths(model, ckpt, options["--max-src-len"],
                                                              options["--max-len"])
    if options["--len-ratio"] is None:
        options["--len-ratio"] = LEN_RATIO.get(ckpt["task"], 0)
    if options["--sample"] is not None:  # as its flags read (None: beam search, as before --sample was recorded)
        options["--sample"] = [f"--{k.replace('_', '-')} {v}" for k, v in asdict(options["--sample"]).items()]
    if options["--mbr"] and options["--mbr-utility"] is None:  # `mbr_pick`'s default
        options["--mbr-utility"] = "chrf"
    if options["--summary-sentences"] is None and ckpt["task"] == "extractive":  # `predict_extracts`' default
        options["--summary-sentences"] = MAX_ORACLE_SENTENCES
    # compiled (a model, or an ensemble's members): the weights it wraps, named as uncompiled
    weights = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}
    return {"checkpoint": ckpt.get("ensemble", ckpt["path"]), "weights": weights_digest(weights),
            "options": {"--field": field, **options}}


def predict_file(checkpoint: str | Path | list, input: str | Path, output: str | Path, *, field: str | None = None,
                 fmt: str = "auto", resume: bool = False, overwrite: bool = False, save_every: float = 60.0,
                 device=None, kernel: str | None = None, compile: str | None = None, progress: bool = False,
                 decode_flags: Sequence[str] = (), **predict_kw) -> dict:
    """Predict every input of a file and write ``{"id", "prediction"}`` lines to `output`, in input
    order, and beside it what wrote them (`resume.write_record`). `checkpoint`: a file or run folder,
    or a list of them: an ensemble (`load_models`). `resume` keeps the lines of an earlier output and
    its snapshot (`resume.check_resume`: of the same weights and options, and only ids of the input).

    save_every: seconds between snapshots to ``OUTPUT.partial`` (0: after every batch). Other
    keyword arguments go to `predict_records`; `decode_flags`: see `check_decode_flags`. Returns a
    summary dict (counts, seconds, examples/s).
    While it runs the output is held (`lock_path`): a second process writing it is refused.
    Raises OptionError for an option no model can take (checked first), DataError for bad input,
    FileExistsError for an existing output without resume/overwrite."""
    check_options(**predict_kw)
    output, part = check_output(output, input, resume, overwrite)
    made = make_folders(output.parent)
    try:
        fd = hold_output(output, part, resume, overwrite)
        try:
            return _predict_file(checkpoint, input, output, part, field=field, fmt=fmt, resume=resume,
                                 overwrite=overwrite, save_every=save_every, device=device, kernel=kernel,
                                 compile=compile, progress=progress, decode_flags=decode_flags, **predict_kw)
        finally:
            release(lock_path(output), fd)
    finally:
        remove_made(made)  # a failure before any line was written (a bad input, checkpoint): no empty folders


def _predict_file(checkpoint, input, output: Path, part: Path, *, field, fmt, resume, overwrite, save_every, device,
                  kernel, compile, progress, decode_flags, **predict_kw) -> dict:
    """`predict_file`'s work, once its output is held."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, toks, ckpt = load_models(checkpoint, device, kernel, compile)
    task = ckpt["task"]
    check_task_options(task, **predict_kw)  # here too: a resumed file may leave predict_records nothing to do
    check_decode_flags(task, list(decode_flags))
    records = read_inputs(input, task, field, fmt)
    record = run_record(model, ckpt, field or INPUT_FIELDS[task], predict_kw)
    out = Lines(output, part, record, records, resume, overwrite)
    todo = [r for r in records if r.id not in out.done]
    last_save = time.monotonic()

    def on_result(batch_records, preds):
        nonlocal last_save
        for r, p in zip(batch_records, preds, strict=True):
            out.add(r.id, _json_line(r.id, p))
        if time.monotonic() - last_save >= save_every:
            out.snapshot()
            last_save = time.monotonic()

    t0 = time.time()
    if todo:
        source = "<stdin>" if str(input) == "-" else str(input)
        try:
            predict_records(model, toks, ckpt, todo, device=device, on_result=on_result, progress=progress,
                            source=source, **predict_kw)
        except KeyboardInterrupt:  # Ctrl-C: keep what is done for --resume (a hard kill keeps the last snapshot)
            if out.new:
                out.snapshot()
                log.warning(f"interrupted: {len(out.new)} new predictions saved to {part}; rerun with --resume")
            raise
    seconds = time.time() - t0
    out.finish()
    fsync_dir(output.parent)
    return {"output": str(output), "task": task, "inputs": len(records), "predicted": len(todo),
            "kept": len(records) - len(todo), "seconds": round(seconds, 2),
            "examples_per_s": round(len(todo) / seconds, 2) if todo and seconds > 0 else math.nan,
            "checkpoint": ckpt.get("ensemble", ckpt["path"])}
