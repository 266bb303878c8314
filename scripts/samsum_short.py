"""The first phase of the SAMSum curriculum: a data folder whose train split keeps only the dialogues
of at most N tokens (validation is copied whole, so its figures compare with every other run).

Why: trained on all dialogues from the start, the `small` model's encoder output collapses to one
vector for every position (results/samsum-cpu-small-1600) and the decoder never learns to read it.
On short dialogues cross-attention pays early; the second phase (`train --init-from`) goes on with
every dialogue. See results/samsum-cpu-small-curriculum/README.md.

    python scripts/samsum_short.py --data ../shared/data/samsum --tokenizer TOKENIZER.json \
        --max-src-tokens 96 --out data/samsum-short96
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from scratchformer import data as D
from scratchformer.data.tokenizer import BPETokenizer


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, type=Path, help="SAMSum folder: train.jsonl.gz, validation.jsonl.gz")
    p.add_argument("--tokenizer", required=True, type=Path, help="the tokenizer.json the runs share")
    p.add_argument("--max-src-tokens", type=int, default=96)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    tok = BPETokenizer.load(a.tokenizer)
    rows = D.read_split(a.data / "train.jsonl.gz", "summarization")  # validated: a bad record names its line
    lengths = [len(ids) for ids in tok.encode_batch([e.src for e in rows])]
    kept = [{"id": e.id, "document": e.src, "summary": e.tgt}
            for e, n in zip(rows, lengths, strict=True) if n <= a.max_src_tokens]
    if not kept:
        raise SystemExit(f"error: no training dialogue has at most {a.max_src_tokens} tokens")
    a.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(a.out / "train.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
    shutil.copy(a.data / "validation.jsonl.gz", a.out / "validation.jsonl.gz")
    meta = {"task": "summarization", "note": f"SAMSum train dialogues of <= {a.max_src_tokens} tokens "
            f"({len(kept)} of {len(rows)}), tokenizer {a.tokenizer.name}; validation whole"}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"{a.out}: {len(kept)} of {len(rows)} training dialogues (<= {a.max_src_tokens} tokens)")


if __name__ == "__main__":
    main()
