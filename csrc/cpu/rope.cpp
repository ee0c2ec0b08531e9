// Rotary position embedding on a contiguous t [A, B, H, D]: rotates the first R = 2 * R/2 channels
// by angles given as float32 cos/sin views [A, B, H, R/2] (strides may be 0: broadcast positions),
// copies channels past R. The backward is the same kernel with sin negated (rotation by -angle).
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

template <typename T>
void rope_kernel(const T* t, T* out, const float* c, const float* s, const int64_t* shape, const int64_t* cst,
                 const int64_t* sst, int64_t half, bool interleaved) {
  using A = acc_t<T>;
  const int64_t a_n = shape[0], b_n = shape[1], h_n = shape[2], d = shape[3];
  const int64_t rows = a_n * b_n * h_n;
  at::parallel_for(0, rows, rows_grain(2 * d), [&](int64_t beg, int64_t end) {
    for (int64_t row = beg; row < end; ++row) {
      const int64_t h = row % h_n, b = (row / h_n) % b_n, a = row / (h_n * b_n);
      const float* cr = c + a * cst[0] + b * cst[1] + h * cst[2];
      const float* sr = s + a * sst[0] + b * sst[1] + h * sst[2];
      const T* x = t + row * d;
      T* y = out + row * d;
      if (interleaved) {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          A x1 = ld(x[2 * j]), x2 = ld(x[2 * j + 1]), cj = cr[j], sj = sr[j];
          y[2 * j] = st<T>(x1 * cj - x2 * sj);
          y[2 * j + 1] = st<T>(x2 * cj + x1 * sj);
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          A x1 = ld(x[j]), x2 = ld(x[j + half]), cj = cr[j], sj = sr[j];
          y[j] = st<T>(x1 * cj - x2 * sj);
          y[j + half] = st<T>(x2 * cj + x1 * sj);
        }
      }
      for (int64_t j = 2 * half; j < d; ++j) y[j] = x[j];
    }
  });
}

}  // namespace

at::Tensor rope_apply(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  check_cpu(t, "t");
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous(), "omnitron._C rope: t must be a contiguous 4-D tensor");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 4 &&
                  sin.dim() == 4 && cos.sizes() == sin.sizes(),
              "omnitron._C rope: cos/sin must be float32 4-D views of one shape");
  TORCH_CHECK(cos.stride(3) == 1 && sin.stride(3) == 1, "omnitron._C rope: cos/sin last dim must be contiguous");
  const int64_t half = cos.size(3);
  TORCH_CHECK(2 * half <= t.size(3), "omnitron._C rope: rotary dim ", 2 * half, " exceeds head dim ", t.size(3));
  for (int k = 0; k < 3; ++k)
    TORCH_CHECK(cos.size(k) == t.size(k), "omnitron._C rope: cos/sin must be expanded to t's leading dims");
  auto out = at::empty_like(t);
  int64_t shape[4] = {t.size(0), t.size(1), t.size(2), t.size(3)};
  int64_t cst[4], sst[4];
  for (int k = 0; k < 4; ++k) { cst[k] = cos.stride(k); sst[k] = sin.stride(k); }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "rope", [&] {
    rope_kernel<scalar_t>(t.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), cos.data_ptr<float>(),
                          sin.data_ptr<float>(), shape, cst, sst, half, interleaved);
  });
  return out;
}

}  // namespace omnitron
