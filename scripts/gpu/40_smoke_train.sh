#!/usr/bin/env bash
# Step 40, estimate 1 min: bf16 training smoke runs on the embedded synthetic task, our kernels and
# the eager reference from the same seed, side by side (300 steps each; pinned configs: about 20
# compiles, see tests/test_compile_budget.py). Both should reach about the same validation loss and
# exact match; their speeds, measured while sharing the GPU, are not figures (step 30 has those).
# SMOKE_KERNELS picks the runs: `triton-graphs` is our kernels under `--compile --compile-mode
# reduce-overhead` (Inductor's CUDA graphs around our ops, a graph per batch shape; its compiles
# make it a few minutes: window 2b runs it beside `triton`); `triton-cuda-graphs` is our kernels with
# `--cuda-graphs` (the trainer's own graph per batch shape, no compiler: run by default, its first run
# on a GPU; its log's last lines count the replayed steps), with `--ema` (the weights' moving average,
# folded in after each replayed step: validated, so its validation is the average's). Its lengths
# padded to multiples of 8 (the synthetic task's batches are 64 sentences, so the same batches as
# `triton`'s, in a few shapes).
source "$(dirname "$0")/prelude.sh"
declare -A FLAGS=([triton]="--kernel triton" [eager]="--kernel eager" [torch]="--kernel torch"
                  [triton-graphs]="--kernel triton --compile --compile-mode reduce-overhead"
                  [triton-cuda-graphs]="--kernel triton --cuda-graphs --pad-multiple 8 --ema 0.999")
if [ "$DRY" = 1 ]; then  # CPU: the eager backend once, 2 steps of a tiny model
  KERNELS=${SMOKE_KERNELS:-"eager"}; STEPS=2; PREC=fp32
  EXTRA=(--max-train-examples 64 --d-model 32 --heads 2 --layers 1 --d-ff 64 --eval-every 2 --max-valid-examples 4 --eval-decode-examples 2)
else
  KERNELS=${SMOKE_KERNELS:-"triton eager triton-cuda-graphs"}; STEPS=${SMOKE_STEPS:-300}; PREC=bf16; EXTRA=()
fi
pids=()
for k in $KERNELS; do
  [ -n "${FLAGS[$k]:-}" ] || { echo "== smoke: no run named $k (${!FLAGS[*]})"; STATUS=2; continue; }
  # shellcheck disable=SC2086  # FLAGS[$k] is a list of flags
  run_cmd 240 "smoke_$k" "$PY" -m scratchformer.train ${FLAGS[$k]} --precision "$PREC" --max-steps "$STEPS" \
    --seed 0 --out "$WORK/smoke-$k" --overwrite --no-progress --no-plots "${EXTRA[@]}" &
  pids+=($!)
done
for pid in "${pids[@]}"; do  # run_cmd's status stays in its subshell: take each one's exit code here
  wait "$pid" || { rc=$?; [ "$STATUS" = 0 ] && STATUS=$rc; }
done
rm -f "$WORK"/smoke-*/*.pt  # checkpoints need not travel back
# one line a run, for the call's output: its last train row (loss, tokens/s), its last validation
# and, for a --cuda-graphs run, how many steps were replayed
for k in $KERNELS; do
  log=$WORK/smoke-$k/log.txt
  [ -e "$log" ] || continue
  echo "== smoke $k: $(grep -E '^step ' "$log" | tail -1) || $(grep -E '^valid step' "$log" | tail -1)" \
       "$(grep -o 'cuda graphs: .*' "$log" | tail -1)"
done
