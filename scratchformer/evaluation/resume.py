"""The output F of `generate --output F`: where it may go and who writes it (`check_output`,
`hold_output`), and what `--resume` keeps of an earlier F: its lines (`read_done`), and only
those of the same model and decoding, as the record beside it says (`record_path`, ``F.meta.json``).

The record (`write_record`) holds the checkpoint (its path(s), for messages, and its weights'
SHA-256, `checkpoint.weights_digest`, which names the model in whatever file: a copy, or the
average of one checkpoint that `scripts/gpu/50_train.sh` ships), the options that change a
prediction (`predict.RECORDED`: beam, penalties, lengths, the input field; not the precision, the
kernel or the batching: a GPU's bf16 snapshot is finished on a CPU in fp32), and whether F itself
was written with them ("output": a cut --overwrite run leaves the F it was replacing, whose lines
are not kept), and for each id with a line in F or its snapshot a digest of the input its prediction
was made from ("inputs", `input_digest`; written before the lines it names). `check_resume` refuses
another model or other options before any work, `check_inputs` a line kept for an input that changed
(a record without "inputs", written before they were kept, resumes unchecked); `Lines` holds what a
run writes: what it keeps (`start_output`) and what it adds, the record beside each write of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from .. import data as D
from ..checkpoint import is_checkpoint, output_file_refusal, write_lines_atomic
from ..cli import shown
from ..data.files import COMPRESSED, read_lines
from ..locks import Held, hold, release
from .options import OptionError

log = logging.getLogger(__name__)


def record_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".meta.json")


def partial_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".partial")


def lock_path(output: Path) -> Path:
    """The lock a process writing `output` holds (`predict_file`), removed when it ends."""
    return output.with_name(f".{output.name}.lock")


# Compressed formats that `write_lines_atomic` does not write (it writes `data.files.COMPRESSED`'s)
OTHER_COMPRESSION = (".bz2", ".zst", ".zstd", ".lz4", ".lzma", ".lz", ".z", ".zip", ".br", ".7z", ".sz", ".tgz")


def check_output(output: str | Path, input: str | Path, resume: bool, overwrite: bool) -> tuple[Path, Path]:
    """(the output, its .partial snapshot); refused (OptionError) when the output is a folder (the
    final rename would fail after all the work), under a file, or it, its snapshot, record or lock
    would be written over the input or a checkpoint; with both resume and overwrite."""
    if resume and overwrite:
        raise OptionError("--resume keeps the output's predictions and --overwrite replaces them: give one")
    output = Path(output)
    if (refusal := output_file_refusal(output, "the predictions", "preds.jsonl")) is not None:
        raise OptionError(refusal)
    if output.suffix.lower() in OTHER_COMPRESSION:  # it would be plain text under that name
        raise OptionError(f"--output {output}: {output.suffix} compression cannot be written; name it .jsonl, or "
                          f"{' or '.join(f'.jsonl{c}' for c in COMPRESSED)} to compress it")
    for written in (output, partial_path(output), record_path(output), lock_path(output)):
        if str(input) != "-" and written.resolve() == Path(input).resolve():
            raise OptionError(f"--output {output} would write {written} over its own --input {input}: the "
                              f"inputs would be lost; write the predictions elsewhere")
        if is_checkpoint(written):  # a model's file (the one predicting, named as the output by mistake)
            raise OptionError(f"--output {output} would write {written} over a checkpoint: the model would be "
                              f"lost; write the predictions elsewhere")
    return output, partial_path(output)


def hold_output(output: Path, part: Path, resume: bool, overwrite: bool) -> int:
    """Hold `output` for this process (`lock_path`; the descriptor to `release`): refused (OptionError)
    while another process writes it (both wrote: one's predictions were lost, or mixed into the other's);
    then FileExistsError for an existing output or snapshot without resume or overwrite. Its folder
    must exist (`locks.make_folders`)."""
    try:
        fd = hold(lock_path(output))
    except Held as e:
        raise OptionError(f"--output {output} is being written by another process (pid {e.pid}); wait for it "
                          "to end, or write elsewhere") from None
    if not (resume or overwrite) and (output.exists() or part.exists()):
        release(lock_path(output), fd)
        raise FileExistsError(f"{output if output.exists() else part} exists; pass --resume to keep its "
                              "predictions and add the missing ones, or --overwrite to replace it")
    return fd


def write_record(output: Path, record: dict, written: bool) -> None:
    """The record beside `output`, atomically; `written`: `output` holds this run's predictions."""
    write_lines_atomic(record_path(output), [json.dumps({**record, "output": written}, indent=2)])


def _named(checkpoint) -> str:
    return " + ".join(c["path"] for c in checkpoint) if isinstance(checkpoint, list) else str(checkpoint)


