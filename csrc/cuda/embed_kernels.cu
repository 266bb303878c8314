// CUDA kernels for scratchformer::embed_sinusoidal (formula, backward and accuracy notes in
// csrc/embed.cpp; the sinusoid itself in csrc/sinusoid.h, shared with the CPU kernel). Only CUDA headers here, so nvcc compiles this file on a machine whose torch
// has no CUDA; csrc/cuda/embed_cuda.cpp holds the torch side and calls the typed launchers below.
//
// Forward: thread (x, y) of a block owns 2 * PAIRS adjacent columns (one 16-byte access a row:
// 8 bf16/fp16 or 4 fp32 columns, where d, strides and pointers allow; else one pair) at one
// position j of the sequence, and the rows of up to kRowsPerThread sequences at that position
// (rows b * L + j). A warp covers consecutive columns of one row: coalesced. The positional term
// depends on (j, column) only, so each thread computes its pairs' once and adds them to all its
// rows: w_i = 10000^(-2i/d) (one double exp), the angle (pos_offset + j) * w_i, its reduction by
// pi/2 in double and the float polynomials cost one evaluation per pair and thread, not per
// element. The thread loads all its rows' token ids, then all its rows' values, then stores: its
// loads are in flight together. Compute in fp32, one rounding on store.
// History, H100: a thread walking 8 positions, one sincos an element, reached half the copy
// bandwidth in bf16 and 0.9 in fp32 (first run); one sincos per 8 rows barely moved bf16 (0.52-0.57,
// device time, 2026-11-26 fourth window), whose accesses were 4 bytes against fp32's 8: so the
// bytes a thread has in flight, not the arithmetic, bound it; hence the 16-byte accesses and the
// staged loads (not yet measured on a GPU).
//
// Precision: no fast-math intrinsic is used: sin/cos are explicit float polynomials on |r| <=
// pi/4 (Cephes sinf/cosf), the range reduction is in double, so --use_fast_math would not change
// them (setup.py no longer passes it anyway). The only CPU/CUDA difference is FMA contraction
// (nvcc contracts a*b+c, the x86-64 baseline build does not): about 1 float ulp. The CPU build
// measures 7.8e-8 max error vs the float64 table up to position 100k; the CUDA figure must be
// measured on a GPU (tests/test_embed.py::test_cuda_pe_accuracy prints it, asserts <= 2.5e-7).
//
// Out-of-range token ids: device-side assert (printf of the id and its flat index, then
// assert, compiled in regardless of NDEBUG). As with F.embedding on CUDA, the error surfaces at
// the next synchronisation ("device-side assert triggered") and the CUDA context is lost.
//
// Backward, deterministic, in four launches on the current stream (the glue hands over one byte
// workspace, sized by embed_sinusoidal_bwd_workspace):
//   1. keys: every token id checked against [0, V) (device-side assert naming it and its place, as
//      the forward), copied to a 32-bit key beside its flat position;
//   2. cub's radix sort of (key, position) pairs on the ceil(log2 V) bits the ids can have (15 for a
//      32,000-token vocabulary, where at::sort of the int64 ids sorted on all 64): an LSD radix sort
//      is stable, so equal ids keep ascending positions, the CPU kernel's order;
//   3. offsets: offsets[v] = the first sorted index with id >= v, for v in [0, V], one thread a row
//      (one binary search each, all in one wave);
//   4. rows: thread (x, y) of a block owns vocabulary row v = blockIdx.x * blockDim.y + y and COLS
//      adjacent columns from COLS * x (one 16-byte access a row where d and the pointers allow: 8
//      bf16/fp16 or 4 fp32 columns, as the forward; else one column); it sums grad[pos[m], c] over
//      its run [offsets[v], offsets[v + 1]) in ascending m in fp32, kBwdRows rows' loads in flight
//      together, multiplies by scale, rounds once and writes grad_weight[v, c]; an absent id, and
//      padding_idx, writes zeros. Every row of grad_weight is written once, by this kernel (no
//      zero-fill before it). No atomics: bit-identical run to run and to the CPU kernel.
// History, H100 (2026-11-26, sixth window), bf16 forward + backward: 0.16-0.21 of the copy bandwidth
// at 16k tokens, 0.63-0.72 at 262k. A line through its backward's times at d 512 and 1024 (16k
// tokens) gives about 80 us fixed and ~640 GB/s for the bytes: at::sort on 64-bit keys, and every
// thread of every row (7.5 waves of them at d 512) binary-searching the sorted ids twice, 28
// dependent loads before its first useful one; stages 1-3 replace both (not yet run on a GPU).
// Before that, the first design ran one block per sorted position (only the start of a run
// worked) on 2-byte accesses after a zero-fill of grad_weight: 0.18-0.37 of the copy bandwidth.
// Cost: a very frequent id walks its run serially in one thread row; padding, usually the most
// frequent id, is skipped.
#undef NDEBUG
#include <cassert>
#include <cstdint>
#include <cstdio>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>

