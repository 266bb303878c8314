#!/usr/bin/env bash
# Step 00, estimate 3 min (extension build 1-2 min, CUDA op tests < 1 min): the environment, the
# build, the C++/CUDA embedding op's tests and the compile-only nvcc check of csrc/cuda.
# Its archive carries build/_C*.so: unpack it into .gpu_build/ and carry that to later calls.
PACK_EXT=1
source "$(dirname "$0")/prelude.sh"
[ "$DRY" = 1 ] || run_cmd 120 cuda_compile_check bash csrc/check_cuda_compile.sh  # make test runs it on CPUs
run_pytest 240 10 test_embed tests/test_embed.py