def input_digest(text: str) -> str:
    """What the record keeps of the input text a prediction is made from: 16 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def check_resume(output: Path, part: Path, record: dict) -> tuple[bool, dict[str, str] | None]:
    """Whether `output`'s lines are kept (those of `part`, its snapshot, always are), and the digests
    of their inputs the record holds (id as text -> `input_digest`; None: not recorded), or
    OptionError when the record beside them names other weights or options. An output without a
    record (written before records were kept) is kept unchecked, with a warning."""
    found = [p for p in (output, part) if p.exists()]
    path = record_path(output)
    if not found:
        return False, None
    if not path.exists():
        log.warning(f"{found[0]} has no record of the checkpoint and options it was written with ({path.name}; "
                    "written by an older version): its predictions are kept unchecked")
        return True, None
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        old_options, old_weights = dict(old["options"]), old["weights"]
        inputs = None if old.get("inputs") is None else {str(k): str(v) for k, v in dict(old["inputs"]).items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise D.DataError(f"{path}: not a record of generate's ({type(e).__name__}: {e}); it says what wrote "
                          f"{found[0]}: without it, write a new --output (or --overwrite)") from None
    if old_options.get("--mbr") and old_options.get("--mbr-utility") is None:  # recorded unresolved until 2026-12-07
        old_options["--mbr-utility"] = "chrf"
    fix = "or write a new --output (or --overwrite)"
    if old_weights != record["weights"]:
        raise OptionError(f"--resume: {found[0]} holds predictions of {_named(old.get('checkpoint'))}, whose weights "
                          f"are not those of {_named(record['checkpoint'])}: the output would mix two models' "
                          f"predictions; resume with that checkpoint, {fix}")
    changed = [f"{flag} {shown(old_options.get(flag))} (now {shown(value)})"
               for flag, value in record["options"].items() if old_options.get(flag) != value]
    if changed:
        raise OptionError(f"--resume: {found[0]} was written with {', '.join(changed)}: the output would mix two "
                          f"decodings; give the options it was written with, {fix}")
    return bool(old.get("output")), inputs


def check_inputs(path: Path, lines: dict, old: dict[str, str] | None, records, digests: dict) -> None:
    """OptionError naming the first id of `records` (the inputs: .id, .line) with a line in `path`
    (`lines`, id -> line) whose input is not the one the record says its prediction was made from
    (`old`, id as text -> `input_digest`; `digests`: the inputs' now); None: not recorded, unchecked."""
    if old is None:
        return
    changed = [r for r in records if r.id in lines and old.get(str(r.id)) != digests[r.id]]
    if changed:
        first = changed[0]
        raise OptionError(f"--resume: {path} holds a prediction for id {first.id!r} made from another input than "
                          f"the input's line {first.line} now holds ({len(changed)} of its {len(lines)} predictions' "
                          "inputs changed): the output would pair inputs with predictions of others; restore the "
                          "input it was written for, or --overwrite (or write a new --output)")


def start_output(output: Path, part: Path, record: dict, records, digests: dict, resume: bool,
                 overwrite: bool) -> tuple[dict[str | int, str], bool]:
    """The lines kept of an earlier output and its snapshot (`resume`: `check_resume`, `read_done`,
    `check_inputs`), id -> line, and whether the output's are among them (see `Lines`)."""
    keep_output, old = check_resume(output, part, record) if resume else (False, None)
    done: dict[str | int, str] = {}
    for path, keep in ((part, resume), (output, keep_output)):  # the output's line of an id wins
        if keep:
            lines = read_done(path, digests)
            check_inputs(path, lines, old, records, digests)
            done.update(lines)
    if overwrite:  # the snapshot of a run it replaces, which a --resume after a cut would keep
        part.unlink(missing_ok=True)
    return done, keep_output


class Lines:
    """An output as a run writes it: the lines kept of an earlier one (`start_output`) and those added
    (`add`), in the inputs' order (`records`: .id, .text, .line). Each write of them (`snapshot` to
    `part`, `finish` to `output`) is preceded by the record's, naming each line's input
    (`input_digest`), so that no line is ever on disk without it."""

    def __init__(self, output: Path, part: Path, record: dict, records, resume: bool, overwrite: bool):
        self.output, self.part, self.record, self.records = output, part, record, records
        self.digests = {r.id: input_digest(r.text) for r in records}
        self.done, self.keep_output = start_output(output, part, record, records, self.digests, resume, overwrite)
        self.new: dict[str | int, str] = {}
        self._write_record(self.keep_output)  # before any new line (a snapshot's lines are its)

    def add(self, rid, line: str) -> None:
        self.new[rid] = line

    def lines(self):
        return (self.new.get(r.id, self.done.get(r.id)) for r in self.records if r.id in self.new or r.id in self.done)

    def _write_record(self, written: bool) -> None:
        ids = [r.id for r in self.records if r.id in self.new or r.id in self.done]
        write_record(self.output, {**self.record, "inputs": {str(i): self.digests[i] for i in ids}}, written)

    def snapshot(self) -> None:
        self._write_record(self.keep_output)
        write_lines_atomic(self.part, self.lines())

    def finish(self) -> None:
        """The output, complete; its record says so; no snapshot left."""
        self._write_record(self.keep_output)  # a kill before the output's rename leaves the earlier output
        write_lines_atomic(self.output, self.lines())
        self._write_record(True)
        self.part.unlink(missing_ok=True)


def read_done(path: str | Path, ids) -> dict[str | int, str]:
    """The predictions already in an output file: id -> its line (without the newline). DataError
    (file:line) for a line that is not an {"id", "prediction"} object, an id twice, or one not in
    `ids` (the inputs': the output would no longer match them line for line)."""
    path = Path(path)
    done: dict[str | int, str] = {}
    if not path.is_file():
        return done
    ids = set(ids)
    for lineno, raw in read_lines(path):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            what = f"{e.msg.removesuffix(' at')} at column {e.colno}"
            raise D.DataError(f"{path}:{lineno}: bad JSON in the existing output ({what})") from None
        if not isinstance(rec, dict) or "id" not in rec or "prediction" not in rec:
            raise D.DataError(f"{path}:{lineno}: not an {{\"id\", \"prediction\"}} line")
        rid = rec["id"]
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid not in ids:
            raise D.DataError(f"{path}:{lineno}: id {rid!r} is not one of the input's: the output was written for "
                              "other inputs; resume with those, or write a new --output (or --overwrite)")
        if rid in done:
            raise D.DataError(f"{path}:{lineno}: id {rid!r} twice in the existing output: which prediction to keep "
                              "is unknown; remove one, or write a new --output (or --overwrite)")
        done[rid] = raw
    return done