#include "../sinusoid.h"
#include "embed_limits.h"

namespace scratchformer {
namespace cuda {
namespace {

constexpr int kRowsPerThread = 8;  // forward: rows per thread, amortising its exp(double)
constexpr int kBwdRows = 8;         // backward: rows of a run loaded together

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// 2 * PAIRS adjacent elements, loaded and stored as one access (16 bytes at the widest).
template <typename T, int PAIRS>
struct alignas(2 * PAIRS * sizeof(T)) Pairs {
  T v[2 * PAIRS];
};

using sinusoid::inv_freq;  // csrc/sinusoid.h: the formula, shared with the CPU kernel
using sinusoid::sincos_angle;

// out[r, :] = src[row(r), :] * scale (+ PE(pos_offset + r % L)), row(r) = tokens[r] if GATHER
// else r. A thread owns the 2 * PAIRS columns from c = 2 * PAIRS * i. VEC: d, the row strides and
// both pointers multiples of 2 * PAIRS elements (the launcher checks), so each row's columns are
// one aligned access; otherwise element by element with a bound check (PAIRS is 1 then).
// The rows are staged: every row's token id is loaded, then every row's values, then stored, so a
// thread has all its loads in flight at once instead of one row's at a time.
template <typename scalar_t, typename index_t, bool GATHER, int PAIRS, bool VEC>
__global__ void embed_sinusoidal_fwd_kernel(
    const index_t* __restrict__ tokens,  // (rows,) token ids; unused unless GATHER
    const scalar_t* __restrict__ src,    // GATHER: weight (V, d); else x (rows, d)
    scalar_t* __restrict__ out,          // (rows, d) contiguous
    int64_t rows,                        // B * L
    int64_t L,                           // sequence length: position of row r is pos_offset + r % L
    int64_t d,                           // d_model
    int64_t stride_src_row,              // elements between rows of src
    int64_t V,                           // rows of weight (GATHER bounds check)
    float scale, int64_t pos_offset, bool add_pe) {
  constexpr int kCols = 2 * PAIRS;
  const int64_t c = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * kCols;  // first column
  if (c >= d) return;
  const int64_t pos_blocks = (L + blockDim.y - 1) / blockDim.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x % pos_blocks) * blockDim.y + threadIdx.y;  // position
  if (j >= L) return;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x / pos_blocks) * kRowsPerThread;  // first sequence
  float pe[kCols];
#pragma unroll
  for (int p = 0; p < PAIRS; ++p) {
    pe[2 * p] = pe[2 * p + 1] = 0.0f;  // 0 without positions: x * scale + 0 == x * scale exactly
    if (add_pe && c + 2 * p < d) {
      sincos_angle(static_cast<double>(pos_offset + j) * inv_freq(c + 2 * p, d), &pe[2 * p], &pe[2 * p + 1]);
    }
  }
  int64_t src_row[kRowsPerThread];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int64_t r = (b0 + k) * L + j;
    src_row[k] = r < rows ? (GATHER ? static_cast<int64_t>(tokens[r]) : r) : -1;
  }
  if (GATHER) {
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const int64_t r = (b0 + k) * L + j;
      if (r < rows && (src_row[k] < 0 || src_row[k] >= V)) {
        if (threadIdx.x == 0) {
          printf("embed_sinusoidal: token id %lld at tokens[%lld, %lld] is out of range [0, %lld)\n",
                 static_cast<long long>(src_row[k]), static_cast<long long>(r / L),
                 static_cast<long long>(r % L), static_cast<long long>(V));
        }
        assert(src_row[k] >= 0 && src_row[k] < V);
      }
    }
  }
  float x[kRowsPerThread][kCols];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const scalar_t* in = src + (src_row[k] < 0 ? 0 : src_row[k]) * stride_src_row + c;
    if (VEC) {
      Pairs<scalar_t, PAIRS> v;
      if (src_row[k] >= 0) v = *reinterpret_cast<const Pairs<scalar_t, PAIRS>*>(in);
#pragma unroll
      for (int e = 0; e < kCols; ++e) x[k][e] = src_row[k] >= 0 ? to_float(v.v[e]) : 0.0f;
    } else {
#pragma unroll
      for (int e = 0; e < kCols; ++e) x[k][e] = src_row[k] >= 0 && c + e < d ? to_float(in[e]) : 0.0f;
    }
  }
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    if (src_row[k] < 0) continue;  // past the last row
    scalar_t* o = out + ((b0 + k) * L + j) * d + c;
    if (VEC) {
      Pairs<scalar_t, PAIRS> v;
#pragma unroll
      for (int e = 0; e < kCols; ++e) v.v[e] = from_float<scalar_t>(x[k][e] * scale + pe[e]);
      *reinterpret_cast<Pairs<scalar_t, PAIRS>*>(o) = v;
    } else {
#pragma unroll
      for (int e = 0; e < kCols; ++e) {
        if (c + e < d) o[e] = from_float<scalar_t>(x[k][e] * scale + pe[e]);
      }
    }
  }
}

