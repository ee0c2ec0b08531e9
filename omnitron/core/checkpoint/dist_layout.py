"""Where a rank's tensors sit in layout-independent global tensors (for ``--ckpt-format torch_dist``).

PyTorch's distributed checkpoint (DCP) stores every tensor as a global tensor of fixed shape with
each writer's part as a box (offsets, sizes). This module maps what a rank holds to such boxes
without communication, from the parameters' sharding attributes
(:mod:`omnitron.core.parallel.tensor.sharding`):

* the global tensor of a parameter is its full tensor with the vocabulary padding dropped
  (``valid_rows``), so it is the same at every tensor-parallel size;
* a partition stride ``s > 1`` (SwiGLU's ``[gate; up]``) adds a leading axis of size ``s``: the
  full tensor's ``s`` blocks along ``partition_dim`` are stacked, and tp rank ``r`` holds rows
  ``[r*m, (r+1)*m)`` of every block (``m`` = its local rows per block) -- one box per block. MoE
  experts (``expert``; split over the expert-tensor-parallel group, or whole) get no such axis: their
  global tensor is the plain full tensor, the same whether an expert is split or whole, so the
  boxes of block ``i`` sit at ``i*F + r*m`` (``F`` = the full rows per block);
* replicated-KV attention's ``linear_q`` / ``linear_kv`` (``init_from``: parts of the canonical fused
  ``linear_qkv``, :mod:`omnitron.core.transformer.qkv`) are row runs of that canonical tensor, so a
  checkpoint holds one ``linear_qkv`` whatever the number of query groups per tp rank;
* an FSDP2 shard (rows ``[r0, r1)`` of the local tp shard, :func:`row_pieces`) is one box of it, mapped
  like the local shard;
* a distributed-optimizer slice (elements ``[lo, hi)`` of the flattened local shard) is a few
  boxes of the local shard (:func:`flat_boxes`: a partial row, whole rows, a partial row at each
  dimension), each a view of the slice's own storage, then mapped like the local shard.

Every piece is a view of the rank's live tensor: saving writes from it, loading copies into it.
"""
from __future__ import annotations

import math

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def global_name(name: str, p: torch.Tensor) -> str:
    """The name of ``p``'s global tensor (``name``: its parameter name): the canonical fused tensor a
    replicated-KV part belongs to, else the name its full init is drawn under."""
    src = getattr(p, "init_from", None)
    if src is not None:
        return name.rsplit(".", 2)[0] + "." + src[0]
    return getattr(p, "init_name", name)


def global_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Shape of parameter ``p``'s global tensor (see the module docstring); ``tp``: the size of the group
    ``p`` is split over (tp; etp for experts)."""
    src = getattr(p, "init_from", None)
    if src is not None:
        return tuple(src[1])
    shape = list(p.shape)
    if _parallel(p):
        shape[p.partition_dim] *= tp
    rows = getattr(p, "valid_rows", None)
    if rows is not None:
        shape[0] = rows
    s = _stride(p)
    if s > 1 and not _expert(p):
        shape[p.partition_dim] //= s
        shape.insert(0, s)
    return tuple(shape)


def tp_writer(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether tp rank ``tp_rank`` writes ``p``'s pieces on save: its own shard if ``p`` is split over tp,
    else (replicated on every tp rank) rank 0 only."""
    return _parallel(p) or tp_rank == 0


def _parallel(p) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False)) and getattr(p, "partition_dim", -1) >= 0


def _expert(p) -> bool:
    return bool(getattr(p, "expert", False))


