#!/usr/bin/env bash
# After a window whose recipe call ended with the run unfinished (step 50 brought back the average of
# its newest step checkpoints; scripts/gpu/collect.py joined the pieces): on the CPU, score that
# average on validation and decode the blind test inputs with it, as step 50 would have on the GPU
# (the recipe's decoding, at each of its length penalties, the best score's penalty for the test
# predictions: scripts/pick_checkpoint.py), through PyTorch's fused ops in fp32:
#   bash scripts/gpu/finish_on_cpu.sh RECIPE gpu_out/collected/50_RECIPE-averaged.pt RUN_DIR
# RUN_DIR (say runs/RECIPE-gpu, git-ignored) gets averaged.pt, args.json (the checkpoint's),
# averaged[-lpX]/metrics.validation.json, and test_predictions.jsonl. Scores already there are kept;
# the decoding of the test inputs resumes where an interrupted one stopped.
# Data: $SCRATCHFORMER_DATA, else ../shared/data. PY picks the Python (default .venv/bin/python).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
if [ $# -ne 3 ]; then echo "usage: $0 RECIPE AVERAGED.pt RUN_DIR" >&2; exit 2; fi
RECIPE=$1 AVERAGED=$2 RUN=$3
[ -f "$AVERAGED" ] || { echo "no checkpoint $AVERAGED" >&2; exit 2; }
source "$REPO/scripts/gpu/recipes.sh"
recipe "$RECIPE"
if [ ${#DECODE[@]} -eq 0 ]; then echo "recipe $RECIPE is a grid: it predicts nothing" >&2; exit 2; fi
PY=${PY:-$REPO/.venv/bin/python}
DATA=${SCRATCHFORMER_DATA:-$REPO/../shared/data}
inputs=$(compgen -G "$DATA/$DATASET/test_inputs.jsonl*" | head -1) || true
[ -n "$inputs" ] || { echo "no $DATA/$DATASET/test_inputs.jsonl(.gz|.xz)" >&2; exit 2; }
CPU=(--kernel torch --precision fp32)
mkdir -p "$RUN"
[ "$AVERAGED" -ef "$RUN/averaged.pt" ] || cp "$AVERAGED" "$RUN/averaged.pt"
"$PY" -c "import json, sys; from scratchformer.checkpoint import load_checkpoint
json.dump(load_checkpoint(sys.argv[1])['args'], open(sys.argv[2], 'w'), indent=2)" "$RUN/averaged.pt" "$RUN/args.json"
for lp in "" "${LENGTH_PENALTIES[@]}"; do
  out=$RUN/averaged${lp:+-lp$lp}
  if [ ! -e "$out/metrics.validation.json" ]; then
    "$PY" -m scratchformer.evaluate --checkpoint "$RUN/averaged.pt" --out "$out" "${DECODE[@]}" \
      ${lp:+--length-penalty "$lp"} "${SCORE[@]}" "${CPU[@]}"
  fi
done
IFS=$'\t' read -r ckpt lp <<< "$("$PY" "$REPO/scripts/pick_checkpoint.py" "$RUN")"
"$PY" -m scratchformer.generate --checkpoint "$ckpt" --input "$inputs" --output "$RUN/test_predictions.jsonl" \
  --resume --no-progress "${DECODE[@]}" ${lp:+--length-penalty "$lp"} "${CPU[@]}"
echo "== $RUN: test predictions from $(basename "$ckpt")${lp:+ at length penalty $lp}"
