// Feature tests of the torch the extension is compiled against (torch/version.h), one macro per
// API whose presence depends on the version, so every supported torch (setup.py's range) builds
// the path that exists there. ``omnitron._sim.build_features()`` reports the choices made.
#pragma once

#include <torch/version.h>

#define SIM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10d::Backend::setTimeout became a virtual of the base class in torch 2.9 (pytorch#158128);
// before it, an override of it does not compile.
#define SIM_BACKEND_HAS_SET_TIMEOUT SIM_TORCH_AT_LEAST(2, 9)

// torch registers the autograd fallback for AutogradPrivateUse1 itself from 2.10 on (pytorch#165315);
// before it a PrivateUse1 extension registers one, or every op without an autograd kernel (the c10d
// collectives among them) fails with "Could not run ... from the 'Autograd<device>' backend".
#define SIM_REGISTERS_AUTOGRAD_FALLBACK (!SIM_TORCH_AT_LEAST(2, 10))

// The collectives' options carry ``asyncOp`` (the Python call's ``async_op``) from torch 2.9 on at the latest
// (2.9.1 is where torch_musa's MCCL starts returning no work for synchronous calls); before it a backend
// cannot tell a synchronous call, so the sim collectives always return their work there.
#define SIM_OPTIONS_HAVE_ASYNC_OP SIM_TORCH_AT_LEAST(2, 9)
