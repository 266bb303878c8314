// scratchformer::embed_sinusoidal: the model's input path in one pass (issue 5).
//
//   out[b, j, :] = weight[tokens[b, j], :] * scale + PE(pos_offset + j)
//   PE[p, 2i]   = sin(p * w_i),  PE[p, 2i+1] = cos(p * w_i),  w_i = 10000^(-2i / d_model)
//
// "Attention Is All You Need" (Vaswani et al., 2017), section 3.5. PE is computed from the
// position, never read from a table; pos_offset is the position of tokens[:, 0], so incremental
// decoding passes the number of tokens already decoded.
//
// Backward (weight only; tokens are integers, scale/pos_offset are constants, PE has no input):
//   grad_weight[v, :] = scale * sum_{(b, j): tokens[b, j] == v, v != padding_idx} grad[b, j, :]
// accumulated in opmath (float, double for float64) in ascending (b, j) order, scaled once, cast
// once: deterministic, and the same order as the CUDA kernel (a stable sort by token).
//
// This file holds the schema (TORCH_LIBRARY), the argument checks shared with csrc/cuda/, the CPU
// kernels and their CPU impls, and the PyInit stub. Fake (meta) impls and autograd are registered
// in scratchformer/_ext.py.
//
// Accuracy of PE (both devices run the same code, csrc/sinusoid.h): the angle p * w_i is formed in double (as
// the float64 reference does), reduced by pi/2 in double, and sin/cos of the reduced argument
// |r| <= pi/4 come from Cephes' single-precision minimax polynomials. Measured on CPU against the
// float64 table (scratchformer.reference.sinusoidal_positions), positions 0..100_000, d_model 2
// to 1024: max abs error 7.8e-8, mean 1.4e-8 (rounding the float64 table to float32 alone: max
// 3.0e-8, mean 1.2e-8; tests/test_embed.py asserts <= 1e-7 on CPU, <= 2.5e-7 on CUDA). A float32
// angle p * w_i would be off by up to p * 2^-24 ~ 6e-3 at 1e5. The error stays below 1e-7 up to
// the last position the ops accept, 2^29 - 1 (9.0e-8 there; csrc/sinusoid.h kMaxPositions):
// beyond it the double reduction's rounding shows, and from about 1e16 the values leave [-1, 1].
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "sinusoid.h"

namespace scratchformer {

// --------------------------------------------------------------------------------------------
// Argument checks, shared with csrc/cuda/embed_cuda.cpp (which declares them).
// --------------------------------------------------------------------------------------------

namespace {
// The floating types the kernels are built for (at::isFloatingType also admits the float8 types,
// which then failed in the dispatch, and passed the fake impls).
bool is_kernel_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}
}  // namespace

void check_embed_args(const at::Tensor& tokens, const at::Tensor& weight, int64_t pos_offset,
                      bool pos_encoding, std::optional<int64_t> padding_idx) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt,
              "embed_sinusoidal: tokens must be int64 or int32, got ", tokens.scalar_type());
  TORCH_CHECK(is_kernel_float(weight.scalar_type()),
              "embed_sinusoidal: weight must be floating point (float32, float16, bfloat16, "
              "float64), got ", weight.scalar_type());
  TORCH_CHECK(tokens.dim() == 2, "embed_sinusoidal: tokens must be 2-D (B, L), got a ",
              tokens.dim(), "-D tensor of shape ", tokens.sizes());
  TORCH_CHECK(weight.dim() == 2, "embed_sinusoidal: weight must be 2-D (V, d_model), got a ",
              weight.dim(), "-D tensor of shape ", weight.sizes());
  TORCH_CHECK(tokens.device() == weight.device(), "embed_sinusoidal: tokens are on ",
              tokens.device(), " but weight is on ", weight.device(),
              "; both must be on the same device");
  TORCH_CHECK(pos_offset >= 0, "embed_sinusoidal: pos_offset must be >= 0, got ", pos_offset);
  TORCH_CHECK(!pos_encoding || pos_offset <= sinusoid::kMaxPositions - tokens.size(1),
              "embed_sinusoidal: positions must be below ", sinusoid::kMaxPositions,
              " (2^29, where the float sinusoid stops being accurate), got pos_offset ", pos_offset,
              " and L ", tokens.size(1));
  TORCH_CHECK(!pos_encoding || weight.size(1) % 2 == 0,
              "embed_sinusoidal: d_model must be even for the sinusoidal encoding, got ",
              weight.size(1));
  if (padding_idx.has_value()) {
    TORCH_CHECK(*padding_idx >= 0 && *padding_idx < weight.size(0),
                "embed_sinusoidal: padding_idx must be in [0, ", weight.size(0),
                ") (the Python wrapper maps negative values), got ", *padding_idx);
  }
}

