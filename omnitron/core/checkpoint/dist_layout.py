"""Where a rank's tensors sit in layout-independent global tensors (for ``--ckpt-format torch_dist``).

PyTorch's distributed checkpoint (DCP) stores every tensor as a global tensor of fixed shape with
each writer's part as a box (offsets, sizes). This module maps what a rank holds to such boxes
without communication, from the parameters' sharding attributes
(:mod:`omnitron.core.parallel.tensor.sharding`):

* the global tensor of a parameter is its full tensor with the vocabulary padding dropped
  (``valid_rows``), so it is the same at every tensor-parallel size;
* a partition stride ``s > 1`` (SwiGLU's ``[gate; up]``) adds a leading axis of size ``s``: the
  full tensor's ``s`` blocks along ``partition_dim`` are stacked, and tp rank ``r`` holds rows
  ``[r*m, (r+1)*m)`` of every block (``m`` = its local rows per block) -- one box per block;
* a distributed-optimizer slice (elements ``[lo, hi)`` of the flattened local shard) is a few
  boxes of the local shard (:func:`flat_boxes`: a partial row, whole rows, a partial row at each
  dimension), each a view of the slice's own storage, then mapped like the local shard.

Every piece is a view of the rank's live tensor: saving writes from it, loading copies into it.
"""
from __future__ import annotations

import math

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def global_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Shape of parameter ``p``'s global tensor (see the module docstring); ``tp``: the run's tp size."""
    shape = list(p.shape)
    if _parallel(p):
        shape[p.partition_dim] *= tp
    rows = getattr(p, "valid_rows", None)
    if rows is not None:
        shape[0] = rows
    s = _stride(p)
    if s > 1:
        shape[p.partition_dim] //= s
        shape.insert(0, s)
    return tuple(shape)


def tp_writer(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether tp rank ``tp_rank`` writes ``p``'s pieces on save: its own shard if ``p`` is split over tp,
    else (replicated on every tp rank) rank 0 only."""
    return _parallel(p) or tp_rank == 0


def _parallel(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) and getattr(p, "partition_dim", -1) >= 0


def _stride(p) -> int:
    return int(getattr(p, "partition_stride", 1)) if _parallel(p) else 1


def flat_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[Box]:
    """Boxes of a row-major tensor of ``shape`` covering flat elements ``[lo, hi)`` in order; each box
    is contiguous in memory (fixed leading indices, one ranged dimension, whole trailing ones)."""
    if hi <= lo:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = lo // inner, (hi - 1) // inner
    rest = tuple(shape[1:])

    def row(i, a, b):
        return [((i, *o), (1, *z)) for o, z in flat_boxes(rest, a, b)]

    if first == last:
        return row(first, lo - first * inner, hi - first * inner)
    out, start, end = [], first, last + 1
    if lo % inner:
        out += row(first, lo % inner, inner)
        start = first + 1
    if hi % inner:
        end = last
    if end > start:
        out.append(((start, *[0] * len(rest)), (end - start, *rest)))
    if hi % inner:
        out += row(last, 0, hi % inner)
    return out


def box_view(flat: torch.Tensor, shape: tuple[int, ...], base: int, box: Box) -> torch.Tensor:
    """The view of ``box`` (a :func:`flat_boxes` box of a tensor of ``shape``) in ``flat``, which holds
    that tensor's flat elements from ``base`` on."""
    off, size = box
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    start = sum(o * s for o, s in zip(off, strides)) - base
    return flat[start:start + math.prod(size)].view(size)


def to_global(p: torch.Tensor, tp_rank: int, box: Box, view: torch.Tensor) -> list[tuple[tuple[int, ...],
                                                                                          torch.Tensor]]:
    """``[(global offsets, view)]`` of a box of ``p``'s local shard at tp rank ``tp_rank`` (its sizes are
    the view's); the vocabulary padding is cut away (a piece wholly in it is dropped)."""
    off, size = list(box[0]), list(box[1])
    pieces = []
    if _parallel(p):
        d, s = p.partition_dim, _stride(p)
        m = p.shape[d] // s
        a, b = off[d], off[d] + size[d]
        for i in range(a // m, (b - 1) // m + 1) if b > a else ():
            lo, hi = max(a, i * m), min(b, (i + 1) * m)
            v, o = view.narrow(d, lo - a, hi - lo), list(off)
            o[d] = tp_rank * m + lo - i * m
            pieces.append(((i, *o), v.unsqueeze(0)) if s > 1 else (tuple(o), v))
    else:
        pieces = [(tuple(off), view)]
    rows = getattr(p, "valid_rows", None)
    if rows is None:
        return [(o, v) for o, v in pieces if v.numel()]
    out = []
    for o, v in pieces:
        keep = min(v.shape[0], rows - o[0])
        if keep > 0 and v.numel():
            out.append((o, v.narrow(0, 0, keep)))
    return out


def shard_pieces(p: torch.Tensor, tp_rank: int, local: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """Pieces of a whole local shard ``local`` (shaped like ``p``)."""
    return to_global(p, tp_rank, ((0,) * p.dim(), tuple(p.shape)), local)


def slice_pieces(p: torch.Tensor, tp_rank: int, flat: torch.Tensor, lo: int) -> list[tuple[tuple[int, ...],
                                                                                            torch.Tensor]]:
    """Pieces of a distributed-optimizer slice ``flat`` (elements ``[lo, lo + flat.numel())`` of the
    flattened local shard of ``p``)."""
    shape = tuple(p.shape)
    out = []
    for box in flat_boxes(shape, lo, lo + flat.numel()):
        out += to_global(p, tp_rank, box, box_view(flat, shape, lo, box))
    return out
