#!/usr/bin/env bash
# Compile-only checks of the CUDA build, for machines without a GPU or a CUDA build of torch, so CI
# catches CUDA build errors before a GPU window does:
#   1. the CUDA sources (csrc/cuda/*.cu) with the installed nvcc for sm_80 and sm_90. They include
#      only CUDA headers and csrc/*.h.
#   2. the torch glue (csrc/cuda/*.cpp, and csrc/*.cpp as setup.py builds them with WITH_CUDA)
#      against the headers of a CUDA build of torch: TORCH_CUDA_INCLUDE names its torch/include
#      folder (`make cuda-check` fetches the one of the GPU machines' torch, GPU_TORCH_SPEC), with
#      the flags torch's CUDAExtension uses. Skipped, and said so, when TORCH_CUDA_INCLUDE is unset.
# Exits non-zero on a compile error; skips (exit 0, saying so) when nvcc is absent.
#   usage: [TORCH_CUDA_INCLUDE=dir] csrc/check_cuda_compile.sh      (NVCC=/path/to/nvcc picks the compiler)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nvcc="${NVCC:-$(command -v nvcc || true)}"
if [[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc; fi
if [[ -z "$nvcc" ]]; then
  echo "check_cuda_compile: SKIPPED, nvcc not found (set NVCC or put it on PATH)"
  exit 0
fi
# The toolkit's headers (the glue includes cuda_runtime.h): CUDA_HOME, else the toolkit the nvcc
# binary lives in (`nvcc` on PATH can be a wrapper elsewhere), else /usr/local/cuda.
cuda_include=""
for cand in "${CUDA_HOME:-}" "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" /usr/local/cuda; do
  if [[ -n "$cand" && -e "$cand/include/cuda_runtime.h" ]]; then cuda_include="$cand/include"; break; fi
done

shopt -s nullglob
out="$(mktemp -d /tmp/check_cuda_compile.XXXXXX)"
trap 'rm -rf "$out"' EXIT
echo "check_cuda_compile: $("$nvcc" --version | tail -n 1)"
status=0
for src in "$here"/cuda/*.cu; do
  name="$(basename "$src" .cu)"
  # setup.py's release flags plus the half/bfloat16 defines torch's CUDAExtension adds (which
  # forbid implicit __half conversions), host-compiler warnings on. -I csrc: the shared headers
  # (sinusoid.h, included by the .cu files and by csrc/embed.cpp).
  if "$nvcc" -c -std=c++17 -O3 -Xcompiler -Wall -I "$here" \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
      -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90 --threads 2 \
      "$src" -o "$out/$name.o"; then
    echo "check_cuda_compile: OK   $src (sm_80, sm_90)"
  else
    echo "check_cuda_compile: FAIL $src" >&2
    status=1
  fi
done

if [[ -z "${TORCH_CUDA_INCLUDE:-}" ]]; then
  echo "check_cuda_compile: torch glue SKIPPED (TORCH_CUDA_INCLUDE unset; make cuda-check sets it)"
  exit $status
fi
if [[ ! -e "$TORCH_CUDA_INCLUDE/c10/cuda/CUDAStream.h" ]]; then
  echo "check_cuda_compile: TORCH_CUDA_INCLUDE=$TORCH_CUDA_INCLUDE holds no CUDA torch headers (c10/cuda/CUDAStream.h)" >&2
  exit 1
fi
if [[ -z "$cuda_include" ]]; then
  echo "check_cuda_compile: no CUDA toolkit headers (include/cuda_runtime.h) found; set CUDA_HOME" >&2
  exit 1
fi
python_include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
cxx="${CXX:-c++}"
# What setup.py's CUDAExtension passes to the host compiler, -Werror added: a warning in the glue is
# a bug until shown otherwise. The files at once (each a compiler process), reported in order.
glue=("$here"/*.cpp "$here"/cuda/*.cpp)
pids=()
for i in "${!glue[@]}"; do
  "$cxx" -fsyntax-only -std=c++17 -O3 -Wall -Werror -fPIC -fopenmp -DWITH_CUDA \
    -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C \
    -isystem "$TORCH_CUDA_INCLUDE" -isystem "$TORCH_CUDA_INCLUDE/torch/csrc/api/include" \
    -isystem "$cuda_include" -isystem "$python_include" -I "$here" "${glue[$i]}" >"$out/glue$i.log" 2>&1 &
  pids+=($!)
done
for i in "${!glue[@]}"; do
  if wait "${pids[$i]}"; then
    echo "check_cuda_compile: OK   ${glue[$i]} (torch glue, CUDA torch headers)"
  else
    cat "$out/glue$i.log" >&2
    echo "check_cuda_compile: FAIL ${glue[$i]} (torch glue, CUDA torch headers)" >&2
    status=1
  fi
done
exit $status
