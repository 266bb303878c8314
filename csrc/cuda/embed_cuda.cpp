// Torch side of the CUDA embed_sinusoidal ops: checks, device guard, current stream, the
// launcher call (csrc/cuda/embed_kernels.cu), launch checks and the CUDA registrations. Built
// only when torch has CUDA (setup.py). Kernel design, precision and determinism notes live in
// embed_kernels.cu; the formula and schema in csrc/embed.cpp.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "embed_limits.h"

namespace scratchformer {

// Defined in csrc/embed.cpp: the same checks (and messages) on every device.
void check_embed_args(const at::Tensor& tokens, const at::Tensor& weight, int64_t pos_offset,
                      bool pos_encoding, std::optional<int64_t> padding_idx);
void check_embed_backward_args(const at::Tensor& grad, const at::Tensor& tokens,
                               int64_t num_weights, int64_t padding_idx);
void check_add_sinusoidal_args(const at::Tensor& x, int64_t pos_offset);
void check_token_ids(const at::Tensor& tokens, int64_t V, const char* op);  // tokens on the CPU

namespace cuda {

// Typed launchers, defined and instantiated (float, __half, __nv_bfloat16) in embed_kernels.cu.
template <typename scalar_t, typename index_t>
cudaError_t embed_sinusoidal_fwd(const index_t* tokens, const scalar_t* weight,
                                 int64_t stride_weight_row, int64_t V, scalar_t* out,
                                 int64_t rows, int64_t L, int64_t d, float scale,
                                 int64_t pos_offset, bool pos_encoding, cudaStream_t stream);
template <typename scalar_t>
cudaError_t add_sinusoidal_fwd(const scalar_t* x, scalar_t* out, int64_t rows, int64_t L,
                               int64_t d, int64_t pos_offset, cudaStream_t stream);
cudaError_t embed_sinusoidal_bwd_workspace(int64_t N, int64_t V, size_t* bytes);
template <typename scalar_t, typename index_t>
cudaError_t embed_sinusoidal_bwd(const index_t* tokens, const scalar_t* grad, scalar_t* grad_weight,
                                 int64_t N, int64_t L, int64_t d, int64_t V, float scale,
                                 int64_t padding_idx, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

namespace {

// at:: element type -> the CUDA type the launchers take (same size and bit layout).
template <typename T> struct CudaType { using type = T; };
template <> struct CudaType<at::Half> { using type = __half; };
template <> struct CudaType<at::BFloat16> { using type = __nv_bfloat16; };

template <typename T>
const typename CudaType<T>::type* cuda_ptr(const at::Tensor& t) {
  return reinterpret_cast<const typename CudaType<T>::type*>(t.const_data_ptr<T>());
}
template <typename T>
typename CudaType<T>::type* cuda_mutable_ptr(at::Tensor& t) {
  return reinterpret_cast<typename CudaType<T>::type*>(t.mutable_data_ptr<T>());
}

// The kernels exist for these three; float64 is rejected by check_cuda_dtype first.
#define SCRATCHFORMER_DISPATCH_CUDA_FLOATS(TYPE, NAME, ...)                           \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)           \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)        \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

void check_cuda_dtype(at::ScalarType dtype, const char* op) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              " on CUDA supports float32, float16 and bfloat16, got ", dtype);
}

// The forward's launch covers rows up to kMaxForwardWidth columns (embed_limits.h).
void check_cuda_width(int64_t d, const char* op) {
  TORCH_CHECK(d <= kMaxForwardWidth, op, " on CUDA: d_model (the last dimension) must be at most ",
              kMaxForwardWidth, ", got ", d);
}

at::Tensor embed_sinusoidal_cuda(const at::Tensor& tokens_in, const at::Tensor& weight_in,
                                 double scale, int64_t pos_offset, bool pos_encoding,
                                 std::optional<int64_t> padding_idx) {
  check_embed_args(tokens_in, weight_in, pos_offset, pos_encoding, padding_idx);
  TORCH_CHECK(weight_in.is_cuda(), "embed_sinusoidal: expected CUDA tensors, got weight on ",
              weight_in.device());
  check_cuda_dtype(weight_in.scalar_type(), "embed_sinusoidal");
  check_cuda_width(weight_in.size(1), "embed_sinusoidal");
  const c10::cuda::CUDAGuard guard(weight_in.device());
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor weight = weight_in.stride(1) == 1 ? weight_in : weight_in.contiguous();
  const int64_t B = tokens.size(0), L = tokens.size(1), V = weight.size(0), d = weight.size(1);
  at::Tensor out = at::empty({B, L, d}, weight.options());
  if (out.numel() == 0) {
    // No columns (d_model 0) launch nothing, so the kernel's id check is done here, as on the CPU.
    if (B * L > 0) check_token_ids(tokens.cpu(), V, "embed_sinusoidal");
    return out;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "embed_sinusoidal_cuda", [&] {
    SCRATCHFORMER_DISPATCH_CUDA_FLOATS(weight.scalar_type(), "embed_sinusoidal_cuda", [&] {
      C10_CUDA_CHECK(embed_sinusoidal_fwd(
          tokens.const_data_ptr<index_t>(), cuda_ptr<scalar_t>(weight), weight.stride(0), V,
          cuda_mutable_ptr<scalar_t>(out), B * L, L, d, static_cast<float>(scale), pos_offset,
          pos_encoding, stream));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor embed_sinusoidal_backward_cuda(const at::Tensor& grad_in, const at::Tensor& tokens_in,
                                          int64_t num_weights, double scale,
                                          int64_t padding_idx) {
  check_embed_backward_args(grad_in, tokens_in, num_weights, padding_idx);
  check_cuda_dtype(grad_in.scalar_type(), "embed_sinusoidal_backward");
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t N = tokens.numel(), L = tokens.size(1), d = grad.size(2);
  if (N == 0 || d == 0) {  // no launch: the ids are checked here (d_model 0), as on the CPU
    if (N > 0) check_token_ids(tokens.cpu(), num_weights, "embed_sinusoidal_backward");
    return at::zeros({num_weights, d}, grad.options());
  }
  // The kernels sort 32-bit ids and positions (csrc/cuda/embed_kernels.cu).
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  TORCH_CHECK(N <= kMax, "embed_sinusoidal_backward on CUDA: at most ", kMax, " tokens, got ", N);
  TORCH_CHECK(num_weights <= kMax, "embed_sinusoidal_backward on CUDA: at most ", kMax,
              " embedding rows, got ", num_weights);
  at::Tensor grad_weight = at::empty({num_weights, d}, grad.options());  // the kernel writes every row
  size_t workspace_bytes = 0;
  C10_CUDA_CHECK(embed_sinusoidal_bwd_workspace(N, num_weights, &workspace_bytes));
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, grad.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "embed_sinusoidal_backward_cuda", [&] {
    SCRATCHFORMER_DISPATCH_CUDA_FLOATS(grad.scalar_type(), "embed_sinusoidal_backward_cuda", [&] {
      C10_CUDA_CHECK(embed_sinusoidal_bwd(
          tokens.const_data_ptr<index_t>(), cuda_ptr<scalar_t>(grad),
          cuda_mutable_ptr<scalar_t>(grad_weight), N, L, d, num_weights, static_cast<float>(scale),
          padding_idx, workspace.mutable_data_ptr(), workspace_bytes, stream));
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_weight;
}

at::Tensor add_sinusoidal_cuda(const at::Tensor& x_in, int64_t pos_offset) {
  check_add_sinusoidal_args(x_in, pos_offset);
  check_cuda_dtype(x_in.scalar_type(), "add_sinusoidal");
  check_cuda_width(x_in.size(-1), "add_sinusoidal");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  const int64_t d = x.size(-1), L = x.size(-2), rows = x.numel() / d;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  SCRATCHFORMER_DISPATCH_CUDA_FLOATS(x.scalar_type(), "add_sinusoidal_cuda", [&] {
    C10_CUDA_CHECK(add_sinusoidal_fwd(cuda_ptr<scalar_t>(x), cuda_mutable_ptr<scalar_t>(out), rows,
                                      L, d, pos_offset, stream));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(scratchformer, CUDA, m) {
  m.impl("embed_sinusoidal", &cuda::embed_sinusoidal_cuda);
  m.impl("embed_sinusoidal_backward", &cuda::embed_sinusoidal_backward_cuda);
  m.impl("add_sinusoidal", &cuda::add_sinusoidal_cuda);
}

}  // namespace scratchformer
