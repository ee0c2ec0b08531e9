"""The torch_dist global-tensor mapping, without processes: every tp rank's pieces (of whole shards and
of arbitrary distributed-optimizer flat slices) tile the global tensor exactly.

Reference: the full tensor drawn fresh (float64), cut into tp shards by the model's own
``shard_param``; the expected global tensor is that full tensor with the padding rows dropped and
(stride > 1) its blocks stacked -- written here from the definition, not through the code under test.
"""
from __future__ import annotations

import random

import pytest
import torch

from omnitron.core.checkpoint.dist_layout import flat_boxes, global_shape, shard_pieces, slice_pieces, tp_writer
from omnitron.core.parallel.tensor.sharding import set_attributes, shard_param

CASES = {  # (full shape, parallel, dim, stride, valid rows)
    "column": ((12, 5), True, 0, 1, None),
    "row": ((6, 8), True, 1, 1, None),
    "swiglu": ((16, 3), True, 0, 2, None),
    "vocab": ((16, 4), True, 0, 1, 13),
    "replicated": ((7,), False, -1, 1, None),
    "3d": ((4, 6, 3), True, 1, 2, None),
}


def _param(full_shape, parallel, dim, stride, rows, tp):
    local = list(full_shape)
    if parallel:
        local[dim] //= tp
    return set_attributes(torch.nn.Parameter(torch.empty(local, dtype=torch.float64)), parallel=parallel, dim=dim,
                          stride=stride, valid_rows=rows)


def _expected(full, dim, stride, rows):
    g = full[:rows] if rows is not None else full
    return torch.stack(g.chunk(stride, dim=dim)) if stride > 1 else g


def _tile(pieces_per_rank, shape):
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    hits = torch.zeros(shape, dtype=torch.int64)
    for pieces in pieces_per_rank:
        for off, view in pieces:
            idx = tuple(slice(o, o + z) for o, z in zip(off, view.shape))
            out[idx] = view
            hits[idx] += 1
    return out, hits


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_tile_the_global_tensor(name, tp):
    full_shape, parallel, dim, stride, rows = CASES[name]
    if parallel and full_shape[dim] % (tp * stride):
        pytest.skip("does not split")
    full = torch.randn(full_shape, dtype=torch.float64)
    if rows is not None:
        full[rows:] = 0
    p = _param(full_shape, parallel, dim, stride, rows, tp)
    want = _expected(full, dim, stride, rows)
    assert global_shape(p, tp) == tuple(want.shape)
    shards = [shard_param(full, p, tp, r) for r in range(tp)]
    writers = [r for r in range(tp) if tp_writer(p, r)]  # a tp-replicated parameter: rank 0 writes it
    assert writers == (list(range(tp)) if parallel else [0])
    got, hits = _tile([shard_pieces(p, r, shards[r]) for r in writers], want.shape)
    assert torch.equal(hits, torch.ones_like(hits)) and torch.equal(got, want)
    for r in range(tp):  # on load every rank takes its whole shard (a replicated parameter: all of it)
        got, hits = _tile([shard_pieces(p, r, shards[r])], want.shape)
        assert int(hits.max()) == 1 and torch.equal(got[hits == 1], want[hits == 1])
        assert parallel or bool((hits == 1).all())
    # distributed-optimizer slices: random cut points of each flattened shard, every slice mapped on its own
    rng = random.Random(hash((name, tp)))
    pieces = []
    for r in writers:
        flat, n = shards[r].reshape(-1), shards[r].numel()
        cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(3))})
        pieces += [slice_pieces(p, r, flat[a:b], a) for a, b in zip(cuts, cuts[1:])]
    got, hits = _tile(pieces, want.shape)
    assert torch.equal(hits, torch.ones_like(hits)) and torch.equal(got, want)


def test_slice_pieces_are_views():
    """Loading writes through the pieces into the optimizer's own slice."""
    p = _param((8, 6), True, 0, 2, None, 2)
    flat = torch.zeros(17, dtype=torch.float64)
    for _, view in slice_pieces(p, 1, flat, 5):
        view.fill_(1.0)
    assert torch.equal(flat, torch.ones(17, dtype=torch.float64))


def test_flat_boxes_cover_range_in_order():
    shape = (3, 4, 5)
    for lo, hi in [(0, 60), (7, 8), (3, 57), (20, 40), (19, 41), (0, 0)]:
        seen = []
        for off, size in flat_boxes(shape, lo, hi):
            idx = torch.arange(60).view(shape)[tuple(slice(o, o + z) for o, z in zip(off, size))]
            seen += idx.reshape(-1).tolist()
        assert seen == list(range(lo, hi)), (lo, hi)
