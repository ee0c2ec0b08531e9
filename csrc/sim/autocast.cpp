// Autocast for the sim device: the same op policies torch gives CUDA (lower precision for GEMMs and
// convolutions, fp32 for reductions and losses, promotion for mixed-input ops), from torch's own op
// lists, so ``torch.autocast("sim", bf16)`` behaves as on a GPU. Ops not listed fall through.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace at::autocast {

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define SIM_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define SIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define SIM_FP32_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define SIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(SIM_LOWER)
  AT_FORALL_FP32(SIM_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(SIM_FP32_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(SIM_PROMOTE)
#undef SIM_LOWER
#undef SIM_FP32
#undef SIM_FP32_OPT_DTYPE
#undef SIM_PROMOTE
}

}  // namespace at::autocast
