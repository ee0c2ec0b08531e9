// RMSNorm and LayerNorm forward/backward over the last dim of a contiguous [N, D] tensor.
// One pass over each row in the forward (statistics in float, kept for the backward); the
// weight/bias gradients are reduced per thread chunk into float buffers, then summed in order
// (deterministic for a given thread count).
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

template <typename T>
at::ScalarType acc_scalar() { return std::is_same<T, double>::value ? at::kDouble : at::kFloat; }

template <typename T>
void rms_fwd_kernel(const T* x, const acc_t<T>* w, T* y, float* rstd, int64_t n, int64_t d, double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * d;
      A ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) { A v = ld(xr[j]); ss += v * v; }
      A r = A(1) / std::sqrt(ss / A(d) + A(eps));
      rstd[i] = static_cast<float>(r);
      T* yr = y + i * d;
#pragma omp simd
      for (int64_t j = 0; j < d; ++j) yr[j] = st<T>(ld(xr[j]) * r * w[j]);
    }
  });
}

template <typename T>
void rms_bwd_kernel(const T* dy, const T* x, const acc_t<T>* w, const float* rstd, T* dx, acc_t<T>* dw,
                    int64_t n, int64_t d) {
  using A = acc_t<T>;
  Partition part(n, at::get_num_threads());
  std::vector<A> buf(part.parts * d, A(0));
  at::parallel_for(0, part.parts, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      A* acc = buf.data() + p * d;
      for (int64_t i = part.begin(p); i < part.begin(p + 1); ++i) {
        const T* xr = x + i * d;
        const T* gr = dy + i * d;
        A r = rstd[i], dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < d; ++j) dot += ld(gr[j]) * w[j] * ld(xr[j]);
        A c = dot * r * r * r / A(d);
        T* dxr = dx + i * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
          A g = ld(gr[j]), xv = ld(xr[j]);
          dxr[j] = st<T>(g * w[j] * r - xv * c);
          acc[j] += g * xv * r;
        }
      }
    }
  });
  for (int64_t p = 0; p < part.parts; ++p)
    for (int64_t j = 0; j < d; ++j) dw[j] += buf[p * d + j];
}

template <typename T>
void ln_fwd_kernel(const T* x, const acc_t<T>* w, const acc_t<T>* bias, T* y, float* mean, float* rstd, int64_t n,
                   int64_t d, double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * d;
      A s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < d; ++j) s += ld(xr[j]);
      A mu = s / A(d), ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < d; ++j) { A v = ld(xr[j]) - mu; ss += v * v; }
      A r = A(1) / std::sqrt(ss / A(d) + A(eps));
      mean[i] = static_cast<float>(mu);
      rstd[i] = static_cast<float>(r);
      T* yr = y + i * d;
      if (bias) {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) yr[j] = st<T>((ld(xr[j]) - mu) * r * w[j] + bias[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) yr[j] = st<T>((ld(xr[j]) - mu) * r * w[j]);
      }
    }
  });
}

template <typename T>
void ln_bwd_kernel(const T* dy, const T* x, const acc_t<T>* w, const float* mean, const float* rstd, T* dx,
                   acc_t<T>* dw, acc_t<T>* db, int64_t n, int64_t d) {
  using A = acc_t<T>;
  Partition part(n, at::get_num_threads());
  std::vector<A> buf(part.parts * 2 * d, A(0));
  at::parallel_for(0, part.parts, 1, [&](int64_t pb, int64_t pe) {
    for (int64_t p = pb; p < pe; ++p) {
      A* aw = buf.data() + p * 2 * d;
      A* ab = aw + d;
      for (int64_t i = part.begin(p); i < part.begin(p + 1); ++i) {
        const T* xr = x + i * d;
        const T* gr = dy + i * d;
        A mu = mean[i], r = rstd[i], sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t j = 0; j < d; ++j) {
          A g = ld(gr[j]) * w[j];
          sg += g;
          sgx += g * (ld(xr[j]) - mu) * r;
        }
        sg /= A(d);
        sgx /= A(d);
        T* dxr = dx + i * d;
#pragma omp simd
        for (int64_t j = 0; j < d; ++j) {
          A gy = ld(gr[j]), xh = (ld(xr[j]) - mu) * r;
          dxr[j] = st<T>(r * (gy * w[j] - sg - xh * sgx));
          aw[j] += gy * xh;
          ab[j] += gy;
        }
      }
    }
  });
  for (int64_t p = 0; p < part.parts; ++p)
    for (int64_t j = 0; j < d; ++j) {
      dw[j] += buf[p * 2 * d + j];
      db[j] += buf[p * 2 * d + d + j];
    }
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "omnitron._C norms: x must be a contiguous [N, D] tensor");
  TORCH_CHECK(w.numel() == x.size(1), "omnitron._C norms: weight has ", w.numel(), " elements, expected ", x.size(1));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  auto y = at::empty_like(x);
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    rms_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), wf.data_ptr<acc_t<scalar_t>>(), y.data_ptr<scalar_t>(),
                             rstd.data_ptr<float>(), x.size(0), x.size(1), eps);
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& rstd) {
  check_rows(x, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "omnitron._C rms_norm_bwd: dy must match x (shape, dtype, contiguous)");
  auto dx = at::empty_like(x);
  at::Tensor dw;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    dw = at::zeros({x.size(1)}, wf.options());
    rms_bwd_kernel<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), wf.data_ptr<acc_t<scalar_t>>(),
                             rstd.data_ptr<float>(), dx.data_ptr<scalar_t>(), dw.data_ptr<acc_t<scalar_t>>(),
                             x.size(0), x.size(1));
  });
  return {dx, dw.to(w.scalar_type()).view(w.sizes())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(const at::Tensor& x, const at::Tensor& w,
                                                              const c10::optional<at::Tensor>& b, double eps) {
  check_rows(x, w);
  auto y = at::empty_like(x);
  auto mean = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_fwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    at::Tensor bf;
    if (b.has_value()) bf = b->to(acc_scalar<scalar_t>()).contiguous();
    ln_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), wf.data_ptr<acc_t<scalar_t>>(),
                            b.has_value() ? bf.data_ptr<acc_t<scalar_t>>() : nullptr, y.data_ptr<scalar_t>(),
                            mean.data_ptr<float>(), rstd.data_ptr<float>(), x.size(0), x.size(1), eps);
  });
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                              const at::Tensor& w, const at::Tensor& mean,
                                                              const at::Tensor& rstd, bool has_bias) {
  check_rows(x, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "omnitron._C layer_norm_bwd: dy must match x (shape, dtype, contiguous)");
  auto dx = at::empty_like(x);
  at::Tensor dw, db;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_bwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    dw = at::zeros({x.size(1)}, wf.options());
    db = at::zeros({x.size(1)}, wf.options());
    ln_bwd_kernel<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), wf.data_ptr<acc_t<scalar_t>>(),
                            mean.data_ptr<float>(), rstd.data_ptr<float>(), dx.data_ptr<scalar_t>(),
                            dw.data_ptr<acc_t<scalar_t>>(), db.data_ptr<acc_t<scalar_t>>(), x.size(0), x.size(1));
  });
  return {dx, dw.to(w.scalar_type()).view(w.sizes()), has_bias ? db.to(w.scalar_type()).view(w.sizes()) : at::Tensor()};
}

}  // namespace omnitron
