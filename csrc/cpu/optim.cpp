// Multi-tensor AdamW step and sum of squares over lists of tensors. Work is cut into chunks of
// 32K elements across all tensors so threads stay busy whatever the tensor sizes.
#include "common.h"
#include "ops.h"

namespace omnitron {
namespace {

constexpr int64_t kChunk = 1 << 15;

struct Chunk { int64_t tensor, begin, end; };

std::vector<Chunk> make_chunks(const std::vector<at::Tensor>& ts) {
  std::vector<Chunk> out;
  for (int64_t i = 0; i < static_cast<int64_t>(ts.size()); ++i)
    for (int64_t b = 0; b < ts[i].numel(); b += kChunk) out.push_back({i, b, std::min(ts[i].numel(), b + kChunk)});
  return out;
}

// Both moments are blended toward their targets with weights w1 = 1 - beta1 and w2 = 1 - beta2 rounded once from
// double: 1.0f - float(beta) would carry beta's own float rounding (up to 3e-8), a relative error of 3e-4 in a
// weight of 1e-4 (beta2 = 0.9999), which biased v by that much against a float64 AdamW. The lerp form keeps the
// effective decay 1 - w consistent with the weight, so v stays unbiased in the warm-up and in the steady state.
template <typename G>
void adamw_chunk(float* p, const G* g, float* m, float* v, int64_t n, float decay, float w1, float w2, float bc2,
                 float eps, float step_size) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    float gj = ld(g[j]);
    float pj = p[j] * decay;
    float mj = m[j] + w1 * (gj - m[j]);
    float vj = v[j] + w2 * (gj * gj - v[j]);
    float denom = std::sqrt(vj / bc2) + eps;
    p[j] = pj + step_size * (mj / denom);
    m[j] = mj;
    v[j] = vj;
  }
}

template <typename T>
double sum_sq(const T* x, int64_t n) {
  acc_t<T> s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) { acc_t<T> xv = ld(x[j]); s += xv * xv; }
  return static_cast<double>(s);
}

}  // namespace

void adamw_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                std::vector<at::Tensor> exp_avg_sqs, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay) {
  const size_t k = params.size();
  TORCH_CHECK(grads.size() == k && exp_avgs.size() == k && exp_avg_sqs.size() == k,
              "omnitron._C adamw_step: params, grads, exp_avgs, exp_avg_sqs must have equal lengths");
  for (size_t i = 0; i < k; ++i) {
    for (const at::Tensor* t : {&params[i], &exp_avgs[i], &exp_avg_sqs[i]})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                  "omnitron._C adamw_step: params and moments must be contiguous float32 CPU tensors");
    TORCH_CHECK(grads[i].is_contiguous() && grads[i].numel() == params[i].numel(),
                "omnitron._C adamw_step: grad ", i, " must be contiguous with its parameter's size");
  }
  const float decay = static_cast<float>(1.0 - lr * weight_decay);
  const float bc2 = static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step)));
  const float step_size = static_cast<float>(-lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  const float w1 = static_cast<float>(1.0 - beta1), w2 = static_cast<float>(1.0 - beta2);
  auto chunks = make_chunks(params);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const Chunk& ch = chunks[c];
      float* p = params[ch.tensor].data_ptr<float>() + ch.begin;
      float* m = exp_avgs[ch.tensor].data_ptr<float>() + ch.begin;
      float* v = exp_avg_sqs[ch.tensor].data_ptr<float>() + ch.begin;
      const at::Tensor& g = grads[ch.tensor];
      const int64_t n = ch.end - ch.begin;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "adamw_step", [&] {
        if constexpr (std::is_same<scalar_t, double>::value) {
          TORCH_CHECK(false, "omnitron._C adamw_step: float64 gradients are not supported");
        } else {
          adamw_chunk<scalar_t>(p, g.data_ptr<scalar_t>() + ch.begin, m, v, n, decay, w1, w2, bc2, float(eps),
                                step_size);
        }
      });
    }
  });
}

at::Tensor grad_norm_sq(std::vector<at::Tensor> tensors) {
  for (auto& t : tensors) {
    check_cpu(t, "tensor");
    TORCH_CHECK(t.is_contiguous(), "omnitron._C grad_norm_sq: tensors must be contiguous");
  }
  auto chunks = make_chunks(tensors);
  std::vector<double> part(chunks.size(), 0.0);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const Chunk& ch = chunks[c];
      const at::Tensor& t = tensors[ch.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "grad_norm_sq", [&] {
        part[c] = sum_sq<scalar_t>(t.data_ptr<scalar_t>() + ch.begin, ch.end - ch.begin);
      });
    }
  });
  double total = 0.0;
  for (double s : part) total += s;
  return at::full({}, total, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace omnitron