void check_embed_backward_args(const at::Tensor& grad, const at::Tensor& tokens,
                               int64_t num_weights, int64_t padding_idx) {
  TORCH_CHECK(tokens.scalar_type() == at::kLong || tokens.scalar_type() == at::kInt,
              "embed_sinusoidal_backward: tokens must be int64 or int32, got ",
              tokens.scalar_type());
  TORCH_CHECK(is_kernel_float(grad.scalar_type()),
              "embed_sinusoidal_backward: grad must be floating point (float32, float16, bfloat16, "
              "float64), got ", grad.scalar_type());
  TORCH_CHECK(tokens.dim() == 2 && grad.dim() == 3 && grad.size(0) == tokens.size(0) &&
                  grad.size(1) == tokens.size(1),
              "embed_sinusoidal_backward: grad must be (B, L, d_model) for tokens (B, L); got "
              "grad ", grad.sizes(), " and tokens ", tokens.sizes());
  TORCH_CHECK(grad.device() == tokens.device(), "embed_sinusoidal_backward: grad is on ",
              grad.device(), " but tokens are on ", tokens.device());
  TORCH_CHECK(num_weights >= 0, "embed_sinusoidal_backward: num_weights must be >= 0, got ",
              num_weights);
  TORCH_CHECK(padding_idx == -1 || (padding_idx >= 0 && padding_idx < num_weights),
              "embed_sinusoidal_backward: padding_idx must be -1 (none) or in [0, ", num_weights,
              "), got ", padding_idx);
}

void check_add_sinusoidal_args(const at::Tensor& x, int64_t pos_offset) {
  TORCH_CHECK(is_kernel_float(x.scalar_type()),
              "add_sinusoidal: x must be floating point (float32, float16, bfloat16, float64), got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() >= 2, "add_sinusoidal: x must be (..., L, d_model), got a ", x.dim(),
              "-D tensor");
  TORCH_CHECK(x.size(-1) % 2 == 0,
              "add_sinusoidal: d_model must be even for the sinusoidal encoding, got ",
              x.size(-1));
  TORCH_CHECK(pos_offset >= 0, "add_sinusoidal: pos_offset must be >= 0, got ", pos_offset);
  TORCH_CHECK(pos_offset <= sinusoid::kMaxPositions - x.size(-2),
              "add_sinusoidal: positions must be below ", sinusoid::kMaxPositions,
              " (2^29, where the float sinusoid stops being accurate), got pos_offset ", pos_offset,
              " and L ", x.size(-2));
}

// TORCH_CHECK naming the first out-of-range id of tokens (B, L), contiguous on the CPU, and where
// it sits; one cheap serial pass.
void check_token_ids(const at::Tensor& tokens, int64_t V, const char* op) {
  const int64_t N = tokens.numel(), L = std::max<int64_t>(tokens.size(1), 1);
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "check_token_ids", [&] {
    const index_t* ids = tokens.const_data_ptr<index_t>();
    for (int64_t n = 0; n < N; ++n) {
      const int64_t v = static_cast<int64_t>(ids[n]);
      TORCH_CHECK(v >= 0 && v < V, op, ": token id ", v, " at tokens[", n / L, ", ", n % L,
                  "] is out of range for weight with ", V, " rows (valid ids are 0..", V - 1, ")");
    }
  });
}

