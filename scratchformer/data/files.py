"""Reading text files line by line: plain, gzip or xz (by the name), UTF-8, every fault a `DataError`.

`read_lines(path)` is the one reader of line-based input (the split files of `datasets`, the
inputs and outputs of batch inference): it yields ``(line number, text)`` and turns what can go
wrong with a file into a message naming it, and the line where there is one:

- a missing file, a folder, an unreadable file;
- bytes that are not UTF-8 (the line and the byte; a leading byte-order mark is dropped);
- a file named ``.gz`` (``.xz``) that is not gzip (xz), or a stream that is cut short or corrupt.

xz packs CNN/DailyMail's text a third smaller than gzip -9 (2.79 MB against 4.15 MB on 4,000
articles): what lets a dataset travel to a GPU machine under its carry limit
(scripts/pack_gpu_data.sh).
"""

from __future__ import annotations

import gzip
import json
import lzma
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path


class DataError(ValueError):
    """Malformed or missing input data; the message names the file (and line) at fault."""


def check_text(value, field: str, where: str) -> str:
    """A record's text field: a string, not blank, and encodable as UTF-8 (a JSON escape of half a
    surrogate pair, "\\ud83d" from a cut emoji, decodes to a str the tokenizer cannot take).
    DataError naming `where` (file:line) and the field otherwise."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {field!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"{where}: field {field!r} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{where}: field {field!r} holds an unpaired surrogate (\\u{ord(value[e.start]):04x} at "
                        f"character {e.start + 1}: half of a character cut in two, not text)") from None
    return value


def display_name(path: str | Path) -> str:
    return "<stdin>" if str(path) == "-" else str(path)


# a file's suffix -> (its opener, its compression's name, "not ..." in an error); any other: plain
COMPRESSED = {".gz": (gzip.open, "gzip", "a gzip file"), ".xz": (lzma.open, "xz", "an xz file")}


def uncompressed_name(name: str) -> str:
    """A file name without its compression suffix ("train.jsonl.xz" -> "train.jsonl"): what the
    file holds, whatever it is packed in."""
    suffix = Path(name).suffix
    return name[: -len(suffix)] if suffix in COMPRESSED else name


def _decode(raw: bytes, name: str, lineno: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{name}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                        "line); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    if lineno == 1 and text.startswith("\ufeff"):  # a byte-order mark some editors write
        text = text[1:]
    return text.rstrip("\r\n")


def _stdin_lines(name: str) -> Iterator[tuple[int, str]]:
    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # a text stream without bytes underneath (a StringIO in tests): already decoded
        for lineno, line in enumerate(sys.stdin, 1):
            yield lineno, line.rstrip("\r\n")
        return
    for lineno, raw in enumerate(buffer, 1):
        yield lineno, _decode(raw, name, lineno)


def read_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, the line without its line ending) for every line of a UTF-8 text file,
    gzip-compressed when its name ends in ``.gz``, xz-compressed in ``.xz``, or of stdin (``"-"``).

    Raises DataError naming the file, and the line for undecodable bytes, when the file is missing,
    a folder, unreadable, not UTF-8, not gzip (xz) though named so, or a truncated or corrupt stream.
    """
    name = display_name(path)
    if str(path) == "-":
        yield from _stdin_lines(name)
        return
    suffix = Path(path).suffix
    opener, kind, a_file = COMPRESSED.get(suffix, (open, "", ""))
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                yield lineno, _decode(raw, name, lineno)
    except FileNotFoundError:
        raise DataError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{name}: is a folder, not a file") from None
    except (gzip.BadGzipFile, zlib.error, lzma.LZMAError) as e:
        if lineno == 0 and (str(e).startswith("Not a gzipped file") or "format not supported" in str(e)):
            raise DataError(f"{name}: not {a_file}, though named {suffix} (no {kind} header); "
                            f"rename a plain text file without {suffix}") from None
        raise DataError(f"{name}: corrupt {kind} data after {lineno} complete line(s) ({e}); copy or download "
                        "the file again") from None
    except EOFError:
        raise DataError(f"{name}: the {kind} stream is cut short after {lineno} complete line(s) (a truncated "
                        "file: copy or download it again)") from None
    except OSError as e:  # permission denied, an I/O error
        raise DataError(f"{name}: cannot read ({e.strerror or e})") from None


def read_json_lines(path: str | Path) -> Iterator[tuple[int, object]]:
    """(1-based line number, its JSON value) for every line of a JSON-lines file that is not blank,
    read as `read_lines` reads; DataError names the file and line of bad JSON."""
    name = display_name(path)
    for lineno, line in read_lines(path):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{name}:{lineno}: bad JSON ({e.msg} at column {e.colno})") from None


def read_json(path: str | Path) -> dict:
    """A JSON object from a UTF-8 file (a folder's meta.json), read as the split files are (`read_lines`: a
    leading byte-order mark is dropped, bytes that are not UTF-8 named by line); DataError names the file
    and the fault."""
    text = "\n".join(line for _, line in read_lines(path))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj
