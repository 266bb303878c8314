#!/usr/bin/env bash
# Step 20, estimate 5 min: attention benchmarks, autotuned (each new shape benchmarks every config:
# about 30 compiles a shape), so a subset by default: BENCH_K picks another (pytest -k).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
K=${BENCH_K:-"(dense and h16d64 and (1024 or 4096)) or (padded and 512-64) or (memory and 4096)"}
run_pytest 420 20 bench_attention bench/bench_attention.py --benchmark-only -k "$K" \
  --benchmark-json="$WORK/bench_attention.json" --benchmark-columns=median,iqr