namespace {

// --------------------------------------------------------------------------------------------
// PE on the fly: w_i and sin/cos of the angle come from csrc/sinusoid.h (shared with CUDA).
// --------------------------------------------------------------------------------------------

using sinusoid::inv_freq;
using sinusoid::sincos_angle;

// One PE row, pe[0:d] for position p, from the per-column frequencies freq[0:d/2].
inline void pe_row(int64_t p, const double* freq, int64_t d, float* pe) {
  const double pd = static_cast<double>(p);
  for (int64_t i = 0; i < d / 2; ++i) {
    sincos_angle(pd * freq[i], &pe[2 * i], &pe[2 * i + 1]);
  }
}

// --------------------------------------------------------------------------------------------
// CPU kernels
// --------------------------------------------------------------------------------------------

// out[r, :] = src[row(r), :] * scale (+ PE(pos_offset + r % L)) for the R = B * L rows of out,
// row(r) = tokens[r] when tokens is given (the embedding), else r (add_sinusoidal).
// Rows are visited position-major (r' = j * B + b), so a thread computes each PE row once into
// an L1-sized buffer and applies it to the B rows at that position: the PE work is L * d / 2
// sin/cos pairs, not B * L * d / 2.
template <typename scalar_t, typename index_t>
void embed_fwd_cpu_kernel(const index_t* tokens,  // (B * L,) token ids, or nullptr
                          const scalar_t* src,     // (V, d) weight, or (B * L, d) x
                          int64_t stride_src_row,  // elements between rows of src
                          scalar_t* out,           // (B * L, d) contiguous
                          int64_t B, int64_t L, int64_t d, double scale, int64_t pos_offset,
                          bool add_pe) {
  using opmath_t = at::opmath_type<scalar_t>;
  std::vector<double> freq(add_pe ? d / 2 : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(freq.size()); ++i) freq[i] = inv_freq(2 * i, d);
  const opmath_t s = static_cast<opmath_t>(scale);
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(d, 1));
  at::parallel_for(0, B * L, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> pe(add_pe ? d : 0);
    int64_t pe_pos = -1;  // the position whose PE row is in `pe`
    for (int64_t rr = begin; rr < end; ++rr) {
      const int64_t j = rr / B, b = rr % B;
      const int64_t r = b * L + j;
      const scalar_t* in = src + (tokens ? static_cast<int64_t>(tokens[r]) : r) * stride_src_row;
      scalar_t* o = out + r * d;
      if (add_pe) {
        if (j != pe_pos) {
          pe_row(pos_offset + j, freq.data(), d, pe.data());
          pe_pos = j;
        }
        for (int64_t c = 0; c < d; ++c) {
          o[c] = static_cast<scalar_t>(static_cast<opmath_t>(in[c]) * s + pe[c]);
        }
      } else {
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<scalar_t>(static_cast<opmath_t>(in[c]) * s);
      }
    }
  });
}

// acc[v, :] += grad[n, :] for each n with tokens[n] == v != padding_idx, n ascending. Parallel
// over blocks of 16 columns (64 bytes of float, so threads seldom share a cache line of acc),
// each column summed by one thread in token order: bit-identical for any number of threads.
template <typename scalar_t, typename index_t, typename acc_t>
void embed_bwd_cpu_kernel(const scalar_t* grad,  // (N, d) contiguous
                          const index_t* tokens,  // (N,)
                          acc_t* acc,             // (V, d) zeros
                          int64_t N, int64_t d, int64_t padding_idx) {
  constexpr int64_t kCols = 16;
  at::parallel_for(0, (d + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kCols, c1 = std::min(d, end * kCols);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t v = static_cast<int64_t>(tokens[n]);
      if (v == padding_idx) continue;
      acc_t* a = acc + v * d;
      const scalar_t* g = grad + n * d;
      for (int64_t c = c0; c < c1; ++c) a[c] += static_cast<acc_t>(g[c]);
    }
  });
}


// --------------------------------------------------------------------------------------------
// CPU impls
// --------------------------------------------------------------------------------------------

