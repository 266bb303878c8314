"""What `generate --output F --resume` keeps of an earlier F: its lines (`read_done`), and only
those of the same model and decoding, as the record beside it says (`record_path`, ``F.meta.json``).

The record (`write_record`) holds the checkpoint (its path(s), for messages, and its weights'
SHA-256, `checkpoint.weights_digest`, which names the model in whatever file: a copy, or the
average of one checkpoint that `scripts/gpu/50_train.sh` ships), the options that change a
prediction (`predict.RECORDED`: beam, penalties, lengths, the input field; not the precision, the
kernel or the batching: a GPU's bf16 snapshot is finished on a CPU in fp32), and whether F itself
was written with them ("output": a cut --overwrite run leaves the F it was replacing, whose lines
are not kept). `check_resume` refuses another model or other options before any work;
`start_output` does what a run does first.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .. import data as D
from ..checkpoint import write_lines_atomic
from ..cli import shown
from ..data.files import read_lines
from .options import OptionError

log = logging.getLogger(__name__)


def record_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.name + ".meta.json")


def write_record(output: Path, record: dict, written: bool) -> None:
    """The record beside `output`, atomically; `written`: `output` holds this run's predictions."""
    write_lines_atomic(record_path(output), [json.dumps({**record, "output": written}, indent=2)])


def _named(checkpoint) -> str:
    return " + ".join(c["path"] for c in checkpoint) if isinstance(checkpoint, list) else str(checkpoint)


def check_resume(output: Path, part: Path, record: dict) -> bool:
    """Whether `output`'s lines are kept (those of `part`, its snapshot, always are), or OptionError
    when the record beside them names other weights or options. An output without a record (written
    before records were kept) is kept unchecked, with a warning."""
    found = [p for p in (output, part) if p.exists()]
    path = record_path(output)
    if not found:
        return False
    if not path.exists():
        log.warning(f"{found[0]} has no record of the checkpoint and options it was written with ({path.name}; "
                    "written by an older version): its predictions are kept unchecked")
        return True
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        old_options, old_weights = dict(old["options"]), old["weights"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise D.DataError(f"{path}: not a record of generate's ({type(e).__name__}: {e}); it says what wrote "
                          f"{found[0]}: without it, write a new --output (or --overwrite)") from None
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
    return bool(old.get("output"))


def start_output(output: Path, part: Path, record: dict, ids, resume: bool, overwrite: bool) -> dict[str | int, str]:
    """The lines kept of an earlier output and its snapshot (`resume`: `check_resume`, `read_done`),
    id -> line; the record written beside the output before any new line (a snapshot's lines are its)."""
    keep_output = resume and check_resume(output, part, record)
    done: dict[str | int, str] = {}
    if resume:
        done = {**read_done(part, ids), **(read_done(output, ids) if keep_output else {})}
    if overwrite:  # the snapshot of a run it replaces, which a --resume after a cut would keep
        part.unlink(missing_ok=True)
    write_record(output, record, keep_output)
    return done


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
