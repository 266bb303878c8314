#!/usr/bin/env bash
# Step 00, estimate 2 min with the extension carried in .gpu_build/ (make gpu-ext; building it here
# adds 1-2 min): the environment, the build, the C++/CUDA embedding op's tests (in GPU_WORKERS
# processes: torch.compile and opcheck cases) and the compile-only nvcc check of csrc/cuda.
# Its archive carries build/_C*.so: unpack it into .gpu_build/ and carry that to later calls.
PACK_EXT=1
source "$(dirname "$0")/prelude.sh"
[ "$DRY" = 1 ] || run_cmd 120 cuda_compile_check bash csrc/check_cuda_compile.sh  # make test runs it on CPUs
# Not test_torch_compile_fullgraph: Inductor's CPU code generation, which CI runs on its CPUs; on the
# GPU machine it took 62 of the step's 74 s of pytest (fifth window). Its CUDA twin stays.
WORKERS=$GPU_WORKERS run_pytest 240 10 test_embed tests/test_embed.py \
  --deselect tests/test_embed.py::test_torch_compile_fullgraph
