// Softmax cross-entropy pieces over contiguous logits [N, V] (a whole vocabulary, or one
// tensor-parallel shard of it), read in their own dtype: no float32 copy of the logits is made.
// `stats` gives per-row partial statistics that combine across shards (max, then rescaled sums);
// `grad` writes d logits = dloss * (softmax - (1 - ls) * onehot(target) - ls / V) in one pass, into a new
// tensor or into `out`, which may be the logits themselves (the loss's backward then allocates nothing).
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

// Per row over the valid columns [0, valid) of a vocabulary shard starting at global id `start`:
// max, sum exp(x - max), the target's logit (0 when the target is in another shard), sum of x.
template <typename T>
void ce_stats_kernel(const T* x, const int64_t* tgt, float* stats, int64_t n, int64_t v, int64_t start, int64_t valid) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(v), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * v;
      A m = -INFINITY;
      // NaNs counted in an integer sum: a bool `||` reduction kept gcc from vectorising this loop (4x slower)
      int64_t nans = 0;
#pragma omp simd reduction(max : m) reduction(+ : nans)
      for (int64_t j = 0; j < valid; ++j) { A xv = ld(xr[j]); m = xv > m ? xv : m; nans += (xv != xv); }
      const bool nan = nans != 0;
      A mref = std::isinf(m) ? A(0) : m;  // all -inf (or +inf) rows: keep exp finite, result inf/nan as eager
      A s = 0, sx = 0;
#pragma omp simd reduction(+ : s, sx)
      for (int64_t j = 0; j < valid; ++j) { A xv = ld(xr[j]); s += fast_exp(xv - mref); sx += xv; }
      const int64_t t = tgt[i] - start;
      stats[i] = nan ? NAN : static_cast<float>(mref);
      stats[n + i] = static_cast<float>(s);
      stats[2 * n + i] = (t >= 0 && t < valid) ? static_cast<float>(ld(xr[t])) : 0.0f;
      stats[3 * n + i] = static_cast<float>(sx);
    }
  });
}

// d logits = dloss * (exp(x - lse) - ls / vocab - (1 - ls) [column is the target]); padding columns get 0.
template <typename T>
void ce_grad_kernel(const float* dloss, const T* x, const int64_t* tgt, const float* lse, T* dx, int64_t n, int64_t v,
                    int64_t start, int64_t valid, int64_t vocab, double ls) {
  using A = acc_t<T>;
  at::parallel_for(0, n, rows_grain(v), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const T* xr = x + i * v;
      T* dr = dx + i * v;
      const A g = dloss[i], l = lse[i], off = A(ls) / A(vocab);
      const int64_t t = tgt[i] - start;
      const bool here = t >= 0 && t < valid;
      const A xt = here ? ld(xr[t]) : A(0);  // read before the row is written: dx may alias x (in place)
#pragma omp simd
      for (int64_t j = 0; j < valid; ++j) dr[j] = st<T>(g * (fast_exp(ld(xr[j]) - l) - off));
      for (int64_t j = valid; j < v; ++j) dr[j] = st<T>(A(0));
      if (here) dr[t] = st<T>(g * (fast_exp(xt - l) - off - (A(1) - A(ls))));
    }
  });
}

void check_shard(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid, int64_t vocab) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "omnitron._C cross_entropy: logits must be contiguous [N, V]");
  TORCH_CHECK(target.scalar_type() == at::kLong && target.dim() == 1 && target.size(0) == logits.size(0) &&
                  target.is_contiguous(),
              "omnitron._C cross_entropy: target must be a contiguous int64 [N] tensor");
  TORCH_CHECK(valid >= 0 && valid <= logits.size(1) && start >= 0,
              "omnitron._C cross_entropy: need 0 <= valid <= shard width and start >= 0");
  const int64_t* t = target.data_ptr<int64_t>();
  for (int64_t i = 0; i < target.size(0); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < vocab, "omnitron._C cross_entropy: target ", t[i], " at row ", i,
                " is outside [0, ", vocab, ")");
}

}  // namespace

at::Tensor cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid,
                               int64_t vocab) {
  check_shard(logits, target, start, valid, vocab);
  auto stats = at::empty({4, logits.size(0)}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_stats", [&] {
    ce_stats_kernel<scalar_t>(logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(), stats.data_ptr<float>(),
                              logits.size(0), logits.size(1), start, valid);
  });
  return stats;
}

at::Tensor cross_entropy_grad(const at::Tensor& dloss, const at::Tensor& logits, const at::Tensor& target,
                              const at::Tensor& lse, int64_t start, int64_t valid, int64_t vocab,
                              double label_smoothing, const c10::optional<at::Tensor>& out) {
  check_shard(logits, target, start, valid, vocab);
  TORCH_CHECK(dloss.scalar_type() == at::kFloat && dloss.is_contiguous() && dloss.numel() == logits.size(0) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == logits.size(0),
              "omnitron._C cross_entropy_grad: dloss and lse must be contiguous float32 [N]");
  // `out` (optional) receives the gradient; it may be `logits` itself (each element is read before it is written)
  TORCH_CHECK(!out.has_value() || (out->sizes() == logits.sizes() && out->scalar_type() == logits.scalar_type() &&
                                   out->is_contiguous() && out->device() == logits.device()),
              "omnitron._C cross_entropy_grad: out must be a contiguous tensor of the logits' shape and dtype");
  auto dx = out.has_value() ? *out : at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_grad", [&] {
    ce_grad_kernel<scalar_t>(dloss.data_ptr<float>(), logits.data_ptr<scalar_t>(), target.data_ptr<int64_t>(),
                             lse.data_ptr<float>(), dx.data_ptr<scalar_t>(), logits.size(0), logits.size(1), start,
                             valid, vocab, label_smoothing);
  });
  return dx;
}

}  // namespace omnitron
