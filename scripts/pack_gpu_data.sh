#!/usr/bin/env bash
# Copy the datasets a GPU run needs into .gpu_data/ (git-ignored) so the device tool can carry it:
# the GPU machine gets the checkout, not ../shared. The carry limit is 64 MiB per call, so pick:
#   bash scripts/pack_gpu_data.sh multi30k samsum imdb        # ~19 MiB
#   bash scripts/pack_gpu_data.sh cnn_dailymail               # ~60 MiB on its own
# then run with carry [".gpu_data"] and --data .gpu_data/<name>.
set -euo pipefail
cd "$(dirname "$0")/.."
src=${SHARED_DATA:-../shared/data}
mkdir -p .gpu_data
for name in "$@"; do
  [ -d "$src/$name" ] || { echo "no dataset folder $src/$name" >&2; exit 1; }
  rm -rf ".gpu_data/$name"
  cp -r "$src/$name" ".gpu_data/$name"
  chmod -R u+w ".gpu_data/$name"
done
du -sh .gpu_data
