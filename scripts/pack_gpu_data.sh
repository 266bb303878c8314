#!/usr/bin/env bash
# Copy the datasets a GPU run needs into .gpu_data/ (git-ignored) so the device tool can carry it:
# the GPU machine gets the checkout, not ../shared. What travels (the checkout's files, .whl,
# .gpu_build and .gpu_data) may not pass 64 MiB a call: the script ends by adding it up and fails
# above that. Pick:
#   bash scripts/pack_gpu_data.sh multi30k samsum iwslt2017_en_de   # ~7 MiB
#   rm -rf .gpu_data && bash scripts/pack_gpu_data.sh cnn_dailymail # on its own
# then run with carry [".gpu_data", ...] and SCRATCHFORMER_DATA=.gpu_data (scripts/gpu/50_train.sh).
#   cnn_dailymail    documents cut at MAX_DOC_CHARS characters (default 3000), and xz, not gzip
#                    (a third smaller; the loader reads both), or it would not fit beside the
#                    checkout (19 MiB), the wheels and the extension: gzip made it 46 MiB. Nothing
#                    the model reads is lost: 511 tokens of a 16k byte-level BPE trained on CNN/DM
#                    cover at most 2,753 characters (median 2,357) of the 321 articles over 600
#                    tokens among 500 held out from its training (measured 2026-11-23).
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
import gzip, json, lzma, pathlib, sys
src, dst, cap = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
for path in sorted(src.glob("*.jsonl.gz")):
    out = dst / path.name.replace(".jsonl.gz", ".jsonl.xz")
    with gzip.open(path, "rt", encoding="utf-8") as f, lzma.open(out, "wt", encoding="utf-8") as g:
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
# what a device call sends: the checkout's tracked and untracked-unignored files, and the carried paths
# (a Triton cache, .gpu_cache or the CNN/DailyMail window's .gpu_cache-pinned, travels too where it is
# carried: scripts/gpu/README.md); a path that is not there counts 0 (a new checkout has no .gpu_cache)
mib() { awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
size() { local there=(); for p in "$@"; do [ -e "$p" ] && there+=("$p"); done
         if [ ${#there[@]} -gt 0 ]; then find "${there[@]}" -type f -print0 | xargs -0 -r stat -c %s | mib; else echo 0.0; fi; }
# (a tracked file deleted here does not travel: left out, or stat failed the sum, silently, under pipefail)
present() { local f; while IFS= read -r -d '' f; do if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi; done; }
checkout=$(git ls-files -z -c -o --exclude-standard | present | xargs -0 -r stat -c %s -- | mib)
carried=$(size .whl .gpu_build .gpu_data)
total=$(echo "$checkout $carried" | awk '{printf "%.1f", $1 + $2}')
echo "travels: checkout $checkout MiB + .whl, .gpu_build, .gpu_data $carried MiB = $total MiB (limit 64)"
awk -v t="$total" 'BEGIN {exit !(t > 64)}' && { echo "over the device's 64 MiB: pack fewer datasets" >&2; exit 1; }
for cache_dir in .gpu_cache .gpu_cache-pinned; do
  [ -e "$cache_dir" ] || continue
  cache=$(size "$cache_dir")
  with_cache=$(echo "$total $cache" | awk '{printf "%.1f", $1 + $2}')
  echo "with $cache_dir ($cache MiB): $with_cache MiB"
  if awk -v t="$with_cache" 'BEGIN {exit !(t > 64)}'; then
    echo "with $cache_dir over the device's 64 MiB: carry it without its triton-cache.tar.gz, or a smaller" \
      "prewarm archive (scripts/gpu/README.md, the CNN/DailyMail window), or not at all"
  fi
done
exit 0