def _fused_rows(p, tp_rank: int) -> list[tuple[int, int, int]]:
    """``(local row, rows, canonical row)`` runs of a replicated-KV part (``init_from``) in the canonical
    fused QKV tensor, whose group ``j`` is rows ``[j*(qpg+2)*d, (j+1)*(qpg+2)*d)``: ``qpg`` query heads,
    then k, v. ``linear_kv`` holds every group's k, v; ``linear_q`` at tp rank ``r`` its query heads
    ``[r*h, (r+1)*h)``, all in one group."""
    _, _, which, g, qpg, d = p.init_from
    block = (qpg + 2) * d
    if which == "kv":
        return [(2 * d * j, 2 * d, j * block + qpg * d) for j in range(g)]
    first = tp_rank * (p.shape[0] // d)  # this rank's first query head
    return [(0, p.shape[0], first // qpg * block + first % qpg * d)]


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


def to_global(p: torch.Tensor, tp: tuple[int, int], box: Box, view: torch.Tensor) -> list[tuple[tuple[int, ...],
                                                                                              torch.Tensor]]:
    """``[(global offsets, view)]`` of a box of ``p``'s local shard at rank ``tp = (size, rank)`` of the group
    ``p`` is split over (its sizes are the view's); the vocabulary padding is cut away (a piece wholly in
    it is dropped)."""
    off, size = list(box[0]), list(box[1])
    if hasattr(p, "init_from"):
        runs = [(lo, n, g0, 0) for lo, n, g0 in _fused_rows(p, tp[1])]
        return _runs(runs, 0, off, size[0], view, axis=False)
    if not _parallel(p):
        pieces = [(tuple(off), view)]
    else:
        d, s = p.partition_dim, _stride(p)
        m = p.shape[d] // s
        # block i's local rows [i*m, (i+1)*m) sit at rank*m within block i: of the stacked axis, or at i*m*size
        runs = [(i * m, m, tp[1] * m + (0 if s > 1 and not _expert(p) else i * m * tp[0]), i) for i in range(s)]
        pieces = _runs(runs, d, off, size[d], view, axis=s > 1 and not _expert(p))
    rows = getattr(p, "valid_rows", None)
    if rows is None:
        return [(o, v) for o, v in pieces if v.numel()]
    out = []
    for o, v in pieces:
        keep = min(v.shape[0], rows - o[0])
        if keep > 0 and v.numel():
            out.append((o, v.narrow(0, 0, keep)))
    return out


def _runs(runs, d: int, off: list[int], n: int, view: torch.Tensor, *, axis: bool) -> list:
    """The parts of a box (offsets ``off``, ``n`` long along dimension ``d``) that fall in each run
    ``(local start, length, global start, block)`` of dimension ``d``, at their global offsets (``axis``:
    with the block index as a leading axis)."""
    a, b, out = off[d], off[d] + n, []
    for start, length, g0, block in runs:
        lo, hi = max(a, start), min(b, start + length)
        if hi > lo:
            o = list(off)
            o[d] = g0 + lo - start
            v = view.narrow(d, lo - a, hi - lo)
            out.append(((block, *o), v.unsqueeze(0)) if axis else (tuple(o), v))
    return out


def shard_pieces(p: torch.Tensor, tp: tuple[int, int], local: torch.Tensor) -> list[tuple[tuple[int, ...],
                                                                                          torch.Tensor]]:
    """Pieces of a whole local shard ``local`` (shaped like ``p``); ``tp``: see :func:`to_global`."""
    return to_global(p, tp, ((0,) * p.dim(), tuple(p.shape)), local)


def row_pieces(p: torch.Tensor, tp: tuple[int, int], local: torch.Tensor, row: int) -> list[tuple[tuple[int, ...],
                                                                                         torch.Tensor]]:
    """Pieces of an FSDP2 shard ``local``: rows ``[row, row + local.shape[0])`` of the local tp shard of ``p``
    (a DTensor over the data-parallel mesh, whose shape is the local tp shard's)."""
    if not local.numel():
        return []
    return to_global(p, tp, ((row,) + (0,) * (local.dim() - 1), tuple(local.shape)), local)


def slice_pieces(p: torch.Tensor, tp: tuple[int, int], flat: torch.Tensor, lo: int) -> list[tuple[tuple[int, ...],
                                                                                            torch.Tensor]]:
    """Pieces of a distributed-optimizer slice ``flat`` (elements ``[lo, lo + flat.numel())`` of the
    flattened local shard of ``p``)."""
    shape = tuple(p.shape)
    out = []
    for box in flat_boxes(shape, lo, lo + flat.numel()):
        out += to_global(p, tp, box, box_view(flat, shape, lo, box))
    return out
