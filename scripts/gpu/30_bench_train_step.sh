#!/usr/bin/env bash
# Step 30, estimate 3 min: the end-to-end training step (forward, backward, AdamW; bf16) per backend
# at the issue-7 shapes, autotuned; torch.compile's variant costs about a minute of compiling.
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
run_pytest 330 10 bench_train_step bench/bench_train_step.py --benchmark-only ${BENCH_K:+-k "$BENCH_K"} \
  --benchmark-json="$WORK/bench_train_step.json" --benchmark-columns=median,iqr
