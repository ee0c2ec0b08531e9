// Declarations of omnitron's CPU kernels (bound in csrc/bindings.cpp).
#pragma once
#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace omnitron {
// Norms over the last dim of a contiguous [N, D] tensor; statistics returned in float32 [N].
// With a residual, h = x + residual is written (third/fourth output) and normalised (fused
// pre-norm residual add); the backward then adds dres (the gradient reaching h) into dx.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd(const at::Tensor& x, const at::Tensor& w, double eps,
                                                            const c10::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                                const at::Tensor& rstd, const c10::optional<at::Tensor>& dres);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, double eps,
    const c10::optional<at::Tensor>& residual);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                              const at::Tensor& w, const at::Tensor& mean,
                                                              const at::Tensor& rstd, bool has_bias,
                                                              const c10::optional<at::Tensor>& dres);
// Gated activations: x [N, 2F] -> [N, F]; kind 0 = silu (SwiGLU), 1 = tanh-gelu (GeGLU).
at::Tensor glu_fwd(const at::Tensor& x, int64_t kind);
at::Tensor glu_bwd(const at::Tensor& dy, const at::Tensor& x, int64_t kind);
// Rotary embedding on contiguous t [A, B, H, D]; cos/sin float32 views [A, B, H, R/2] (any strides).
at::Tensor rope_apply(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, bool interleaved);
// Cross-entropy over logits [N, V] holding global vocabulary ids [start, start + V) of which the
// first `valid` columns are real (the rest padding); targets are global ids in [0, vocab).
// stats: float32 [4, N] = (max, sum exp(x - max), target logit or 0, sum x) over valid columns.
at::Tensor cross_entropy_stats(const at::Tensor& logits, const at::Tensor& target, int64_t start, int64_t valid,
                               int64_t vocab);
at::Tensor cross_entropy_grad(const at::Tensor& dloss, const at::Tensor& logits, const at::Tensor& target,
                              const at::Tensor& lse, int64_t start, int64_t valid, int64_t vocab,
                              double label_smoothing, const c10::optional<at::Tensor>& out);
// Multi-tensor AdamW (float32 params/moments; grads float32 or bf16/fp16), in place.
void adamw_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                std::vector<at::Tensor> exp_avg_sqs, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay);
at::Tensor grad_norm_sq(std::vector<at::Tensor> tensors);
}  // namespace omnitron
