#!/usr/bin/env bash
# After a window whose recipe call ended before the test predictions were whole (step 50 brought back
# weights in pieces; scripts/gpu/collect.py joined them and unpacked the call's archive beside them),
# on the CPU, through PyTorch's fused ops in fp32:
#   bash scripts/gpu/finish_on_cpu.sh RECIPE gpu_out/collected/50_RECIPE-averaged.pt RUN_DIR
#   bash scripts/gpu/finish_on_cpu.sh RECIPE gpu_out/collected/50_RECIPE-picked.pt RUN_DIR
# - averaged (the training was unfinished): score that average on validation and decode the blind
#   test inputs with it, as step 50 would have on the GPU (the recipe's decoding, at each of its
#   length penalties, the best score's penalty for the test predictions: scripts/pick_checkpoint.py).
#   RUN_DIR (say runs/RECIPE-gpu, git-ignored) gets averaged.pt, args.json (the checkpoint's),
#   averaged[-lpX]/metrics.validation.json, and test_predictions.jsonl. Scores already there are kept.
# - picked (the training finished and was scored on the GPU, its predictions cut): nothing is scored
#   again; the predictions go on from the GPU's snapshot (the archive's run/test_predictions.jsonl.partial,
#   a search's run/<its best variant>/test_predictions.jsonl.partial,
#   in collect.py's 50_train/ beside the weights) with the flags the GPU decoded with (its picked.txt).
#   RUN_DIR gets picked.pt, args.json and test_predictions.jsonl.
# Either way the decoding of the test inputs resumes where an interrupted one stopped.
# Data: $SCRATCHFORMER_DATA, else ../shared/data. PY picks the Python (default .venv/bin/python).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
if [ $# -ne 3 ]; then echo "usage: $0 RECIPE AVERAGED.pt|PICKED.pt RUN_DIR" >&2; exit 2; fi
RECIPE=$1 WEIGHTS=$2 RUN=$3
[ -f "$WEIGHTS" ] || { echo "no checkpoint $WEIGHTS" >&2; exit 2; }
source "$REPO/scripts/gpu/recipes.sh"
recipe "$RECIPE"
if [ ${#DECODE[@]} -eq 0 ]; then echo "recipe $RECIPE is a grid: it predicts nothing" >&2; exit 2; fi
PY=${PY:-$REPO/.venv/bin/python}
DATA=${SCRATCHFORMER_DATA:-$REPO/../shared/data}
inputs=$(compgen -G "$DATA/$DATASET/test_inputs.jsonl*" | head -1) || true
[ -n "$inputs" ] || { echo "no $DATA/$DATASET/test_inputs.jsonl(.gz|.xz)" >&2; exit 2; }
CPU=(--kernel torch --precision fp32)
mkdir -p "$RUN"
case $(basename "$WEIGHTS") in
  *-averaged.pt) kind=averaged ;;
  *-picked.pt) kind=picked ;;
  *) echo "$WEIGHTS: not step 50's weights (50_RECIPE-averaged.pt or 50_RECIPE-picked.pt, from collect.py)" >&2; exit 2 ;;
esac
[ "$WEIGHTS" -ef "$RUN/$kind.pt" ] || cp "$WEIGHTS" "$RUN/$kind.pt"
"$PY" -c "import json, sys; from scratchformer.checkpoint import load_checkpoint
json.dump(load_checkpoint(sys.argv[1])['args'], open(sys.argv[2], 'w'), indent=2)" "$RUN/$kind.pt" "$RUN/args.json"
if [ "$kind" = picked ]; then
  # the last call's archive that names its picked model: collect.py unpacks a step's later calls into
  # 50_train.2, 50_train.3, ... and joins their weights in that order, so the last one's are these
  folder=$(dirname "$WEIGHTS"); archive=$folder/50_train; i=2
  while [ -d "$folder/50_train.$i" ]; do
    [ -f "$folder/50_train.$i/picked.txt" ] && archive=$folder/50_train.$i
    i=$((i + 1))
  done
  [ -f "$archive/picked.txt" ] || { echo "no $archive/picked.txt: run scripts/gpu/collect.py on the call's folder" >&2; exit 2; }
  read -r name flags < "$archive/picked.txt"
  read -ra flags <<< "$flags"
  snapshot=$archive/run/test_predictions.jsonl.partial
  if [ -f "$archive/run/ablation.json" ]; then  # a search's archive holds its grid: its best variant predicted
    best=$("$PY" -c 'import json, sys; b = json.load(open(sys.argv[1]))["best"]; print(b) if b else sys.exit(f"{sys.argv[1]}: no variant has a score (each diverged?)")' "$archive/run/ablation.json")
    snapshot=$archive/run/$best/test_predictions.jsonl.partial
  fi
  # weights shipped in bf16 (over 45 MiB in fp32: 50_train.sh's ship) are not the GPU's: all predicted here
  halved=$("$PY" -c "import sys, torch; from scratchformer.checkpoint import load_checkpoint
print(int(any(v.dtype == torch.bfloat16 for v in load_checkpoint(sys.argv[1])['model'].values())))" "$RUN/picked.pt")
  [ "$halved" = 0 ] || echo "== picked.pt came back in bf16: the test inputs are all decoded here, none from the GPU"
  if [ "$halved" = 0 ] && [ -f "$snapshot" ] && [ ! -e "$RUN/test_predictions.jsonl" ] \
      && [ ! -e "$RUN/test_predictions.jsonl.partial" ]; then
    cp "$snapshot" "$RUN/test_predictions.jsonl.partial"
    # and what wrote it (generate's record: the weights and the decoding), which --resume checks
    record=${snapshot%.partial}.meta.json
    [ ! -f "$record" ] || cp "$record" "$RUN/test_predictions.jsonl.meta.json"
  fi
  "$PY" -m scratchformer.generate --checkpoint "$RUN/picked.pt" --input "$inputs" --output "$RUN/test_predictions.jsonl" \
    --resume --no-progress "${flags[@]}" "${CPU[@]}"
  # bf16 weights: the GPU's snapshot was not taken (it counted here all the same)
  from_gpu=$([ "$halved" = 0 ] && wc -l < "$snapshot" 2>/dev/null || echo 0)
  echo "== $RUN: test predictions from $name (picked.pt), $from_gpu of them decoded on the GPU"
  exit 0
fi
for lp in "" "${LENGTH_PENALTIES[@]}"; do
  out=$RUN/averaged${lp:+-lp$lp}
  if [ ! -e "$out/metrics.validation.json" ]; then
    "$PY" -m scratchformer.evaluate --checkpoint "$RUN/averaged.pt" --out "$out" --overwrite "${DECODE[@]}" \
      ${lp:+--length-penalty "$lp"} "${SCORE[@]}" "${CPU[@]}"
  fi
done
# (a refusal, one error line and status 2, ends this script here: inside the here-string it did not)
picked=$("$PY" "$REPO/scripts/pick_checkpoint.py" "$RUN")
IFS=$'\t' read -r ckpt lp <<< "$picked"
"$PY" -m scratchformer.generate --checkpoint "$ckpt" --input "$inputs" --output "$RUN/test_predictions.jsonl" \
  --resume --no-progress "${DECODE[@]}" ${lp:+--length-penalty "$lp"} "${CPU[@]}"
echo "== $RUN: test predictions from $(basename "$ckpt")${lp:+ at length penalty $lp}"