at::Tensor embed_sinusoidal_cpu(const at::Tensor& tokens_in, const at::Tensor& weight_in,
                                double scale, int64_t pos_offset, bool pos_encoding,
                                std::optional<int64_t> padding_idx) {
  check_embed_args(tokens_in, weight_in, pos_offset, pos_encoding, padding_idx);
  TORCH_INTERNAL_ASSERT(tokens_in.device().is_cpu() && weight_in.device().is_cpu());
  const at::Tensor tokens = tokens_in.contiguous();
  // Rows may be strided (a slice of a bigger table); only the columns must be contiguous.
  const at::Tensor weight = weight_in.stride(1) == 1 ? weight_in : weight_in.contiguous();
  const int64_t B = tokens.size(0), L = tokens.size(1), V = weight.size(0), d = weight.size(1);
  at::Tensor out = at::empty({B, L, d}, weight.options());
  if (B * L == 0) return out;
  check_token_ids(tokens, V, "embed_sinusoidal");
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "embed_sinusoidal_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(),
                                    "embed_sinusoidal_cpu", [&] {
      embed_fwd_cpu_kernel<scalar_t, index_t>(
          tokens.const_data_ptr<index_t>(), weight.const_data_ptr<scalar_t>(), weight.stride(0),
          out.mutable_data_ptr<scalar_t>(), B, L, d, scale, pos_offset, pos_encoding);
    });
  });
  return out;
}

at::Tensor embed_sinusoidal_backward_cpu(const at::Tensor& grad_in, const at::Tensor& tokens_in,
                                         int64_t num_weights, double scale, int64_t padding_idx) {
  check_embed_backward_args(grad_in, tokens_in, num_weights, padding_idx);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const int64_t N = tokens.numel(), d = grad.size(2);
  const auto acc_type = at::toOpMathType(grad.scalar_type());
  at::Tensor acc = at::zeros({num_weights, d}, grad.options().dtype(acc_type));
  check_token_ids(tokens, num_weights, "embed_sinusoidal_backward");
  AT_DISPATCH_INDEX_TYPES(tokens.scalar_type(), "embed_sinusoidal_backward_cpu", [&] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(),
                                    "embed_sinusoidal_backward_cpu", [&] {
      using opmath_t = at::opmath_type<scalar_t>;
      embed_bwd_cpu_kernel<scalar_t, index_t, opmath_t>(
          grad.const_data_ptr<scalar_t>(), tokens.const_data_ptr<index_t>(),
          acc.mutable_data_ptr<opmath_t>(), N, d, padding_idx);
    });
  });
  // Scale once, round once: scale * (sum of grads), as the CUDA kernel does.
  acc.mul_(scale);
  return acc.scalar_type() == grad.scalar_type() ? acc : acc.to(grad.scalar_type());
}

at::Tensor add_sinusoidal_cpu(const at::Tensor& x_in, int64_t pos_offset) {
  check_add_sinusoidal_args(x_in, pos_offset);
  const at::Tensor x = x_in.contiguous();
  const int64_t d = x.size(-1), L = x.size(-2);
  const int64_t B = L == 0 || d == 0 ? 0 : x.numel() / (L * d);  // all leading dims
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "add_sinusoidal_cpu",
                                  [&] {
    embed_fwd_cpu_kernel<scalar_t, int64_t>(nullptr, x.const_data_ptr<scalar_t>(), d,
                                            out.mutable_data_ptr<scalar_t>(), B, L, d, 1.0,
                                            pos_offset, /*add_pe=*/true);
  });
  return out;
}

}  // namespace

// The schema, once. padding_idx only changes the backward (that row gets no gradient), as in
// F.embedding; embed_sinusoidal_backward takes -1 for "none" so its schema stays plain ints.
TORCH_LIBRARY(scratchformer, m) {
  m.def("embed_sinusoidal(Tensor tokens, Tensor weight, float scale, int pos_offset, "
        "bool pos_encoding, int? padding_idx=None) -> Tensor");
  m.def("embed_sinusoidal_backward(Tensor grad, Tensor tokens, int num_weights, float scale, "
        "int padding_idx) -> Tensor");
  m.def("add_sinusoidal(Tensor x, int pos_offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(scratchformer, CPU, m) {
  m.impl("embed_sinusoidal", &embed_sinusoidal_cpu);
  m.impl("embed_sinusoidal_backward", &embed_sinusoidal_backward_cpu);
  m.impl("add_sinusoidal", &add_sinusoidal_cpu);
}

}  // namespace scratchformer

// An empty module: `import scratchformer._C` loads this library, which runs the registrations.
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
