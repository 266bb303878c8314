#!/usr/bin/env bash
# Step 32, estimate 5 min (issue 17; best right after step 30, on the machine it warmed): the same
# 15 training-step cases, each backend's step captured once as a CUDA graph and replayed
# (bench_train_step.py test_train_step_graph): the device's time with no host work per kernel,
# beside step 30's launched steps, which the host's side paced on an H100. Its compiling cases
# (ours, torch.compile's) go first in one wave, a process each; after step 30 they find Triton's,
# Inductor's and the autotuner's on-disk caches filled. Same JSON name as step 30's: collect.py
# files both into the e2e file, the cases told apart by name. Then the issue-17 targets (the graph
# rows against each other).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
WARM_MAX=9
source "$(dirname "$0")/prelude.sh"
K="test_train_step_graph${BENCH_K:+ and ($BENCH_K)}"
warm_bench 150 warm_train_step_graph "$K" bench/bench_train_step.py
run_pytest 180 10 bench_train_step bench/bench_train_step.py --benchmark-only -k "$K" \
  --benchmark-json="$WORK/bench_train_step.json" --benchmark-columns=median,iqr
run_targets  # issue 17's training-step ratios, launched and graphed (none in a dry run: nothing timed)
