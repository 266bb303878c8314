#!/usr/bin/env bash
# Step 21, estimate 4 min: add+LayerNorm, FFN and embedding benchmarks (autotuned GEMM), each group
# its own JSON so a time-out loses at most one group.
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
for g in add_layer_norm ffn embed; do
  run_pytest 150 20 "bench_$g" "bench/bench_$g.py" --benchmark-only ${BENCH_K:+-k "$BENCH_K"} \
    --benchmark-json="$WORK/bench_$g.json" --benchmark-columns=median,iqr
done
"$PY" bench/plot_results.py "$WORK"/bench_*.json --out "$WORK/plots" 2>&1 | tail -3 || true
