"""The sim device's own ``silu_backward``: one output, as a GPU's, not ATen's decomposition into six.

``silu_backward`` is a structured op: CPU, CUDA and MPS run its out-variant kernel (``silu_backward.grad_input``),
which writes one tensor. A device with no kernel of its own for the functional form gets its
``CompositeImplicitAutograd`` decomposition (``math_silu_backward``: a sigmoid, ``1 - sigmoid`` and four products,
each a full-size tensor) before the boxed fallback (csrc/sim/fallback.cpp) is asked. On sim a SwiGLU layer's
backward then held six ``[s, b, ffn]`` tensors at once where a GPU holds one (measured 2026-12-07: the step of a
4-layer h128 s128 Llama-style model 0.54 MiB, 6%, above the memory plan, whose probes run the host's kernel).
Registered here, the functional form allocates its output and calls the out variant, which the fallback hands to
the CPU kernel. (``mish_backward`` is decomposed the same way off CPU, CUDA and MPS, but has no out variant to hand
over; no model here uses Mish.) In Python, not csrc/sim/kernels.cpp: no rebuild of the extension."""
from __future__ import annotations

import torch

_LIBRARY: list = []  # the registration lives as long as the process


def _silu_backward(grad_output: torch.Tensor, self: torch.Tensor) -> torch.Tensor:
    result = torch.empty_like(self, dtype=torch.result_type(grad_output, self))
    return torch.ops.aten.silu_backward.grad_input(grad_output, self, grad_input=result)


def register(dispatch_key: str = "PrivateUse1") -> None:
    """Register the functional ``silu_backward`` for ``dispatch_key`` (idempotent)."""
    if not _LIBRARY:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("silu_backward", _silu_backward, dispatch_key)
        _LIBRARY.append(lib)
