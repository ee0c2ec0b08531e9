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

// h = x + res rounded to the storage type (as the unfused reference does); returns h.
template <typename T>
const T* add_rows(const T* x, const T* res, T* h, int64_t d) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) h[j] = st<T>(ld(x[j]) + ld(res[j]));
  return h;
}

template <typename T>
void rms_fwd_kernel(const T* x, const T* res, T* h, const acc_t<T>* w, T* y, float* rstd, int64_t n, int64_t d,
                    double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = res ? add_rows(x + i * d, res + i * d, h + i * d, d) : x + i * d;
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
void rms_bwd_kernel(const T* dy, const T* x, const acc_t<T>* w, const float* rstd, const T* dres, T* dx,
                    acc_t<T>* dw, int64_t n, int64_t d) {
  using A = acc_t<T>;
  Partition part(n, std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, n * d / kGrainElems)));
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
          A extra = dres ? ld(dres[i * d + j]) : A(0);
          dxr[j] = st<T>(g * w[j] * r - xv * c + extra);
          acc[j] += g * xv * r;
        }
      }
    }
  });
  for (int64_t p = 0; p < part.parts; ++p)
    for (int64_t j = 0; j < d; ++j) dw[j] += buf[p * d + j];
}

template <typename T>
void ln_fwd_kernel(const T* x, const T* res, T* h, const acc_t<T>* w, const acc_t<T>* bias, T* y, float* mean,
                   float* rstd, int64_t n, int64_t d, double eps) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = res ? add_rows(x + i * d, res + i * d, h + i * d, d) : x + i * d;
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
void ln_bwd_kernel(const T* dy, const T* x, const acc_t<T>* w, const float* mean, const float* rstd, const T* dres,
                   T* dx, acc_t<T>* dw, acc_t<T>* db, int64_t n, int64_t d) {
  using A = acc_t<T>;
  Partition part(n, std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, n * d / kGrainElems)));
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
          A extra = dres ? ld(dres[i * d + j]) : A(0);
          dxr[j] = st<T>(r * (gy * w[j] - sg - xh * sgx) + extra);
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

namespace {
// Optional tensor checked to match x (shape, dtype, contiguous); null pointer when absent.
template <typename T>
const T* opt_like(const c10::optional<at::Tensor>& t, const at::Tensor& x, const char* what) {
  if (!t.has_value() || !t->defined()) return nullptr;
  TORCH_CHECK(t->sizes() == x.sizes() && t->scalar_type() == x.scalar_type() && t->is_contiguous(),
              "omnitron._C norms: ", what, " must match x (shape, dtype, contiguous)");
  return t->data_ptr<T>();
}
}  // namespace

// Returns (y, rstd, h): h = x + residual when a residual is given (then normalised), else undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps,
                                                            const c10::optional<at::Tensor>& residual) {
  check_rows(x, w);
  auto y = at::empty_like(x);
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor h = has_res ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_fwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    rms_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), opt_like<scalar_t>(residual, x, "residual"),
                             has_res ? h.data_ptr<scalar_t>() : nullptr, wf.data_ptr<acc_t<scalar_t>>(),
                             y.data_ptr<scalar_t>(), rstd.data_ptr<float>(), x.size(0), x.size(1), eps);
  });
  return {y, rstd, h};
}

// x is the normalised input (h for the residual form); dres, when given, is added to dx
// (the gradient reaching h directly through the residual stream).
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& rstd, const c10::optional<at::Tensor>& dres) {
  check_rows(x, w);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.is_contiguous() && dy.scalar_type() == x.scalar_type(),
              "omnitron._C rms_norm_bwd: dy must match x (shape, dtype, contiguous)");
  auto dx = at::empty_like(x);
  at::Tensor dw;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_bwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    dw = at::zeros({x.size(1)}, wf.options());
    rms_bwd_kernel<scalar_t>(dy.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), wf.data_ptr<acc_t<scalar_t>>(),
                             rstd.data_ptr<float>(), opt_like<scalar_t>(dres, x, "dres"), dx.data_ptr<scalar_t>(),
                             dw.data_ptr<acc_t<scalar_t>>(), x.size(0), x.size(1));
  });
  return {dx, dw.to(w.scalar_type()).view(w.sizes())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, double eps,
    const c10::optional<at::Tensor>& residual) {
  check_rows(x, w);
  auto y = at::empty_like(x);
  auto mean = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  auto rstd = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  const bool has_res = residual.has_value() && residual->defined();
  at::Tensor h = has_res ? at::empty_like(x) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_norm_fwd", [&] {
    auto wf = w.to(acc_scalar<scalar_t>()).contiguous();
    at::Tensor bf;
    if (b.has_value() && b->defined()) bf = b->to(acc_scalar<scalar_t>()).contiguous();
    ln_fwd_kernel<scalar_t>(x.data_ptr<scalar_t>(), opt_like<scalar_t>(residual, x, "residual"),
                            has_res ? h.data_ptr<scalar_t>() : nullptr, wf.data_ptr<acc_t<scalar_t>>(),
                            bf.defined() ? bf.data_ptr<acc_t<scalar_t>>() : nullptr, y.data_ptr<scalar_t>(),
                            mean.data_ptr<float>(), rstd.data_ptr<float>(), x.size(0), x.size(1), eps);
  });
  return {y, mean, rstd, h};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                              const at::Tensor& w, const at::Tensor& mean,
                                                              const at::Tensor& rstd, bool has_bias,
                                                              const c10::optional<at::Tensor>& dres) {
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
                            mean.data_ptr<float>(), rstd.data_ptr<float>(), opt_like<scalar_t>(dres, x, "dres"),
                            dx.data_ptr<scalar_t>(), dw.data_ptr<acc_t<scalar_t>>(), db.data_ptr<acc_t<scalar_t>>(),
                            x.size(0), x.size(1));
  });
  return {dx, dw.to(w.scalar_type()).view(w.sizes()), has_bias ? db.to(w.scalar_type()).view(w.sizes()) : at::Tensor()};
}

}  // namespace omnitron
