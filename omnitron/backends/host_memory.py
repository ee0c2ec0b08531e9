"""Host memory for device copies: pinned where the accelerator's runtime can pin, pageable otherwise.

Shared by checkpoint staging (:mod:`omnitron.core.checkpoint.dist_staging`) and activation offloading
(:mod:`omnitron.core.transformer.offload`); it lives with the backends because pinning is a runtime service.
"""
from __future__ import annotations

import torch


def host_buffer(n: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """``n`` elements of host memory, pinned when asked and the accelerator's runtime can pin."""
    if pin:
        try:
            return torch.empty(n, dtype=dtype, pin_memory=True)
        except RuntimeError:  # a device without a pinned-memory allocator: pageable memory, synchronous copies
            pass
    return torch.empty(n, dtype=dtype)
