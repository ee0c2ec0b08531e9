"""Count the ATen operators a piece of code dispatches, and flag those that wait on the device; record the largest
tensor it makes (:class:`LargestTensor`).

Used by the FP8 overhead tests and ``benchmarks/fp8_profile.py``: operator counts are a
device-independent proxy for launch overhead, and a host sync on a hot path stalls a GPU pipeline.
"""
from __future__ import annotations

import collections

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "allclose", "unique",
                      "masked_select", "_assert_async", "repeat_interleave"})
"""ATen operators whose result needs a device value on the host (a device -> host wait on a GPU).
``repeat_interleave`` syncs only with a tensor of repeats; it is listed to be safe."""


class OpCounter(TorchDispatchMode):
    """Counts ATen operators (by overload packet name) dispatched inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> dict[str, int]:
        """Host-syncing operators seen, with their counts."""
        return {k: v for k, v in self.counts.items() if k in SYNC_OPS}


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op makes (forward and backward on this thread): how tests bound
    the memory of a path that must not build a large intermediate (``[s, s]`` attention scores)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out
