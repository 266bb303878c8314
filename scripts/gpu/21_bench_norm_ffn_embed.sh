#!/usr/bin/env bash
# Step 21, estimate 4 min (144 s on an H100 before the loss's group, which adds about a minute): add+LayerNorm, FFN, embedding and
# the fused generator + loss (cross_entropy, new 2026-11-29, not yet run) benchmarks (autotuned GEMM),
# each group its own JSON so a time-out loses at most one group. torch.compile's peers
# compile afresh per case (10-20 s each; warm_bench compiles them side by side first), so by default
# they run at the issue-16 headline shapes only (65k rows; the base FFN at 16k tokens and 8192 x
# 4096 x 4096; 256k bf16 tokens; the loss at the base preset's CNN/DailyMail shape); BENCH_K (pytest -k, every group) picks another subset, and
# BENCH_GROUPS (default: all four) the groups, e.g. BENCH_GROUPS=add_layer_norm after a change to
# that kernel alone (about a minute).
export SCRATCHFORMER_AUTOTUNE=${SCRATCHFORMER_AUTOTUNE:-1}
source "$(dirname "$0")/prelude.sh"
declare -A SUBSET=([add_layer_norm]="not compile or 65536" [ffn]="not compile or t16384-d512 or t8192" [embed]="not compile or (bfloat16 and N262144)"
                  [cross_entropy]="not compile or t2048")
read -ra groups <<< "${BENCH_GROUPS:-add_layer_norm ffn embed cross_entropy}"
for g in "${groups[@]}"; do
  [ -n "${SUBSET[$g]+set}" ] || { echo "BENCH_GROUPS: no group '$g' (one of: ${!SUBSET[*]})" >&2; exit 2; }
done
files=(); warm_k=""  # one compile pass for the groups' files, each within its own subset
for g in "${groups[@]}"; do
  files+=("bench/bench_$g.py"); warm_k+="${warm_k:+ or }(bench_$g and (${BENCH_K:-${SUBSET[$g]}}))"
done
warm_bench 120 warm_norm_ffn_embed "$warm_k" "${files[@]}"
for g in "${groups[@]}"; do
  k=${BENCH_K:-${SUBSET[$g]}}
  run_pytest 150 20 "bench_$g" "bench/bench_$g.py" --benchmark-only ${k:+-k "$k"} \
    --benchmark-json="$WORK/bench_$g.json" --benchmark-columns=median,iqr
done
saved_json
if [ "${#SAVED[@]}" != 0 ]; then "$PY" bench/plot_results.py "${SAVED[@]}" --out "$WORK/plots" 2>&1 | tail -3; fi
run_targets  # issue 16/17 ratios over the JSON that hold something (none in a dry run: nothing timed)
