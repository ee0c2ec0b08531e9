"""A log of the storages ops create and free, in order, on any device (a dispatch mode).

The memory plan replays such logs (omnitron/plan/transients.py) and the benchmarks take their peak
(``PeakTracker`` in omnitron/kernels/benchmark.py). A storage is followed through a weak reference to it,
not to the tensors viewing it: it is freed when the last holder, Python or autograd, lets it go, and an
address the allocator hands out again is a new storage.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class Timeline(TorchDispatchMode):
    """The storages ops create while active, in order: ``events`` holds ``(op, bytes)`` for a new storage
    and ``(None, index of the event that created it)`` once it is freed. Storages that existed before
    are never counted.

    A storage is followed by a weak reference to it (not to the tensors viewing it), checked before every
    op: it is freed when the last tensor, Python or autograd's, lets it go, and an address the allocator
    hands out again is a new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str | None, int]] = []
        self._live: dict[int, tuple[StorageWeakRef, int | None]] = {}  # cdata -> (ref, creating event or None)

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            born = self._live.pop(key)[1]
            if born is not None:
                self.events.append((None, born))

    def _see(self, t: torch.Tensor, op: str | None) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._live and self._live[key][0].expired():  # freed during this op, its address reused
            self._sweep()
        if key not in self._live:
            self._live[key] = (StorageWeakRef(storage), None if op is None else len(self.events))
            if op is not None:
                self.events.append((op, storage.nbytes()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._see(t, None)
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, str(func))
        return out

    def __exit__(self, *exc):
        self._sweep()
        return super().__exit__(*exc)


def peak(events: list[tuple[str | None, int]], sizes: list[float] | None = None) -> float:
    """Peak of the live bytes replaying ``events`` (with each creation's bytes replaced by ``sizes``)."""
    live = top = 0.0
    for i, (op, n) in enumerate(events):
        if op is None:
            live -= sizes[n] if sizes is not None else events[n][1]
        else:
            live += sizes[i] if sizes is not None else n
            top = max(top, live)
    return top
