"""Measured activation bytes: what autograd actually keeps for backward during a forward.

The reference the memory model's activation term is checked against (tests/plan, BENCHMARKS.md).
``saved_tensors_hooks`` sees every tensor an autograd node saves; tensors are deduplicated by their
storage (a tensor saved by two nodes, or several views of one buffer, is held once) and parameters'
storages are left out (they are counted as parameters, not activations).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class SavedBytes:
    """Bytes of the distinct storages saved for backward inside :meth:`record`."""

    def __init__(self, exclude=()) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.exclude:
                self.storages[ptr] = max(self.storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    @contextmanager
    def record(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.storages.values())