// Backward stage 1: keys[i] = tokens[i] (checked against [0, V)), positions[i] = i.
template <typename index_t>
__global__ void embed_bwd_keys_kernel(const index_t* __restrict__ tokens, uint32_t* __restrict__ keys,
                                      int32_t* __restrict__ positions, int64_t N, int64_t L, int64_t V) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N) return;
  const int64_t id = static_cast<int64_t>(tokens[i]);
  if (id < 0 || id >= V) {
    printf("embed_sinusoidal_backward: token id %lld at tokens[%lld, %lld] is out of range [0, %lld)\n",
           static_cast<long long>(id), static_cast<long long>(i / L), static_cast<long long>(i % L),
           static_cast<long long>(V));
    assert(id >= 0 && id < V);
  }
  keys[i] = static_cast<uint32_t>(id);
  positions[i] = static_cast<int32_t>(i);
}

// Backward stage 3: offsets[v] = the first m of sorted_keys[0, N) with sorted_keys[m] >= v, v in [0, V].
__global__ void embed_bwd_offsets_kernel(const uint32_t* __restrict__ sorted_keys, int32_t* __restrict__ offsets,
                                         int64_t N, int64_t V) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v > V) return;
  int64_t lo = 0, hi = N;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(sorted_keys[mid]) < v) lo = mid + 1; else hi = mid;
  }
  offsets[v] = static_cast<int32_t>(lo);
}

// Backward stage 4: grad_weight[v, :] = scale * sum over m in [offsets[v], offsets[v + 1]) of
// grad[positions[m], :], zeros for an absent v and for padding_idx. VEC: d and both pointers
// multiples of COLS elements (the launcher checks), so a row's COLS columns are one aligned access;
// otherwise COLS is 1.
template <typename scalar_t, int COLS, bool VEC>
__global__ void embed_sinusoidal_bwd_kernel(
    const int32_t* __restrict__ offsets,    // (V + 1,) each id's first index in the sorted order
    const int32_t* __restrict__ positions,  // (N,) flat (b * L + j) position of each sorted id
    const scalar_t* __restrict__ grad,      // (N, d) contiguous
    scalar_t* __restrict__ grad_weight,     // (V, d) contiguous, every row written here
    int64_t d, int64_t V, float scale, int64_t padding_idx) {
  using Vec = Pairs<scalar_t, (COLS + 1) / 2>;
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (v >= V) return;
  const int64_t start = offsets[v];
  const int64_t end = v == padding_idx ? start : static_cast<int64_t>(offsets[v + 1]);
  const int64_t step = static_cast<int64_t>(blockDim.x) * COLS;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * COLS; c < d; c += step) {
    float acc[COLS] = {};
    for (int64_t m = start; m < end; m += kBwdRows) {
      // the rows' positions, then their values, then the sums in ascending m: loads in flight
      // together, the order of the sum unchanged (a row past the run repeats the last one, unused)
      int64_t row[kBwdRows];
#pragma unroll
      for (int u = 0; u < kBwdRows; ++u) row[u] = positions[m + u < end ? m + u : end - 1];
      float x[kBwdRows][COLS];
#pragma unroll
      for (int u = 0; u < kBwdRows; ++u) {
        const scalar_t* g = grad + row[u] * d + c;
        if (VEC) {
          const Vec w = *reinterpret_cast<const Vec*>(g);
#pragma unroll
          for (int e = 0; e < COLS; ++e) x[u][e] = to_float(w.v[e]);
        } else {
#pragma unroll
          for (int e = 0; e < COLS; ++e) x[u][e] = to_float(g[e]);
        }
      }
#pragma unroll
      for (int u = 0; u < kBwdRows; ++u) {
        if (m + u < end) {
#pragma unroll
          for (int e = 0; e < COLS; ++e) acc[e] += x[u][e];
        }
      }
    }
    scalar_t* o = grad_weight + v * d + c;
    if (VEC) {
      Vec w;
#pragma unroll
      for (int e = 0; e < COLS; ++e) w.v[e] = from_float<scalar_t>(acc[e] * scale);
      *reinterpret_cast<Vec*>(o) = w;
    } else {
#pragma unroll
      for (int e = 0; e < COLS; ++e) o[e] = from_float<scalar_t>(acc[e] * scale);
    }
  }
}

