// The sinusoid of the positional encoding, in one place for the CPU kernel (csrc/embed.cpp) and
// the CUDA kernels (csrc/cuda/embed_kernels.cu):
//
//   PE[p, 2i] = sin(p * w_i),  PE[p, 2i+1] = cos(p * w_i),  w_i = 10000^(-2i / d_model)
//
// Only the C++ standard library here (no torch, no CUDA headers), so both compilers include it.
// Under nvcc the functions are __host__ __device__; the host compiler sees plain inline ones.
// Accuracy notes are in csrc/embed.cpp.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define SCRATCHFORMER_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SCRATCHFORMER_HOST_DEVICE inline
#endif

namespace scratchformer {
namespace sinusoid {

constexpr double kLn10000 = 9.210340371976184;    // log(10000)
constexpr double kTwoOverPi = 0.6366197723675814;  // 2 / pi
constexpr double kPio2Hi = 1.5707963267948966;     // pi / 2 rounded to double
constexpr double kPio2Lo = 6.123233995736766e-17;  // pi / 2 - kPio2Hi

// The positions the ops accept: p < kMaxPositions = 2^29 (the checks in csrc/embed.cpp, the fakes
// in scratchformer/_ext.py and op_checks.MAX_POSITIONS refuse the rest). sincos_angle rounds
// k * kPio2Hi in double, an error of up to half an ulp of the angle (6e-8 just below 2^29, w_0 = 1
// makes the angle the position): measured against the float64 table at positions 2^29 - 200,000 to
// 2^29 - 1, max error 9.0e-8 (2^30: 1.2e-7, 1e12: 6e-5). From about 1e16 r leaves [-pi/4, pi/4]
// and the polynomials return values far outside [-1, 1] (|PE| 5e5 at 1e17), and pos_offset + j can
// overflow int64.
constexpr int64_t kMaxPositions = int64_t{1} << 29;

// w_i for the column pair starting at `col` (even): exactly the float64 reference's formula.
SCRATCHFORMER_HOST_DEVICE double inv_freq(int64_t col, int64_t d) {
  return exp((-kLn10000 * static_cast<double>(col)) / static_cast<double>(d));
}

// sin and cos of angle >= 0 to float accuracy. angle = k * pi/2 + r with |r| <= pi/4: k and r
// in double (error ~ angle * 2^-53, 1e-11 at 1e5), then Cephes' sinf/cosf polynomials on r
// (relative error ~ 2^-24), then the quadrant k mod 4 picks and signs the pair. rint rounds to
// nearest even in the default rounding mode, as nearbyint does (host) and as the device's does.
SCRATCHFORMER_HOST_DEVICE void sincos_angle(double angle, float* s, float* c) {
  const double k = rint(angle * kTwoOverPi);
  const float r = static_cast<float>((angle - k * kPio2Hi) - k * kPio2Lo);
  const float z = r * r;
  const float sr = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * r + r;
  const float cr =
      ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z + 4.166664568298827e-2f) * z * z -
      0.5f * z + 1.0f;
  const int64_t q = static_cast<int64_t>(k) & 3;
  const float s0 = (q & 1) ? cr : sr;  // sin(r + q pi/2): sr, cr, -sr, -cr
  const float c0 = (q & 1) ? sr : cr;  // cos(r + q pi/2): cr, -sr, -cr, sr
  *s = (q & 2) ? -s0 : s0;
  *c = ((q + 1) & 2) ? -c0 : c0;
}

}  // namespace sinusoid
}  // namespace scratchformer

#undef SCRATCHFORMER_HOST_DEVICE
