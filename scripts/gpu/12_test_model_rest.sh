#!/usr/bin/env bash
# Step 12, estimate 3 min: the whole model on the triton backend against eager on the GPU, and every
# other test (data, metrics, training and command lines, DDP on gloo). Left out: the kernel tests of
# steps 10-11, the embedding op (step 00), and three CPU-only checks that a GPU run adds nothing to
# (the AOT compile check, the compile-count recorder and the CPU rehearsal of this plan).
source "$(dirname "$0")/prelude.sh"
run_pytest 420 15 test_rest tests --durations=15 \
  --ignore=tests/test_attention.py --ignore=tests/test_add_layer_norm.py --ignore=tests/test_ffn.py \
  --ignore=tests/test_embed.py --ignore=tests/test_triton_compile.py --ignore=tests/test_compile_budget.py \
  --ignore=tests/test_gpu_plan.py
