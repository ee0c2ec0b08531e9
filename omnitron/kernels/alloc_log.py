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
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}  # cdata -> (ref, creating event)
        self._old: dict[int, StorageWeakRef] = {}  # cdata -> ref: storages that existed before (never counted)

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.events.append((None, self._live.pop(key)[1]))

    def _see(self, t: torch.Tensor, op: str | None) -> None:
        """NOTE: only the storages created while active are swept before every op (their frees are events); one
        that existed before is dropped when its address comes back (then it was freed: nothing to log), so a
        probe's weights and inputs cost nothing per op."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._old and self._old[key].expired():
            del self._old[key]
        if key in self._live and self._live[key][0].expired():  # freed during this op, its address reused
            self._sweep()
        if key in self._live or key in self._old:
            return
        if op is None:
            self._old[key] = StorageWeakRef(storage)
        else:
            self._live[key] = (StorageWeakRef(storage), len(self.events))
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
