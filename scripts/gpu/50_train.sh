#!/usr/bin/env bash
# Step 50 (issue 18; windows 4 and on), estimate 8 min a call: one training recipe (RECIPE=NAME,
# scripts/gpu/recipes.sh) with our kernels in bf16, in resumable pieces, one window of two calls a
# recipe. The run folder lives on the machine (GPU_RUNS, default /tmp/scratchformer-runs/RECIPE) and
# survives between calls while the machine is warm, so the same call, repeated, goes on where the
# last one stopped:
#   1. train: a new run, or --resume of the one there, to the end of its --time-budget (or
#      --max-steps) and its final report, or until the call's deadline less 75 s for the interpreter's
#      start, the save and step 3's average (--time-limit: a pause, last.pt saved; the fifth window's
#      run ended 15 s after its --time-limit, the average took ~5 s). The run's setup (data,
#      tokenizers, model) counts in its --time-limit since 2026-12-07 (it did not: a slow setup ran
#      into the call's end); a final report that outlasts the call ends in the call's SIGINT, on
#      which the trainer also saves: the next call goes on;
#   2. once the run is finished: the test predictions (generate --resume: a call that ends midway
#      leaves a snapshot the next one continues);
#   3. a call that ends unfinished: the average of the newest step checkpoints beside the archive, in
#      15-MiB pieces (50_RECIPE-averaged.pt.part*, joined by collect.py), a model the CPU can score
#      and predict with; a finished one: the model that writes the test predictions, likewise
#      (50_RECIPE-picked.pt.part*);
#   4. always: the run folder without checkpoints into the archive (log, metrics, curves,
#      attention, validation predictions, test predictions, a summarizer's encoder check), and
#      "RECIPE: finished" or "continue". An interim archive after step 1 and after step 2 (`interim`)
#      brings those back from a call the device kills before the exit trap's archive.
# An ablation recipe runs scratchformer.ablate the same way (a stopped grid continues), JOBS of its
# variants at once; a search recipe (an ablation with DECODE) then goes on with steps 2 and 3 on the
# grid's best variant by METRIC on validation (ablation.json's "best"), as for a single run; with
# ENSEMBLE=1 all the grid's variants, as one model (evaluate --checkpoint A B ...), are a candidate
# for the test predictions beside that variant's best.pt and average.
# Data: bash scripts/pack_gpu_data.sh DATASET, and carry .gpu_data (with .whl and .gpu_build).
source "$(dirname "$0")/prelude.sh"
source "$REPO/scripts/gpu/recipes.sh"
RECIPE=${RECIPE:?"RECIPE=NAME picks the run, one of: $RECIPES"}
recipe "$RECIPE" || exit 1
# TRAIN_EXTRA: more train flags for a new run, e.g. "--compile --compile-mode reduce-overhead" once
# window 2b's smoke has shown Inductor's CUDA graphs train as plain triton does, and faster
train_extra "${TRAIN_EXTRA:-}"
export SCRATCHFORMER_DATA=${GPU_DATA:-$REPO/.gpu_data}  # GPU_DATA: another folder (tests)
RUNS=${GPU_RUNS:-${TMPDIR:-/tmp}/scratchformer-runs}
RUN=$RUNS/$RECIPE
GRID=$RUN  # the run folder the archive takes (a grid: all of it; RUN becomes a search's best variant)
if [ "$DRY" = 1 ]; then  # CPU: a tiny model for a few steps, eager, fp32, on the same recipe's flags
  FLAGS+=(--kernel eager --precision fp32 --max-train-examples 64 --max-valid-examples 8 --max-steps 3
          --eval-every 3 --eval-decode-examples 2 --save-every 1 --no-plots --max-src-len 64)
  case " ${FLAGS[*]} " in *" --task extractive "*) ;; *) FLAGS+=(--max-tgt-len 16) ;; esac  # extractive: no target
  FLAGS+=(--d-model 32 --heads 2 --layers 1 --d-ff 64)
  VARIANTS=("${VARIANTS[@]:0:2}")
  RUNTIME=(--kernel eager --precision fp32); AVERAGE=2; LENGTH_PENALTIES=("${LENGTH_PENALTIES[@]:0:1}")
  export OMP_NUM_THREADS=1