bool aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename scalar_t, typename index_t, int PAIRS, bool VEC>
void launch_fwd_kernel(const index_t* tokens, const scalar_t* src, scalar_t* out, int64_t rows,
                       int64_t L, int64_t d, int64_t stride_src_row, int64_t V, float scale,
                       int64_t pos_offset, bool add_pe, cudaStream_t stream, dim3 grid, dim3 block) {
  if (tokens != nullptr) {
    embed_sinusoidal_fwd_kernel<scalar_t, index_t, true, PAIRS, VEC><<<grid, block, 0, stream>>>(
        tokens, src, out, rows, L, d, stride_src_row, V, scale, pos_offset, add_pe);
  } else {
    embed_sinusoidal_fwd_kernel<scalar_t, index_t, false, PAIRS, VEC><<<grid, block, 0, stream>>>(
        tokens, src, out, rows, L, d, stride_src_row, V, scale, pos_offset, add_pe);
  }
}

template <typename scalar_t, typename index_t>
cudaError_t launch_fwd(const index_t* tokens, const scalar_t* src, scalar_t* out, int64_t rows,
                       int64_t L, int64_t d, int64_t stride_src_row, int64_t V, float scale,
                       int64_t pos_offset, bool add_pe, cudaStream_t stream) {
  if (rows == 0 || d == 0) return cudaSuccess;
  // Columns per thread: 16 bytes (8 bf16/fp16, 4 fp32) where d, the source's row stride and both
  // pointers allow one aligned 16-byte access per row; else 2 (4/8 bytes) where they allow that;
  // else 2 element by element. (The 2026-11-26 H100 run, 2 columns a thread: bf16 at 0.5-0.57 of
  // the copy bandwidth, fp32, twice the bytes an access, 0.85-0.92: bytes in flight per thread.)
  constexpr int kWide = 16 / (2 * sizeof(scalar_t));  // pairs in 16 bytes
  auto fits = [&](int64_t cols) {
    const int64_t bytes = cols * static_cast<int64_t>(sizeof(scalar_t));
    return d % cols == 0 && stride_src_row % cols == 0 && aligned(src, bytes) && aligned(out, bytes);
  };
  const int cols = fits(2 * kWide) ? 2 * kWide : 2;
  const bool vec = fits(2);
  const int64_t groups = (d + cols - 1) / cols;  // threads along a row
  // 128 threads along the row when it is wide enough, down to one warp; 256 per block.
  const unsigned tx = groups >= 128 ? 128 : (groups >= 64 ? 64 : 32);
  const unsigned ty = 256 / tx;
  // blockIdx.x: ty positions x kRowsPerThread sequences (rows b * L + j; the last sequence may be
  // short when rows is not a multiple of L)
  const int64_t sequences = (rows + L - 1) / L;
  const int64_t grid_x = (L + ty - 1) / ty * ((sequences + kRowsPerThread - 1) / kRowsPerThread);
  const int64_t grid_y = (groups + tx - 1) / tx;
  // The glue refuses d > kMaxForwardWidth first, naming it; this keeps the launch from ever
  // starting a grid it cannot cover.
  if (d > kMaxForwardWidth || grid_x > 0x7fffffffLL || grid_y > 65535) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const dim3 block(tx, ty);
  if (cols == 2 * kWide) {
    launch_fwd_kernel<scalar_t, index_t, kWide, true>(tokens, src, out, rows, L, d, stride_src_row, V, scale,
                                                      pos_offset, add_pe, stream, grid, block);
  } else if (vec) {
    launch_fwd_kernel<scalar_t, index_t, 1, true>(tokens, src, out, rows, L, d, stride_src_row, V, scale,
                                                  pos_offset, add_pe, stream, grid, block);
  } else {
    launch_fwd_kernel<scalar_t, index_t, 1, false>(tokens, src, out, rows, L, d, stride_src_row, V, scale,
                                                   pos_offset, add_pe, stream, grid, block);
  }
  return cudaGetLastError();
}

