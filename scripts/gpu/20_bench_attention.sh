#!/usr/bin/env bash
# Step 20, estimate 3 min (144 s on an H100 for the default subset): attention benchmarks, autotuned
# (each new shape tries every pruned config: a few dozen compiles a shape, compiled side by side
# first by warm_bench), so a subset by default: BENCH_K picks another (pytest -k).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
# default: L = 4k, both head dims, full and causal, against every peer (SDPA's flash, cuDNN and
# memory-efficient backends by name, SDPA with a mask, eager), and the padded batch at 4k: issue 16's
# targets in one call; the L sweep (512 to 8k) goes in a later window with BENCH_K.
K=${BENCH_K:-"(dense and 4096) or (padded and 4096 and h16d64) or (memory and 4096)"}
warm_bench 120 warm_attention "$K" bench/bench_attention.py
run_pytest 300 20 bench_attention bench/bench_attention.py --benchmark-only -k "$K" \
  --benchmark-json="$WORK/bench_attention.json" --benchmark-columns=median,iqr
run_targets  # issue 16/17 ratios over the JSON that hold something (none in a dry run: nothing timed)
