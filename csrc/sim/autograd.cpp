// The autograd fallback of the sim device on a torch that does not register one for PrivateUse1
// (before 2.10, see compat.h): the one torch gives CPU and CUDA, so an op with no autograd
// kernel (c10d::barrier, c10d::_allgather_base_, ...) runs its device kernel and warns if a
// gradient is asked to flow through it, as it does on those devices.
#include "compat.h"

#if SIM_REGISTERS_AUTOGRAD_FALLBACK
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

TORCH_LIBRARY_IMPL(_, AutogradPrivateUse1, m) {
  m.fallback(torch::autograd::basicAutogradNotImplementedFallback());
}
#endif