fi
if [ -n "$DATASET" ] && [ ! -d "$SCRATCHFORMER_DATA/$DATASET" ]; then
  echo "== no data: $SCRATCHFORMER_DATA/$DATASET (bash scripts/pack_gpu_data.sh $DATASET, then carry .gpu_data)"
  exit 1
fi
mkdir -p "$RUNS"
# A run with --cuda-graphs (CUDA_GRAPHS=1) that fails (not a timeout or SIGINT: a capture CUDA refused)
# goes on launched in the same call: resumed from its last checkpoint, or anew without one (the
# checkpoints then say --no-cuda-graphs, so later calls' resumes stay launched)
launched=()
graphs_failed() {
  local rc=$1 secs
  case " ${FLAGS[*]} " in *" --cuda-graphs "*) ;; *) return "$rc" ;; esac
  # 124, 130: the time limit or SIGINT; 137: killed after them (timeout -k), e.g. mid-validation
  if [ "$rc" = 124 ] || [ "$rc" = 130 ] || [ "$rc" = 137 ] || [ ${#launched[@]} -gt 0 ] || [ ${#VARIANTS[@]} -gt 0 ]; then
    return "$rc"
  fi
  echo "== --cuda-graphs failed (exit $rc): training on launched steps"
  launched=(--no-cuda-graphs)
  secs=${TRAIN_SECONDS:-$(( $(limit 570) - (DRY ? 60 : 75) ))}
  if compgen -G "$RUN/*.pt" >/dev/null; then
    run_cmd "$(limit 570)" train_launched "$PY" -m scratchformer.train --resume --out "$RUN" --time-limit "$secs" \
      --no-progress "${launched[@]}"
  else
    run_cmd "$(limit 570)" train_launched "$PY" -m scratchformer.train "${FLAGS[@]}" "${launched[@]}" --out "$RUN" \
      --overwrite --time-limit "$secs" --no-progress
  fi
}
finished() { [ -e "$RUN/metrics.final.json" ] || [ -e "$RUN/ablation.json" ]; }
copy_run() {  # the run folder (a grid: all of it), without checkpoints, into the archive's run/
  rm -rf "$WORK/run"  # anew: a file the run removed since the last copy (a finished .partial) must not ride along
  mkdir -p "$WORK/run"
  # (nor a save's temporary, *.pt.tmp: one a killed save left would ride along in every later archive)
  (cd "$GRID" && find . \( -name '*.pt' -o -name '*.pt.tmp' \) -prune -o -type f -print | tar cf - -T - 2>/dev/null) |
    tar xf - -C "$WORK/run" 2>/dev/null
}
# interim: after each stage, the archive so far (logs, the run folder as it stands). The exit trap's
# archive replaces it; a call the device kills outright (no exit trap runs) still brings back what the
# stages before the kill made, where it brought back nothing.
interim() { copy_run; pack && echo "== interim archive: $OUT/$STEP.tar.gz"; }

# 1. train until the deadline less the start and the save (TRAIN_SECONDS overrides, for tests). RESUME_ONLY=1
#    (a follow-up call): a machine without the run (given back between the calls) starts none, it stops
if [ "${RESUME_ONLY:-0}" = 1 ] && ! finished && ! compgen -G "$RUN/*.pt" >/dev/null \
    && ! compgen -G "$RUN/*/*.pt" >/dev/null; then  # a run's checkpoints, or a grid's variants' (RUN/VARIANT/)
  echo "== RESUME_ONLY=1: no run in $RUN (a fresh machine: the last call's was given back); nothing trained"
  exit 1
fi
train_secs=${TRAIN_SECONDS:-$(( $(limit 570) - (DRY ? 60 : 75) ))}
if ! finished && [ -z "${TRAIN_SECONDS:-}" ] && [ "$train_secs" -lt 30 ]; then
  echo "== too little time left to train (${train_secs}s): call again"
elif [ ${#VARIANTS[@]} -gt 0 ] && ! finished; then
  run_cmd "$(limit 570)" train "$PY" -m scratchformer.ablate --out "$RUN" --jobs "$JOBS" ${METRIC:+--metric "$METRIC"} \
    --variants "${VARIANTS[@]}" -- "${FLAGS[@]}" --time-limit "$train_secs"
elif ! finished && compgen -G "$RUN/*.pt" >/dev/null; then
  run_cmd "$(limit 570)" train "$PY" -m scratchformer.train --resume --out "$RUN" --time-limit "$train_secs" --no-progress \
    "${launched[@]}" || graphs_failed $?
elif ! finished; then
  run_cmd "$(limit 570)" train "$PY" -m scratchformer.train "${FLAGS[@]}" --out "$RUN" \
    --time-limit "$train_secs" --no-progress || graphs_failed $?
fi

interim
# a search's best variant is the run the rest of the steps finish (the archive takes the whole grid)
if [ ${#VARIANTS[@]} -gt 0 ] && [ ${#DECODE[@]} -gt 0 ] && [ -e "$GRID/ablation.json" ]; then
  best=$("$PY" -c 'import json, sys; b = json.load(open(sys.argv[1]))["best"]; print(b) if b else sys.exit(f"{sys.argv[1]}: no variant has a score (each diverged?)")' "$GRID/ablation.json") || exit 1
  RUN=$GRID/$best
  echo "== $RECIPE: the best variant by ${METRIC:-its metric} on validation: $(basename "$RUN")"
fi

# 2. the blind test inputs, once the run is finished (a grid predicts nothing: its DECODE is empty): best.pt
#    and the average of its last AVERAGE step checkpoints are scored on validation decoded as the
#    predictions will be (DECODE), and again at each of the recipe's LENGTH_PENALTIES; the best
#    score's checkpoint writes them, at its penalty (scripts/pick_checkpoint.py)
inputs=$(compgen -G "$SCRATCHFORMER_DATA/$DATASET/test_inputs.jsonl*" | head -1)  # .gz, or .xz (cnn_dailymail)
inputs=${inputs:-$SCRATCHFORMER_DATA/$DATASET/test_inputs.jsonl.gz}
predicted() { [ ${#DECODE[@]} -eq 0 ] || [ -e "$RUN/test_predictions.jsonl" ] || [ ! -e "$inputs" ]; }
ckpts=()
pick() {  # -> ckpts, picked_lp: the checkpoint that writes the predictions (or an ensemble's members) and its
  # penalty (best.pt without scores)
  local picked
  picked=$("$PY" scripts/pick_checkpoint.py "$RUN" 2> "$WORK/pick.txt") || picked=$RUN/best.pt
  IFS=$'\t' read -r picked picked_lp <<< "$picked"
  read -r -a ckpts <<< "$picked"
}
# An ENSEMBLE recipe's candidate: the grid's finished variants as one model (each variant's average of its
# last AVERAGE step checkpoints, else its best.pt), scored as the others are, into RUN/ensemble[-lpX].
# A time-out leaves it to the next call (scored=0); any other failure leaves it out.
score_ensemble() {
  local v n lp out members=()
  for v in "$GRID"/*/metrics.final.json; do
    v=$(dirname "$v"); n=$(compgen -G "$v/step_*.pt" | wc -l)
    if [ "$n" -gt 1 ] && [ ! -e "$v/averaged.pt" ]; then
      run_cmd 120 "average_$(basename "$v")" "$PY" -m scratchformer.average "$v" --last "$(( n < AVERAGE ? n : AVERAGE ))"
    fi
    if [ -e "$v/averaged.pt" ]; then members+=("$v/averaged.pt"); else members+=("$v/best.pt"); fi
  done
  [ "${#members[@]}" -gt 1 ] || return 0
  for lp in "" "${LENGTH_PENALTIES[@]}"; do
    out=ensemble${lp:+-lp$lp}
    [ ! -e "$RUN/$out/metrics.validation.json" ] || continue
    run_cmd "$(limit 570)" "eval_$out" "$PY" -m scratchformer.evaluate --checkpoint "${members[@]}" --out "$RUN/$out" \
      --overwrite "${DECODE[@]}" ${lp:+--length-penalty "$lp"} "${SCORE[@]}" "${RUNTIME[@]}" && continue
    case $? in 124|130|137) scored=0 ;; *) echo "== the ensemble failed: not a candidate" ;; esac
    return 0
  done
}
if [ -e "$RUN/metrics.final.json" ] && ! predicted; then
  steps=$(compgen -G "$RUN/step_*.pt" | wc -l)
  last=$(( steps < AVERAGE ? steps : AVERAGE ))
  if [ "$last" -gt 1 ] && [ ! -e "$RUN/averaged.pt" ]; then
    run_cmd 120 average "$PY" -m scratchformer.average "$RUN" --last "$last"
  fi
  # one cut by the deadline leaves the rest to the next call: each started after it would get the
  # prelude's last 10 s (and timeout's 20 s grace), be cut too, and push the step toward the device's kill.
  # One that fails otherwise (out of memory, say) is left out of the candidates, in this call and the
  # next (RUN/OUT.failed): retried, it failed again at every call and the run never wrote its predictions.
  # (--overwrite: a call cut between an evaluation's predictions and its scores leaves the first)
  scored=1
  for name in best averaged; do
    for lp in "" "${LENGTH_PENALTIES[@]}"; do
      out=$name${lp:+-lp$lp}
      if [ -e "$RUN/$name.pt" ] && [ ! -e "$RUN/$out/metrics.validation.json" ] && [ ! -e "$RUN/$out.failed" ]; then
        run_cmd "$(limit 570)" "eval_$out" "$PY" -m scratchformer.evaluate --checkpoint "$RUN/$name.pt" --overwrite \
          --out "$RUN/$out" "${DECODE[@]}" ${lp:+--length-penalty "$lp"} "${SCORE[@]}" "${RUNTIME[@]}" && continue
        case $? in
          124|130|137) scored=0; break 2 ;;
          *) echo "== eval_$out failed: not a candidate (its log: eval_$out.txt)"; : > "$RUN/$out.failed" ;;
        esac
      fi
    done
  done
  if [ "$ENSEMBLE" = 1 ] && [ "$scored" = 1 ]; then
    score_ensemble
  fi
  if [ "$scored" = 1 ]; then
    pick
    cat "$WORK/pick.txt"
    run_cmd "$(limit 570)" generate "$PY" -m scratchformer.generate --checkpoint "${ckpts[@]}" --input "$inputs" \
      --output "$RUN/test_predictions.jsonl" --resume --save-every 30 --no-progress "${DECODE[@]}" \
      ${picked_lp:+--length-penalty "$picked_lp"} "${RUNTIME[@]}"
  fi
fi

interim
# a summarizer's encoder check (scripts/source_use.py, on the GPU): does the decoder read the source at
# all? A diagnostic, so after the predictions (2026-11-28: before them, on one CPU thread, it timed out
# twice on the CNN/DM base model and, with the scoring, left no time for the test predictions)
if finished && predicted && [ -e "$RUN/best.pt" ] && [ ! -e "$RUN/source_use.txt" ] \
    && ! grep -q '"task": "extractive"' "$RUN/args.json" && case $DATASET in samsum*|cnn*) true;; *) false;; esac; then
  run_cmd 60 source_use "$PY" scripts/source_use.py --checkpoint "$RUN/best.pt" --data "$SCRATCHFORMER_DATA/$DATASET" \
    -n 64 && cp "$WORK/source_use.txt" "$RUN/source_use.txt"
fi

# 3. weights the CPU can finish with, in pieces of 15 MiB beside the archive (a file comes back only
#    under 16 MiB; collect.py joins them), up to 45 MiB in fp32, else 60 in bf16, replaced at each
#    call; a grid brings none.
#    A call that leaves the training unfinished brings the average of its newest AVERAGE step
#    checkpoints (50_RECIPE-averaged.pt.part0, 1, ...: scripts/gpu/finish_on_cpu.sh scores it and
#    predicts with it); one that leaves the test predictions unfinished, the checkpoint that writes
#    them, weights only (50_RECIPE-picked.pt.part*; the archive's picked.txt names it and the decoding
#    flags it writes them with, and run/test_predictions.jsonl.partial holds what was written:
#    finish_on_cpu.sh writes the rest). The seventh window's SAMSum run was finished and its
#    predictions were not: before this, its model stayed on the machine. A finished run whose
#    predictions are whole brings that model back too, and picked.txt: the CPU can then try other
#    decodings on validation (length penalty, beam, minimum length), which the window has no time for.
ship() {  # NAME FILE: FILE (made on this machine) into the pieces, then deleted. Over 45 MiB (cnndm-ext's
  # base encoder: 103 MiB in fp32), in bf16 (52 MiB: finish_on_cpu.sh then predicts every test input anew)
  local name=$1 file=$2
  rm -f "$OUT/50_$RECIPE-"*.pt.part*
  if [ "$(stat -c %s "$file")" -gt $(( ${SHIP_FP32_MIB:-45} * 1024 * 1024 )) ]; then  # (tests: SHIP_FP32_MIB=0)
    run_cmd 60 "${name}_bf16" "$PY" -m scratchformer.average "$file" --dtype bf16 --output "$file.bf16" --overwrite \
      && mv "$file.bf16" "$file"
  fi
  if [ "$(stat -c %s "$file")" -le $(( 60 * 1024 * 1024 )) ]; then
    split -b 15M -d -a 1 "$file" "$OUT/50_$RECIPE-$name.pt.part"
  else
    echo "== $file: $(du -h "$file" | cut -f1), over the 60 MiB brought back: left on the machine"
  fi
  rm -f "$file" "$file.bf16"
}
weights=$RUNS/$RECIPE-weights.pt
if ! finished && [ ${#VARIANTS[@]} -eq 0 ] && compgen -G "$RUN/step_*.pt" >/dev/null; then
  steps=$(compgen -G "$RUN/step_*.pt" | wc -l)
  run_cmd 120 average_unfinished "$PY" -m scratchformer.average "$RUN" --last "$(( steps < AVERAGE ? steps : AVERAGE ))" \
    --output "$weights" --overwrite && ship averaged "$weights"
elif finished && [ ${#DECODE[@]} -gt 0 ]; then
  [ ${#ckpts[@]} -gt 0 ] || pick  # not picked in this call (predicted in an earlier one, or not scored)
  if [ ${#ckpts[@]} -gt 1 ]; then  # an ensemble: several models, each as large as one; none comes back
    echo "ensemble ${ckpts[*]#"$GRID/"} ${DECODE[*]} ${picked_lp:+--length-penalty $picked_lp}" > "$WORK/picked.txt"
    echo "== the test predictions' model is an ensemble of ${#ckpts[@]}: its members stay on the machine"
  else
    echo "$(basename "${ckpts[0]}") ${DECODE[*]} ${picked_lp:+--length-penalty $picked_lp}" > "$WORK/picked.txt"
    if [ "$(basename "${ckpts[0]}")" = averaged.pt ]; then  # weights only already
      cp "${ckpts[0]}" "$weights" && ship picked "$weights"
    else  # the average of one: its weights without the optimizer's state
      run_cmd 120 weights_picked "$PY" -m scratchformer.average "${ckpts[0]}" --output "$weights" --overwrite \
        && ship picked "$weights"
    fi
  fi
fi

# 4. the run folder, without checkpoints, into the archive
copy_run
if finished && predicted; then
  if [ ${#DECODE[@]} -gt 0 ] && [ ! -e "$inputs" ]; then echo "== no $inputs: no test predictions"; fi
  echo "== $RECIPE: finished"
else
  echo "== $RECIPE: not finished, call again to continue"
fi
