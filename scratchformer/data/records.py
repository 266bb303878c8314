"""What an example of each task is: `Example`, the fields a record holds per task (`FIELDS`) and
`check_record`, which turns a record read from any source (a file's line, a hub row) into one."""

from __future__ import annotations

from dataclasses import dataclass

from .files import DataError, check_text

TASKS = ("translation", "summarization", "classification", "extractive")

# File field names per task, in (source, target) order; `id` is optional for summarization.
FIELDS = {
    "translation": ("src", "tgt"),
    "summarization": ("document", "summary"),
    "classification": ("text", "label"),
    "extractive": ("document", "summary"),
}


@dataclass
class Example:
    src: str
    tgt: str | int
    id: str | None = None


def check_record(rec, task: str, where: str) -> Example:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    src_f, tgt_f = FIELDS[task]
    for f in (src_f, tgt_f):
        if f not in rec:
            have = ", ".join(sorted(map(str, rec))) or "none"
            raise DataError(f"{where}: missing field {f!r} ({task} records need {src_f!r} and {tgt_f!r}; have {have})")
        if rec[f] is None:
            raise DataError(f"{where}: field {f!r} is null ({task} records need {src_f!r} and {tgt_f!r})")
    src, tgt = check_text(rec[src_f], src_f, where), rec[tgt_f]
    if task == "classification":
        if isinstance(tgt, bool) or not isinstance(tgt, int):
            raise DataError(f"{where}: field 'label' must be an integer, got {type(tgt).__name__} {tgt!r}")
        if tgt < 0:
            raise DataError(f"{where}: field 'label' must be >= 0, got {tgt}")
    else:
        check_text(tgt, tgt_f, where)
    rid = rec.get("id")
    return Example(src, tgt, None if rid is None else str(rid))
