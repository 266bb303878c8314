// Limits of the CUDA launches of csrc/cuda/embed_kernels.cu, shared with the torch glue
// (embed_cuda.cpp), which refuses what the launches cannot cover, naming it, before any launch.
#pragma once

#include <cstdint>

namespace scratchformer {
namespace cuda {

// The forward (embed_sinusoidal, add_sinusoidal) spreads a row's columns over blockIdx.y: 128
// threads a block, each owning at least 2 columns, and a grid's y dimension is at most 65535.
constexpr int64_t kMaxForwardWidth = 65535LL * 128 * 2;  // 16,776,960 columns (d_model)

}  // namespace cuda
}  // namespace scratchformer
