#!/usr/bin/env bash
# One GPU session in one command: build the CUDA extension, run the GPU tests, the benchmarks and
# a short bf16 training smoke run; everything it measures lands in $OUT (or ./gpu_out).
# Written for the device tool's machines (H100/H200 with CUDA torch, Triton, nvcc preinstalled);
# the datasets a training run needs must travel in a git-ignored folder (e.g. .gpu_data/multi30k).
#   bash scripts/gpu_session.sh   (not yet run on a GPU: no session so far was lent one)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
stamp=$(date -u +%F)
dev=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
{
  echo "== $(date -u) $dev"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} | tee "$OUT/env.txt"

# Build in place with the machine's CUDA torch (no venv: the image's python has torch + triton).
$PY -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | tail -3
$PY -c "import torch, scratchformer._C; print('extension ok, cuda ops:', torch.ops.scratchformer.embed_sinusoidal.default)"

# Every test, now on the GPU (conftest leaves TRITON_INTERPRET unset when CUDA is present).
$PY -m pytest tests -q -x --durations=10 2>&1 | tee "$OUT/tests.txt" | tail -25

groups="bench/bench_attention.py bench/bench_add_layer_norm.py bench/bench_ffn.py bench/bench_embed.py bench/bench_train_step.py"
for g in $groups; do
  name=$(basename "$g" .py)
  $PY -m pytest "$g" --benchmark-only -q --benchmark-json "$OUT/${stamp}-${dev}-${name}.json" \
    --benchmark-columns=median,iqr 2>&1 | tail -5
done
$PY bench/plot_results.py "$OUT"/*.json --out "$OUT/plots" || true

# bf16 training smoke run on the embedded synthetic task, our kernels and the eager reference from
# the same seed: both should reach the same validation loss / exact match (their logs land in $OUT).
for k in triton eager; do
  $PY -m scratchformer.train --kernel "$k" --precision bf16 --max-steps 300 --seed 0 \
    --out "$OUT/smoke-$k" --overwrite --no-progress --no-plots 2>&1 | tail -4
  rm -f "$OUT/smoke-$k"/*.pt  # checkpoints need not travel back
done
