"""What an example of each task is: `Example`, the fields a record holds per task (`FIELDS`),
`check_record`, which turns a record read from any source (a file's line, a hub row) into one, and
the id its prediction is written under (`prediction_ids`, `check_unique_ids`)."""

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


def prediction_ids(examples: list[Example], split: str) -> list[str]:
    """The id each example's prediction is written under: its own, else "<split>-<i>", its place from 0."""
    return [f"{split}-{i}" if e.id is None else e.id for i, e in enumerate(examples)]


def check_unique_ids(examples: list[Example], split: str, where: str) -> None:
    """DataError naming the first id two examples share (an own id or one `prediction_ids` gives an
    example without one): their predictions would be written under one id, and could not be told apart."""
    first: dict[str, int] = {}
    for i, rid in enumerate(prediction_ids(examples, split)):
        if rid in first:
            raise DataError(f"{where}: examples {first[rid]} and {i} (counting from 0) share the id {rid!r}, so "
                            f"their predictions would be written under one id: give each example an id of its own")
        first[rid] = i
