#!/usr/bin/env bash
# Before a window's first device call, on the CPU machine (free: the device's clock starts at the
# first `run`): is what the calls carry there and made from this checkout? Exits 1 naming each part
# missing or stale, which `make gpu-ready` makes again. A stale part costs device time: the prelude
# builds the extension again (1-2 min), and each kernel a stale Triton archive held compiles again
# (1-3 s each, serially inside a training step). 2026-12-05: the pinned prewarm was found stale at
# a session's start, a kernel file having changed after it was packed; nothing had said so.
#   bash scripts/gpu/ready.sh            (make gpu-check)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
py=python3; [ -x .venv/bin/python ] && py=.venv/bin/python
bad=0
if [ ! -e .gpu_build/sources.sha256 ]; then
  echo "missing: .gpu_build (the extension for the GPU stack: make gpu-ext)"; bad=1
elif [ "$(cat .gpu_build/sources.sha256)" != "$(bash "$here/ext_sources.sh")" ]; then
  echo "stale: .gpu_build, built from other sources than csrc/ and setup.py now (make gpu-ext)"; bad=1
else
  echo "current: .gpu_build"
fi
if compgen -G ".whl/rouge_score-*.whl" >/dev/null; then echo "current: .whl"
else echo "missing: .whl/rouge_score-*.whl (make wheels)"; bad=1; fi
caches=0
for dir in .gpu_cache .gpu_cache-pinned; do
  [ -d "$dir" ] || continue
  caches=1
  "$py" "$here/triton_cache.py" check "$dir" || bad=1
done
[ "$caches" = 1 ] || { echo "missing: .gpu_cache and .gpu_cache-pinned (Triton's prewarm: make gpu-prewarm)"; bad=1; }
datasets=$(ls .gpu_data 2>/dev/null | tr '\n' ' ')
if [ -n "$datasets" ]; then echo "packed: .gpu_data/ $datasets"
else echo "missing: .gpu_data (scripts/pack_gpu_data.sh DATASET)"; bad=1; fi
[ "$bad" = 0 ] && echo "== ready: carry .whl .gpu_build .gpu_data and the Triton cache folder" ||
  echo "== not ready: make gpu-ready (scripts/gpu/README.md) remakes what is named above"
exit "$bad"
