#!/usr/bin/env bash
# Step 10, estimate 4 min: the attention kernel's tests on the GPU, one pinned config per kernel
# (about 110 compiles: tests/test_compile_budget.py) plus the GPU-only cases.
source "$(dirname "$0")/prelude.sh"
run_pytest 480 10 test_attention tests/test_attention.py --durations=15
