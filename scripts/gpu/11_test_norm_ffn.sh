#!/usr/bin/env bash
# Step 11, estimate 3 min: add+LayerNorm, the GEMM and the FFN kernels' tests on the GPU (about
# 140 compiles, pinned configs) plus the GPU-only cases.
source "$(dirname "$0")/prelude.sh"
run_pytest 420 10 test_norm_ffn tests/test_add_layer_norm.py tests/test_ffn.py --durations=15