// The backward's workspace, carved from one buffer: the keys and positions before and after the
// sort, the offsets and cub's temporary storage, each 256-byte aligned. With base == nullptr it
// only sizes them (*bytes). N < 2^31 and V < 2^31 (the glue checks).
struct BwdWorkspace {
  uint32_t* keys;
  uint32_t* sorted_keys;
  int32_t* positions;
  int32_t* sorted_positions;
  int32_t* offsets;
  void* sort_temp;
  size_t sort_temp_bytes;
  int end_bit;  // the bits an id in [0, V) can have, at least 1
};

cudaError_t carve_bwd_workspace(void* base, int64_t N, int64_t V, BwdWorkspace* ws, size_t* bytes) {
  ws->end_bit = 1;
  while ((int64_t{1} << ws->end_bit) < V) ++ws->end_bit;
  ws->sort_temp_bytes = 0;
  const cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, ws->sort_temp_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(N), 0,
      ws->end_bit);
  if (err != cudaSuccess) return err;
  char* p = static_cast<char*>(base);
  size_t used = 0;
  auto take = [&](size_t n) {
    void* at = p == nullptr ? nullptr : p + used;
    used += (n + 255) / 256 * 256;
    return at;
  };
  const size_t n = static_cast<size_t>(N);
  ws->keys = static_cast<uint32_t*>(take(n * sizeof(uint32_t)));
  ws->sorted_keys = static_cast<uint32_t*>(take(n * sizeof(uint32_t)));
  ws->positions = static_cast<int32_t*>(take(n * sizeof(int32_t)));
  ws->sorted_positions = static_cast<int32_t*>(take(n * sizeof(int32_t)));
  ws->offsets = static_cast<int32_t*>(take((static_cast<size_t>(V) + 1) * sizeof(int32_t)));
  ws->sort_temp = take(ws->sort_temp_bytes);
  *bytes = used;
  return cudaSuccess;
}

template <typename scalar_t>
cudaError_t launch_bwd_rows(const int32_t* offsets, const int32_t* positions, const scalar_t* grad,
                            scalar_t* grad_weight, int64_t d, int64_t V, float scale,
                            int64_t padding_idx, cudaStream_t stream) {
  constexpr int kWide = 16 / sizeof(scalar_t);  // columns in 16 bytes
  const bool vec = d % kWide == 0 && aligned(grad, 16) && aligned(grad_weight, 16);
  const int64_t groups = vec ? d / kWide : d;  // threads along a row
  // up to 128 threads along the row, down to one warp; 256 per block, so 2-8 vocabulary rows a block
  const unsigned tx = groups >= 128 ? 128 : (groups >= 64 ? 64 : 32);
  const unsigned ty = 256 / tx;
  const int64_t blocks = (V + ty - 1) / ty;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(blocks)), block(tx, ty);
  if (vec) {
    embed_sinusoidal_bwd_kernel<scalar_t, kWide, true><<<grid, block, 0, stream>>>(
        offsets, positions, grad, grad_weight, d, V, scale, padding_idx);
  } else {
    embed_sinusoidal_bwd_kernel<scalar_t, 1, false><<<grid, block, 0, stream>>>(
        offsets, positions, grad, grad_weight, d, V, scale, padding_idx);
  }
  return cudaGetLastError();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Typed launchers, declared again in embed_cuda.cpp. They return the launch error; the glue
// wraps the call in C10_CUDA_CHECK and C10_CUDA_KERNEL_LAUNCH_CHECK.
// ---------------------------------------------------------------------------------------------

// out (rows, d) = weight[tokens] * scale (+ PE). tokens (rows,) with position pos_offset + r % L.
template <typename scalar_t, typename index_t>
cudaError_t embed_sinusoidal_fwd(const index_t* tokens, const scalar_t* weight,
                                 int64_t stride_weight_row, int64_t V, scalar_t* out,
                                 int64_t rows, int64_t L, int64_t d, float scale,
                                 int64_t pos_offset, bool pos_encoding, cudaStream_t stream) {
  return launch_fwd<scalar_t, index_t>(tokens, weight, out, rows, L, d, stride_weight_row, V,
                                       scale, pos_offset, pos_encoding, stream);
}

