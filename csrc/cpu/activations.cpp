// Gated activations SwiGLU (silu(a) * b) and GeGLU (tanh-gelu(a) * b) for x = [a | b], [N, 2F] -> [N, F].
// The backward recomputes the activation from x instead of saving it (memory over one exp).
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// act(a) and d act / da, in float (double for fp64 storage).
template <typename A, int KIND>
static inline void act(A a, A& f, A& df) {
  if (KIND == 0) {  // silu
    A s = A(1) / (A(1) + fast_exp(-a));
    f = a * s;
    df = s * (A(1) + a * (A(1) - s));
  } else {  // gelu, tanh form: a * sigmoid(2u), u = k0 (a + k1 a^3)
    A u2 = A(2) * A(kGeluK0) * (a + A(kGeluK1) * a * a * a);
    A s = A(1) / (A(1) + fast_exp(-u2));
    f = a * s;
    df = s + a * s * (A(1) - s) * A(2) * A(kGeluK0) * (A(1) + A(3) * A(kGeluK1) * a * a);
  }
}

// KIND is a template parameter so the inner loop has no branch and vectorises.
template <typename T, int KIND>
void glu_fwd_kernel(const T* x, T* y, int64_t n, int64_t f) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(3 * f), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* a = x + i * 2 * f;
      const T* g = a + f;
      T* yr = y + i * f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        A v, dv;
        act<A, KIND>(ld(a[j]), v, dv);
        yr[j] = st<T>(v * ld(g[j]));
      }
    }
  });
}

template <typename T, int KIND>
void glu_bwd_kernel(const T* dy, const T* x, T* dx, int64_t n, int64_t f) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(3 * f), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* a = x + i * 2 * f;
      const T* g = a + f;
      const T* gy = dy + i * f;
      T* da = dx + i * 2 * f;
      T* dg = da + f;
#pragma omp simd
      for (int64_t j = 0; j < f; ++j) {
        A v, dv, up = ld(gy[j]);
        act<A, KIND>(ld(a[j]), v, dv);
        da[j] = st<T>(up * ld(g[j]) * dv);
        dg[j] = st<T>(up * v);
      }
    }
  });
}

}  // namespace

at::Tensor glu_fwd(const at::Tensor& x, int64_t kind) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "omnitron._C glu_fwd: x must be a contiguous [N, 2F] tensor");
  const int64_t f = x.size(1) / 2;
  auto y = at::empty({x.size(0), f}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "glu_fwd", [&] {
    if (kind == 0)
      glu_fwd_kernel<scalar_t, 0>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), f);
    else
      glu_fwd_kernel<scalar_t, 1>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), f);
  });
  return y;
}

at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, int64_t kind) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && dy.is_contiguous() && dy.size(0) == x.size(0) &&
                  dy.size(1) * 2 == x.size(1) && dy.scalar_type() == x.scalar_type(),
              "omnitron._C glu_bwd: dy [N, F] and x [N, 2F] must be contiguous with one dtype");
  auto dx = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "glu_bwd", [&] {
    if (kind == 0)
      glu_bwd_kernel<scalar_t, 0>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), x.size(0),
                                  dy.size(1));
    else
      glu_bwd_kernel<scalar_t, 1>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), x.size(0),
                                  dy.size(1));
  });
  return dx;
}

}  // namespace omnitron
