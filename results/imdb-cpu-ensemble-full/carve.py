"""Write IMDb's train split as a data folder whose validation split is the one `train --dataset imdb`
carves with --valid-fraction F and --seed S (`data.carve_validation`), so that runs of other seeds
train and validate on the same reviews (`--data OUT`; --seed also seeds the carve). From the
repository root:

    python results/imdb-cpu-ensemble-full/carve.py ../shared/data/imdb /work/imdb-full --fraction 0.004
    python results/imdb-cpu-ensemble-full/carve.py ../shared/data/imdb /work/imdb-s0 --fraction 0.05
"""

import argparse
import gzip
import json
import shutil
from pathlib import Path

from scratchformer.data.datasets import carve_validation
from scratchformer.data.records import Example


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("out")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with gzip.open(Path(args.source) / "train.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    examples = [Example(r["text"], r["label"], id=str(i)) for i, r in enumerate(rows)]  # id: the record's line
    train, valid = carve_validation(examples, args.fraction, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    for name, part in (("train", train), ("validation", valid)):
        with gzip.open(out / f"{name}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(rows[int(e.id)]) + "\n" for e in part)
    shutil.copy(Path(args.source) / "meta.json", out / "meta.json")
    print(f"{out}: {len(train)} train, {len(valid)} validation")


if __name__ == "__main__":
    main()
