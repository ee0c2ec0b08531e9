// Shared helpers for omnitron's CPU kernels: float load/store for fp32/bf16/fp16/fp64 storage,
// a vectorisable exp, and a deterministic row partition for reductions across threads.
//
// Loops are written so gcc -O3 -march=native vectorises them (`#pragma omp simd` where a
// reduction needs it); all accumulation is in float (double for fp64 inputs).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace omnitron {

// Accumulation type: double for double storage, float otherwise.
template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };
template <typename T> using acc_t = typename Acc<T>::type;

template <typename T>
static inline acc_t<T> ld(T v) { return static_cast<acc_t<T>>(v); }

// bf16 -> float is a 16-bit shift; writing it on raw bits keeps the loop vectorisable.
template <>
inline float ld<at::BFloat16>(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
static inline T st(acc_t<T> v) { return static_cast<T>(v); }

// float -> bf16 with round-to-nearest-even; NaN stays NaN (quiet bit forced).
template <>
inline at::BFloat16 st<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  uint32_t rounded = bits + 0x7FFFu + ((bits >> 16) & 1u);
  uint16_t out = (f != f) ? static_cast<uint16_t>((bits >> 16) | 0x40u) : static_cast<uint16_t>(rounded >> 16);
  return at::BFloat16(out, at::BFloat16::from_bits());
}

// exp(x) for float, ~2 ulp, branch-free so `omp simd` loops vectorise (libm's expf does not
// vectorise without -ffast-math). Inputs below -87.3 flush to 0, above 88.7 give +inf.
static inline float fast_exp(float x) {
  const float hi = 88.7228391f, lo = -87.3365448f;
  float xc = x > hi ? hi : (x < lo ? lo : x);
  float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  float y = p * scale;
  y = x > hi ? INFINITY : (x < lo ? 0.0f : y);
  return x != x ? x : y;
}
static inline double fast_exp(double x) { return std::exp(x); }

// Work per task below which a loop runs on the calling thread (as ATen's GRAIN_SIZE): waking a
// second thread costs more than it saves for small tensors, and far more on a loaded machine.
constexpr int64_t kGrainElems = 32768;
static inline int64_t rows_grain(int64_t row_elems) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(row_elems, 1)); }

// Split [0, n) into `parts` contiguous chunks; chunk i is [begin(i), begin(i+1)).
struct Partition {
  int64_t n, parts;
  Partition(int64_t n_, int64_t max_parts) : n(n_), parts(std::max<int64_t>(1, std::min<int64_t>(n_, max_parts))) {}
  int64_t begin(int64_t i) const { return n * i / parts; }
};

static inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "omnitron._C: ", name, " must be a CPU tensor");
}

}  // namespace omnitron
