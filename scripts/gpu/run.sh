#!/usr/bin/env bash
# Run several steps of the plan in one device call, under one deadline:
#   bash scripts/gpu/run.sh 00 10        (step numbers; each step packs its own archive into $OUT)
# CALL_SECONDS (default 570, the device allows 600 a command) is the call's budget: every step's
# timeouts are capped to what is left of it, and a step that would start with under a minute left
# is skipped (and named), so the call ends inside its limit and every archive comes back.
# Triton's cache lives at a fixed path; the archives carried in .gpu_cache/ (tools/prewarm.py's,
# prewarm.tar.xz, and an earlier call's, triton-cache.tar.gz) are restored into it first (once per
# machine), and it goes back packed as $OUT/triton-cache.tar.gz (scripts/gpu/triton_cache.py): a
# fresh machine then loads what was compiled and tuned before instead of compiling it again.
export GPU_DEADLINE=$(( $(date +%s) + ${CALL_SECONDS:-570} ))
here=$(cd "$(dirname "$0")" && pwd)
carried=${TRITON_CACHE_CARRIED:-$here/../../.gpu_cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/scratchformer-triton-cache}
if [ ! -e "$TRITON_CACHE_DIR/.restored" ]; then
  python3 "$here/triton_cache.py" check "$carried" || echo "== a stale archive compiles again what it holds: expect compiles"
  for archive in "$carried"/*.tar.xz "$carried"/*.tar.gz; do
    [ -f "$archive" ] && python3 "$here/triton_cache.py" restore "$archive" "$TRITON_CACHE_DIR"
  done
  mkdir -p "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.restored"
fi
rc=0
for n in "$@"; do
  step=$(ls "$here/${n}"_*.sh 2>/dev/null | head -1)
  if [ -z "$step" ]; then echo "== no step $n in $here"; rc=1; continue; fi
  left=$(( GPU_DEADLINE - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "== SKIPPED $(basename "$step"): ${left}s left in this call"; rc=1; continue; fi
  bash "$step" || rc=$?
done
if [ -n "${OUT:-}" ] && [ -d "$TRITON_CACHE_DIR" ]; then
  # the device brings back 64 MiB in all: the cache gets what the steps' files leave, at most 15 MiB
  # (step 50's weights, up to 60 MiB, beside a full 15 and the archive, lost a file there, maybe a piece)
  used=$(find "$OUT" -type f -printf '%s\n' | awk '{s += $1} END {print int((s + 1048575) / 1048576)}')
  room=$(( 63 - used )); [ "$room" -gt 15 ] && room=15
  if [ "$room" -ge 1 ]; then
    python3 "$here/triton_cache.py" pack "$TRITON_CACHE_DIR" "$OUT/triton-cache.tar.gz" --max-mb "$room"
  else
    echo "== Triton cache not sent back: the steps' files take ${used} MiB of the 64 the device returns"
  fi
fi
exit "$rc"
