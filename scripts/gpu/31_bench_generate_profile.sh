#!/usr/bin/env bash
# Step 31, estimate 4 min (issue 17; right after step 30, on the same machine): one profiled
# training step per backend at base/CNN-DM and small/Multi30k (bench/profile_train_step.py: GPU
# time by category, top kernels, host-device syncs a step; 24 s for base/CNN-DM with pinned tiles
# on an H100), then KV-cached greedy and beam-4 generation per backend, autotuned (our two cases
# compiled first, side by side: 55 s for triton-greedy on an H100; the timed run of all 6 took 84 s
# with pinned tiles, when there were 6: now 18, launched and graph-replayed with bf16 weights and
# graph-replayed with fp32 weights under autocast, each timed over 3 rounds after 1 warm-up call:
# 72 decoding calls, where 12 cases of 5 after 2 made 84). The profiles' triton part reuses what
# step 30 compiled and the configs its timed run tuned (TRITON_CACHE_AUTOTUNING); on a fresh
# machine it compiles and tunes first (about 2 min at base/CNN-DM) and is cut. Each profile's log
# is profile_log-<shape>.txt: the report itself, profile-<shape>.txt, exists only when the profile
# finished (collect.py files no other).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
WARM_MAX=2
source "$(dirname "$0")/prelude.sh"
if [ "$DRY" = 1 ]; then  # CPU: the report's code path on one small step of the eager backend, no warm-up
  run_cmd 120 profile_log-small-multi30k "$PY" bench/profile_train_step.py --shape small-multi30k --kernels eager \
    --steps 1 --warmup 0 --device cpu --out "$WORK/profile-small-multi30k.txt"
else
  for shape in base-cnndm small-multi30k; do
    run_cmd 75 "profile_log-$shape" "$PY" bench/profile_train_step.py --shape "$shape" --out "$WORK/profile-$shape.txt"
  done
fi
warm_bench 90 warm_generate "" bench/bench_generate.py
run_pytest 180 6 bench_generate bench/bench_generate.py --benchmark-only \
  --benchmark-json="$WORK/bench_generate.json" --benchmark-columns=median,iqr
# host time per op call and per step, per backend (bench/host_overhead.py: tiny shapes, one pinned
# config per kernel, about 30 s of compiling); last, so a short call loses only this
if [ "$DRY" = 1 ]; then  # CPU: the step's command and report on triton's row (launches stubbed, 7 s; with eager's
  # and torch's, 27 s: tests/test_bench_host_overhead.py runs the tool on every backend on this path)
  TRITON_INTERPRET=1 run_cmd 120 host_overhead_log "$PY" bench/host_overhead.py --device cpu --calls 5 --kernels triton \
    --out "$WORK/host_overhead.txt"
else
  SCRATCHFORMER_AUTOTUNE=0 run_cmd 75 host_overhead_log "$PY" bench/host_overhead.py --out "$WORK/host_overhead.txt"
fi
run_targets  # bench/targets.py has no generation targets yet: it says so (collect.py's table joins step 30's)
