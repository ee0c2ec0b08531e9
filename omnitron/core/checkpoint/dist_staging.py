"""Host staging buffers for ``--async-save``: allocated once, refilled in place at every save.

A fresh host copy of the state at each save pays for the allocation and for the first touch of every
page (the kernel zeroes each 4 KiB page on its first write; for a 629 MiB snapshot that is most of the
time the step waits), then frees it again. :class:`Staging` allocates the buffers once -- before the
first step (``checkpointing.prepare_saves``), every page touched there -- and every save only copies
into them (``copy_``), like DCP's own staging with cached buffers.

Size: exactly the bytes of the pieces this rank writes (its share of the weights and of the optimizer
state: at most one copy of the rank's own state), held for the run. Pieces that tile a range of one
storage -- the weights in the data-parallel wrapper's flat parameter buffer, the slices of one
flat optimizer buffer -- are staged as one flat buffer and copied as one ``copy_`` per run of abutting
pieces; the staged pieces are views of it (DCP writes them without a copy:
:func:`~omnitron.core.checkpoint.dist_planner.exact_storage`). Other pieces (non-contiguous views)
get a buffer each. On a device, the buffers are pinned host memory and the copies are asynchronous,
waited for once.
"""
from __future__ import annotations

import torch

from omnitron.backends.host_memory import host_buffer
from omnitron.core.checkpoint.dist_planner import Pieces


def _signature(pieces: Pieces) -> tuple:
    """What the staging depends on: every piece's key, offsets, shape, strides, dtype and memory."""
    return tuple((k, shape, tuple((off, tuple(v.shape), v.stride(), v.dtype, v.device, v.data_ptr()) for off, v in ps))
                 for k, (shape, ps) in pieces.items())


def _runs(views: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``views`` grouped into runs that abut in memory: contiguous views of one storage, one
    dtype and device, each starting where the previous one ends. Views that fit no run are alone."""
    order, runs = [], []
    for i, v in enumerate(views):
        if v.is_contiguous() and v.numel():
            order.append(i)
        else:
            runs.append([i])
    order.sort(key=lambda i: (views[i].untyped_storage().data_ptr(), views[i].data_ptr()))
    for i in order:
        v, last = views[i], (runs[-1] if runs else None)
        prev = views[last[-1]] if last else None
        if prev is not None and prev.is_contiguous() and prev.numel() and prev.dtype == v.dtype \
                and prev.device == v.device and prev.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() \
                and prev.data_ptr() + prev.nbytes == v.data_ptr():
            last.append(i)
        else:
            runs.append([i])
    return runs


class Staging:
    """Host buffers holding one copy of a piece table (see the module docstring)."""

    def __init__(self, pieces: Pieces, *, pin: bool = False) -> None:
        self.signature = _signature(pieces)
        refs = [(k, j) for k, (_, ps) in pieces.items() for j in range(len(ps))]
        views = [pieces[k][1][j][1].detach() for k, j in refs]
        staged: list[torch.Tensor | None] = [None] * len(views)
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, live source) per run
        for run in _runs(views):
            first = views[run[0]]
            n = sum(views[i].numel() for i in run)
            buf = host_buffer(n, first.dtype, pin=pin and first.device.type != "cpu")
            buf.zero_()  # touch every page now, not in the first save
            src = first.as_strided((n,), (1,), first.storage_offset()) if len(run) > 1 else first
            self.copies.append((buf if len(run) > 1 else buf.view(first.shape), src))
            at = 0
            for i in run:
                staged[i] = buf[at:at + views[i].numel()].view(views[i].shape)
                at += views[i].numel()
        self.pieces: Pieces = {k: (shape, []) for k, (shape, _) in pieces.items()}
        for (k, j), t in zip(refs, staged):
            self.pieces[k][1].append((pieces[k][1][j][0], t))
        self.nbytes = sum(buf.nbytes for buf, _ in self.copies)

    def matches(self, pieces: Pieces) -> bool:
        """Whether ``pieces`` are the tensors this staging was built for (same memory, shapes, dtypes)."""
        return _signature(pieces) == self.signature

    def stage(self, synchronize=None) -> Pieces:
        """Copy the live tensors into the buffers; returns the staged piece table (valid until the next
        call). ``synchronize``: the device's, when a source is on one (the copies are asynchronous there)."""
        on_device = False
        with torch.no_grad():
            for buf, src in self.copies:
                on_device |= src.device.type != "cpu"
                buf.copy_(src, non_blocking=src.device.type != "cpu")
        if on_device and synchronize is not None:
            synchronize()
        return self.pieces
