#!/usr/bin/env bash
# Step 30, estimate 5 min (issue 17; the second window): the end-to-end training step (forward,
# backward, AdamW; bf16) per backend at the base/CNN-DM, small/SAMSum and small/Multi30k shapes,
# autotuned (our kernels and torch.compile's variants are compiled side by side first: each case
# alone costs a minute or more of compiling); KV-cached greedy and beam-4 generation per backend;
# then one profiled step per backend (bench/profile_train_step.py: where the GPU time goes, syncs).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
warm_bench 150 warm_train_generate "${BENCH_K:-}" bench/bench_train_step.py bench/bench_generate.py
run_pytest 270 10 bench_train_step bench/bench_train_step.py --benchmark-only ${BENCH_K:+-k "$BENCH_K"} \
  --benchmark-json="$WORK/bench_train_step.json" --benchmark-columns=median,iqr
run_pytest 120 6 bench_generate bench/bench_generate.py --benchmark-only \
  --benchmark-json="$WORK/bench_generate.json" --benchmark-columns=median,iqr
if [ "$DRY" = 1 ]; then  # CPU: the report's code path on one small step of the eager backend, no warm-up
  run_cmd 120 profile "$PY" bench/profile_train_step.py --shape small-multi30k --kernels eager --steps 1 --warmup 0 \
    --device cpu
else
  for shape in base-cnndm small-multi30k; do
    run_cmd 90 "profile-$shape" "$PY" bench/profile_train_step.py --shape "$shape" --out "$WORK/profile-$shape.txt"
  done
fi
if compgen -G "$WORK/bench_*.json" >/dev/null; then  # issue 16/17 ratios (none in a dry run: nothing timed)
  run_cmd 60 targets "$PY" bench/targets.py "$WORK"/bench_*.json --out "$WORK/targets.md"
fi
