// Python bindings of omnitron's C++ kernels (module omnitron._C, or omnitron_C when JIT-built).
#include <torch/extension.h>

#include "cpu/ops.h"

// The digest of the sources this build compiled (omnitron/kernels/sources.py passes it as a bare token):
// nodes compare it, so a wheel and a JIT build of the same sources agree.
#define OMNITRON_STRINGIFY_(x) #x
#define OMNITRON_STRINGIFY(x) OMNITRON_STRINGIFY_(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "omnitron fused CPU kernels (OpenMP, vectorised, float accumulation)";
  m.def("rms_norm_fwd", &omnitron::rms_norm_fwd);
  m.def("rms_norm_bwd", &omnitron::rms_norm_bwd);
  m.def("layer_norm_fwd", &omnitron::layer_norm_fwd);
  m.def("layer_norm_bwd", &omnitron::layer_norm_bwd);
  m.def("glu_fwd", &omnitron::glu_fwd);
  m.def("glu_bwd", &omnitron::glu_bwd);
  m.def("rope_apply", &omnitron::rope_apply);
  m.def("cross_entropy_stats", &omnitron::cross_entropy_stats);
  m.def("cross_entropy_grad", &omnitron::cross_entropy_grad);
  m.def("adamw_step", &omnitron::adamw_step);
  m.def("grad_norm_sq", &omnitron::grad_norm_sq);
#ifdef OMNITRON_SOURCE_DIGEST
  m.attr("source_digest") = OMNITRON_STRINGIFY(OMNITRON_SOURCE_DIGEST);
#endif
}
