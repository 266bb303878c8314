"""The first phase of the SAMSum curriculum: a data folder whose train split keeps only the dialogues
of at most N tokens (validation is copied whole, so its figures compare with every other run).

Why: trained on all dialogues from the start, the `small` model's encoder output collapses to one
vector for every position (results/samsum-cpu-small-1600) and the decoder never learns to read it.
On short dialogues cross-attention pays early; the second phase (`train --init-from`) goes on with
every dialogue. See results/samsum-cpu-small-curriculum/README.md.

    python scripts/samsum_short.py --data ../shared/data/samsum --tokenizer TOKENIZER.json \
        --max-src-tokens 96 --out data/samsum-short96

--out must be another folder than --data; one that already holds a data folder's files is refused
unless --overwrite (which replaces the three files written here, each atomically). A user error is
one `error:` line and exit status 2 (`scratchformer.cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from scratchformer import cli
from scratchformer import data as D
from scratchformer.checkpoint import file_in_the_way, write_lines_atomic
from scratchformer.data.tokenizer import BPETokenizer

INPUTS = ("train.jsonl.gz", "validation.jsonl.gz")  # read from --data
OUTPUTS = (*INPUTS, "meta.json")  # written to --out


def check_paths(a: argparse.Namespace) -> None:
    """Refuse, before anything is read or written, an --out that would replace an input (the --data
    folder itself, or a file of it or the tokenizer under another name) or a data folder's files
    already there (without --overwrite), and a --data without the two splits."""
    if (above := file_in_the_way(a.out)) is not None:
        raise cli.UsageError(f"--out {a.out}: {above} is a file, not a folder")
    if a.out.resolve() == a.data.resolve():
        raise cli.UsageError(f"--out {a.out} is the --data folder: its train split would be replaced by the short "
                             "dialogues; give another folder")
    inputs = [a.data / name for name in INPUTS]
    for path in inputs:
        if not path.is_file():
            raise D.DataError(f"--data {a.data}: no {path.name} (a SAMSum folder holds {' and '.join(INPUTS)})")
    for out in (a.out / name for name in OUTPUTS if (a.out / name).exists()):
        same = next((p for p in (*inputs, a.tokenizer) if p.exists() and os.path.samefile(out, p)), None)
        if same is not None:
            raise cli.UsageError(f"--out {a.out}: {out} is the input {same}: writing it would replace the input; "
                                 "give another folder")
    names = [f"{split}{ext}" for split in ("train", "validation") for ext in D.EXTENSIONS] + ["meta.json"]
    held = [name for name in names if (a.out / name).exists()]
    if held and not a.overwrite:
        raise cli.UsageError(f"--out {a.out} already holds {', '.join(held)}: pass --overwrite to replace them, "
                             "or give another folder")
    if others := [name for name in held if name not in OUTPUTS]:  # a second file of a split: the folder unreadable
        raise cli.UsageError(f"--out {a.out} holds {', '.join(others)}, which --overwrite would not replace (this "
                             f"script writes {', '.join(OUTPUTS)}): remove it or give another folder")


def copy_atomic(src: Path, dst: Path) -> None:
    """`src` to `dst` through a temp file beside it: a cut copy leaves the previous `dst` whole."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=Path, help="SAMSum folder: train.jsonl.gz, validation.jsonl.gz")
    p.add_argument("--tokenizer", required=True, type=Path, help="the tokenizer.json the runs share")
    p.add_argument("--max-src-tokens", type=int, default=96)
    p.add_argument("--out", required=True, type=Path, help="the new data folder (not --data)")
    p.add_argument("--overwrite", action="store_true", help=f"replace {', '.join(OUTPUTS)} already in --out")
    cli.add_debug_flag(p)
    a = p.parse_args(argv)
    if a.max_src_tokens < 1:
        raise cli.UsageError(f"--max-src-tokens must be >= 1, got {a.max_src_tokens}")
    check_paths(a)
    tok = BPETokenizer.load(a.tokenizer)
    rows = D.read_split(a.data / "train.jsonl.gz", "summarization")  # validated: a bad record names its line
    lengths = [len(ids) for ids in tok.encode_batch([e.src for e in rows])]
    kept = [{"id": e.id, "document": e.src, "summary": e.tgt}
            for e, n in zip(rows, lengths, strict=True) if n <= a.max_src_tokens]
    if not kept:
        raise D.DataError(f"{a.data}: no training dialogue has at most {a.max_src_tokens} tokens")
    a.out.mkdir(parents=True, exist_ok=True)
    write_lines_atomic(a.out / "train.jsonl.gz", [json.dumps(r, ensure_ascii=False) for r in kept])
    copy_atomic(a.data / "validation.jsonl.gz", a.out / "validation.jsonl.gz")
    meta = {"task": "summarization", "note": f"SAMSum train dialogues of <= {a.max_src_tokens} tokens "
            f"({len(kept)} of {len(rows)}), tokenizer {a.tokenizer.name}; validation whole"}
    write_lines_atomic(a.out / "meta.json", json.dumps(meta, indent=1).splitlines())
    print(f"{a.out}: {len(kept)} of {len(rows)} training dialogues (<= {a.max_src_tokens} tokens)")


if __name__ == "__main__":
    sys.exit(cli.run(main))
