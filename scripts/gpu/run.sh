#!/usr/bin/env bash
# Run several steps of the plan in one device call, under one deadline:
#   bash scripts/gpu/run.sh 00 10        (step numbers; each step packs its own archive into $OUT)
# CALL_SECONDS (default 570, the device allows 600 a command) is the call's budget: every step's
# timeouts are capped to what is left of it, and a step that would start with under a minute left
# is skipped (and named), so the call ends inside its limit and every archive comes back.
export GPU_DEADLINE=$(( $(date +%s) + ${CALL_SECONDS:-570} ))
here=$(cd "$(dirname "$0")" && pwd)
rc=0
for n in "$@"; do
  step=$(ls "$here/${n}"_*.sh 2>/dev/null | head -1)
  if [ -z "$step" ]; then echo "== no step $n in $here"; rc=1; continue; fi
  left=$(( GPU_DEADLINE - $(date +%s) ))
  if [ "$left" -lt 60 ]; then echo "== SKIPPED $(basename "$step"): ${left}s left in this call"; rc=1; continue; fi
  bash "$step" || rc=$?
done
exit "$rc"