// out (rows, d) = x + PE, x (rows, d) contiguous, position pos_offset + r % L.
template <typename scalar_t>
cudaError_t add_sinusoidal_fwd(const scalar_t* x, scalar_t* out, int64_t rows, int64_t L,
                               int64_t d, int64_t pos_offset, cudaStream_t stream) {
  return launch_fwd<scalar_t, int64_t>(nullptr, x, out, rows, L, d, d, 0, 1.0f, pos_offset, true,
                                       stream);
}

// The bytes of the workspace embed_sinusoidal_bwd needs for N tokens and V rows.
cudaError_t embed_sinusoidal_bwd_workspace(int64_t N, int64_t V, size_t* bytes) {
  BwdWorkspace ws;
  return carve_bwd_workspace(nullptr, N, V, &ws, bytes);
}

// grad_weight (V, d), every row written (no zero-fill needed), from tokens (N,) = (B * L,) with
// sequence length L (for the error message) and grad (N, d); workspace: at least
// embed_sinusoidal_bwd_workspace(N, V) bytes.
template <typename scalar_t, typename index_t>
cudaError_t embed_sinusoidal_bwd(const index_t* tokens, const scalar_t* grad, scalar_t* grad_weight,
                                 int64_t N, int64_t L, int64_t d, int64_t V, float scale,
                                 int64_t padding_idx, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (N == 0 || d == 0) return cudaSuccess;
  BwdWorkspace ws;
  size_t needed = 0;
  cudaError_t err = carve_bwd_workspace(workspace, N, V, &ws, &needed);
  if (err != cudaSuccess) return err;
  if (workspace_bytes < needed) return cudaErrorInvalidValue;
  constexpr unsigned kThreads = 256;
  embed_bwd_keys_kernel<index_t><<<static_cast<unsigned>((N + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      tokens, ws.keys, ws.positions, N, L, V);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  if (V == 0) return cudaSuccess;  // no rows to write; the keys kernel has reported every id
  err = cub::DeviceRadixSort::SortPairs(ws.sort_temp, ws.sort_temp_bytes, ws.keys, ws.sorted_keys,
                                        ws.positions, ws.sorted_positions, static_cast<int>(N), 0,
                                        ws.end_bit, stream);
  if (err != cudaSuccess) return err;
  embed_bwd_offsets_kernel<<<static_cast<unsigned>((V + kThreads) / kThreads), kThreads, 0, stream>>>(
      ws.sorted_keys, ws.offsets, N, V);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  return launch_bwd_rows<scalar_t>(ws.offsets, ws.sorted_positions, grad, grad_weight, d, V, scale,
                                   padding_idx, stream);
}

#define SCRATCHFORMER_INSTANTIATE(T)                                                           \
  template cudaError_t embed_sinusoidal_fwd<T, int32_t>(const int32_t*, const T*, int64_t,     \
                                                        int64_t, T*, int64_t, int64_t, int64_t, \
                                                        float, int64_t, bool, cudaStream_t);    \
  template cudaError_t embed_sinusoidal_fwd<T, int64_t>(const int64_t*, const T*, int64_t,     \
                                                        int64_t, T*, int64_t, int64_t, int64_t, \
                                                        float, int64_t, bool, cudaStream_t);    \
  template cudaError_t add_sinusoidal_fwd<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t, \
                                             cudaStream_t);                                     \
  template cudaError_t embed_sinusoidal_bwd<T, int32_t>(const int32_t*, const T*, T*, int64_t, \
                                                        int64_t, int64_t, int64_t, float, int64_t, \
                                                        void*, size_t, cudaStream_t);               \
  template cudaError_t embed_sinusoidal_bwd<T, int64_t>(const int64_t*, const T*, T*, int64_t, \
                                                        int64_t, int64_t, int64_t, float, int64_t, \
                                                        void*, size_t, cudaStream_t);
SCRATCHFORMER_INSTANTIATE(float)
SCRATCHFORMER_INSTANTIATE(__half)
SCRATCHFORMER_INSTANTIATE(__nv_bfloat16)
#undef SCRATCHFORMER_INSTANTIATE

}  // namespace cuda
}  // namespace scratchformer
