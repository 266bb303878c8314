#!/usr/bin/env bash
# Copy the datasets a GPU run needs into .gpu_data/ (git-ignored) so the device tool can carry it:
# the GPU machine gets the checkout, not ../shared. The carry limit is 64 MiB per call, so pick:
#   bash scripts/pack_gpu_data.sh multi30k samsum iwslt2017_en_de   # ~7 MiB
#   rm -rf .gpu_data && bash scripts/pack_gpu_data.sh cnn_dailymail # ~46 MiB, on its own
# then run with carry [".gpu_data", ...] and SCRATCHFORMER_DATA=.gpu_data (scripts/gpu/50_train.sh).
#   cnn_dailymail    documents cut at MAX_DOC_CHARS characters (default 3000), or it would not fit
#                    beside the wheels and the checkout. Nothing the model reads is lost: 511 tokens
#                    of a 16k byte-level BPE trained on CNN/DM cover at most 2,753 characters (median
#                    2,357) of the 321 articles over 600 tokens among 500 held out from its training
#                    (measured 2026-11-23). 46 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${SHARED_DATA:-../shared/data}
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
mkdir -p .gpu_data
for name in "$@"; do
  rm -rf ".gpu_data/$name"
  case $name in
    cnn_dailymail)
      [ -d "$src/$name" ] || { echo "no dataset folder $src/$name" >&2; exit 1; }
      mkdir -p ".gpu_data/$name" && cp "$src/$name/meta.json" ".gpu_data/$name/"
      "$py" - "$src/$name" ".gpu_data/$name" "${MAX_DOC_CHARS:-3000}" <<'PY'
import gzip, json, pathlib, sys
src, dst, cap = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
for path in sorted(src.glob("*.jsonl.gz")):
    with gzip.open(path, "rt", encoding="utf-8") as f, gzip.open(dst / path.name, "wt", encoding="utf-8") as g:
        for line in f:
            row = json.loads(line)
            row["document"] = row["document"][:cap]
            g.write(json.dumps(row, ensure_ascii=False) + "\n")
PY
      ;;
    *)
      [ -d "$src/$name" ] || { echo "no dataset folder $src/$name" >&2; exit 1; }
      cp -r "$src/$name" ".gpu_data/$name" ;;
  esac
  chmod -R u+w ".gpu_data/$name"
done
du -sh .gpu_data
