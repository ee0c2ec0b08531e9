// Softmax cross-entropy with label smoothing over contiguous logits [N, V], in the logits' dtype:
// no float32 copy of the logits is ever made. Forward keeps the per-row log-sum-exp (float32 [N]);
// the backward writes d logits = dloss * (softmax - (1 - ls) * onehot(target) - ls / V) in one pass.
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

template <typename T>
void ce_fwd_kernel(const T* x, const int64_t* tgt, float* loss, float* lse_out, int64_t n, int64_t v, double ls) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(v), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * v;
      A m = -INFINITY;
      bool nan = false;
#pragma omp simd reduction(max : m) reduction(|| : nan)
      for (int64_t j = 0; j < v; ++j) { A xv = ld(xr[j]); m = xv > m ? xv : m; nan = nan || (xv != xv); }
      A mref = std::isinf(m) ? A(0) : m;  // all -inf (or +inf) rows: keep exp finite, result inf/nan as eager
      A s = 0, sx = 0;
#pragma omp simd reduction(+ : s, sx)
      for (int64_t j = 0; j < v; ++j) { A xv = ld(xr[j]); s += fast_exp(xv - mref); sx += xv; }
      A lse = mref + std::log(s);
      if (nan) lse = NAN;
      A nll = lse - ld(xr[tgt[i]]);
      A out = ls > 0 ? (A(1) - A(ls)) * nll + A(ls) * (lse - sx / A(v)) : nll;
      loss[i] = static_cast<float>(out);
      lse_out[i] = static_cast<float>(lse);
    }
  });
}

template <typename T>
void ce_bwd_kernel(const float* dloss, const T* x, const int64_t* tgt, const float* lse, T* dx, int64_t n, int64_t v,
                   double ls) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(v), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * v;
      T* dr = dx + i * v;
      const A g = dloss[i], l = lse[i], off = A(ls) / A(v);
#pragma omp simd
      for (int64_t j = 0; j < v; ++j) dr[j] = st<T>(g * (fast_exp(ld(xr[j]) - l) - off));
      const int64_t t = tgt[i];
      dr[t] = st<T>(g * (fast_exp(ld(xr[t]) - l) - off - (A(1) - A(ls))));
    }
  });
}

void check_targets(const at::Tensor& logits, const at::Tensor& target) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "omnitron._C cross_entropy: logits must be contiguous [N, V]");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == logits.size(0) &&
                  target.is_contiguous(),
              "omnitron._C cross_entropy: target must be a contiguous int64 [N] tensor");
  const int64_t* t = target.data_ptr<int64_t>();
  const int64_t v = logits.size(1);
  for (int64_t i = 0; i < target.size(0); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < v, "omnitron._C cross_entropy: target ", t[i], " at row ", i,
                " is outside [0, ", v, ")");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits, const at::Tensor& target,
                                                     double label_smoothing) {
  check_targets(logits, target);
  auto loss = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_fwd", [&] {
    ce_fwd_kernel<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), loss.data_ptr<float>(),
                            lse.data_ptr<float>(), logits.size(0), logits.size(1), label_smoothing);
  });
  return {loss, lse};
}

at::Tensor cross_entropy_bwd(const at::Tensor& dloss, const at::Tensor& logits, const at::Tensor& target,
                             const at::Tensor& lse, double label_smoothing) {
  check_targets(logits, target);
  TORCH_CHECK(dloss.scalar_type() == at::kFloat && dloss.is_contiguous() && dloss.numel() == logits.size(0),
              "omnitron._C cross_entropy_bwd: dloss must be contiguous float32 [N]");
  auto dx = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_bwd", [&] {
    ce_bwd_kernel<scalar_t>(dloss.data_ptr<float>(), logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(),
                            lse.data_ptr<float>(), dx.data_ptr<scalar_t>(), logits.size(0), logits.size(1),
                            label_smoothing);
  });
  return dx;
}

}  // namespace omnitron
