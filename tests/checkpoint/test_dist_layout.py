"""The torch_dist global-tensor mapping, without processes: every tp rank's pieces (of whole shards and
of arbitrary distributed-optimizer flat slices) tile the global tensor exactly.

Reference: the full tensor drawn fresh (float64), cut into tp shards by the model's own
``shard_param``; the expected global tensor is that full tensor with the padding rows dropped and
(stride > 1) its blocks stacked -- written here from the definition, not through the code under test.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from omnitron.core.checkpoint.dist_layout import (flat_boxes, global_shape, row_pieces, shard_pieces, slice_pieces,
                                                   tp_writer)
from omnitron.core.parallel.tensor.sharding import set_attributes, shard_param

CASES = {  # (full shape, parallel, dim, stride, valid rows[, MoE expert])
    "column": ((12, 5), True, 0, 1, None),
    "expert_swiglu": ((16, 3), True, 0, 2, None, True),
    "expert_whole": ((16, 3), False, -1, 1, None, True),
    "row": ((6, 8), True, 1, 1, None),
    "swiglu": ((16, 3), True, 0, 2, None),
    "vocab": ((16, 4), True, 0, 1, 13),
    "vocab_pad_shard": ((16, 4), True, 0, 1, 8),  # at tp 4 the shards past row 8 are wholly padding
    "replicated": ((7,), False, -1, 1, None),
    "3d": ((4, 6, 3), True, 1, 2, None),
}


def _param(full_shape, parallel, dim, stride, rows, tp, expert=False):
    local = list(full_shape)
    if parallel:
        local[dim] //= tp
    p = set_attributes(torch.nn.Parameter(torch.empty(local, dtype=torch.float64)), parallel=parallel, dim=dim,
                       stride=stride, valid_rows=rows)
    p.expert = expert
    return p


def _expected(full, dim, stride, rows, expert=False):
    g = full[:rows] if rows is not None else full
    return torch.stack(g.chunk(stride, dim=dim)) if stride > 1 and not expert else g  # experts: the plain full


def _tile(pieces_per_rank, shape):
    out = torch.full(shape, float("nan"), dtype=torch.float64)
    hits = torch.zeros(shape, dtype=torch.int64)
    for pieces in pieces_per_rank:
        for off, view in pieces:  # DCP refuses a chunk outside its tensor; an empty one is no piece
            assert view.numel() and all(0 <= o and o + z <= n for o, z, n in zip(off, view.shape, shape)), off
            idx = tuple(slice(o, o + z) for o, z in zip(off, view.shape))
            out[idx] = view
            hits[idx] += 1
    return out, hits


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pieces_tile_the_global_tensor(name, tp):
    full_shape, parallel, dim, stride, rows, *expert = CASES[name]
    if parallel and full_shape[dim] % (tp * stride):
        pytest.skip("does not split")
    full = torch.randn(full_shape, dtype=torch.float64)
    if rows is not None:
        full[rows:] = 0
    p = _param(full_shape, parallel, dim, stride, rows, tp, *expert)
    want = _expected(full, dim, stride, rows, *expert)
    assert global_shape(p, tp) == tuple(want.shape)
    shards = [shard_param(full, p, tp, r) for r in range(tp)]
    writers = [r for r in range(tp) if tp_writer(p, r)]  # a tp-replicated parameter: rank 0 writes it
    assert writers == (list(range(tp)) if parallel else [0])
    loaded = _check_tiling([[(p, (tp, r), shards[r], r in writers)] for r in range(tp)], want, hash((name, tp)))
    assert parallel or loaded == [want.numel()] * tp  # a replicated parameter: every rank reads all of it


def _check_tiling(per_rank, want, seed) -> list[int]:
    """``per_rank[r]``: rank r's ``[(parameter, (tp, r), local tensor, written on save)]``. The written
    pieces -- of the whole tensors, of random distributed-optimizer flat slices of them and of random FSDP2
    row shards of them (:func:`row_pieces`) -- each non-empty and inside the global tensor, tile
    ``want`` exactly once; each rank's own pieces on load hold ``want``'s values. Returns how many
    elements each rank reads on load."""
    written = [e for entries in per_rank for e in entries if e[3]]
    got, hits = _tile([shard_pieces(p, tp, t) for p, tp, t, _ in written], want.shape)
    assert torch.equal(hits, torch.ones_like(hits)) and torch.equal(got, want)
    loaded = []
    for entries in per_rank:
        got, hits = _tile([shard_pieces(p, tp, t) for p, tp, t, _ in entries], want.shape)
        assert int(hits.max()) <= 1 and torch.equal(got[hits == 1], want[hits == 1])  # <: a shard of padding
        loaded.append(int(hits.sum()))
    rng, pieces = random.Random(seed), []
    for p, tp, t, _ in written:
        flat, n = t.reshape(-1), t.numel()
        cuts = sorted({0, n, *(rng.randrange(n + 1) for _ in range(3))})
        pieces += [slice_pieces(p, tp, flat[a:b], a) for a, b in zip(cuts, cuts[1:])]
    got, hits = _tile(pieces, want.shape)
    assert torch.equal(hits, torch.ones_like(hits)) and torch.equal(got, want)
    pieces = []  # FSDP2: each data-parallel rank holds rows [r0, r1) of the local tp shard
    for p, tp, t, _ in written:
        cuts = sorted({0, t.shape[0], *(rng.randrange(t.shape[0] + 1) for _ in range(2))}) if t.dim() else [0, 1]
        pieces += [row_pieces(p, tp, t[a:b] if t.dim() else t, a) for a, b in zip(cuts, cuts[1:])]
    got, hits = _tile(pieces, want.shape)
    assert torch.equal(hits, torch.ones_like(hits)) and torch.equal(got, want)
    return loaded


@pytest.mark.parametrize("tp,groups", [(2, 1), (4, 2), (4, 1), (8, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_replicated_kv_parts_tile_the_canonical_qkv(tp, groups, bias):
    """Replicated-KV attention (query groups < tp): each rank's ``linear_q`` rows and tp rank 0's
    ``linear_kv`` (every group's k, v) tile the canonical fused ``linear_qkv`` exactly once (reference:
    the per-group row layout written out here: per group its q heads, then k, then v); on load each
    rank reads its own q rows and all kv rows."""
    from omnitron.core.checkpoint.dist_layout import global_name

    heads, d, h = 8, 3, 5
    qpg, rows = heads // groups, (heads + 2 * groups) * d
    canon = torch.randn((rows, h)[: 1 if bias else 2], dtype=torch.float64)
    per_group = canon.view(groups, (qpg + 2) * d, *canon.shape[1:])
    q_full = per_group[:, : qpg * d].reshape(heads * d, *canon.shape[1:])  # global head order
    kv = per_group[:, qpg * d:].reshape(2 * groups * d, *canon.shape[1:])
    suffix = "linear_qkv." + ("bias" if bias else "weight")
    qp, kvp = _param(q_full.shape, True, 0, 1, None, tp), _param(kv.shape, False, -1, 1, None, tp)
    for p, which in ((qp, "q"), (kvp, "kv")):
        p.init_from = (suffix, tuple(canon.shape), which, groups, qpg, d)
    assert global_shape(qp, tp) == global_shape(kvp, tp) == tuple(canon.shape)
    assert global_name("m.linear_kv." + suffix[11:], kvp) == "m." + suffix
    q_shards = q_full.chunk(tp)
    per_rank = [[(qp, (tp, r), q_shards[r], True), (kvp, (tp, r), kv, tp_writer(kvp, r))] for r in range(tp)]
    loaded = _check_tiling(per_rank, canon, tp * 10 + groups)
    assert loaded == [q_shards[0].numel() + kv.numel()] * tp


def test_slice_pieces_are_views():
    """Loading writes through the pieces into the optimizer's own slice."""
    p = _param((8, 6), True, 0, 2, None, 2)
    flat = torch.zeros(17, dtype=torch.float64)
    for _, view in slice_pieces(p, (2, 1), flat, 5):
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_writes_buffer_views_without_copying(tmp_path, monkeypatch, dtype):
    """A DCP save (one process) of distributed-optimizer pieces cut from one flat buffer never clones a
    tensor (DCP clones any tensor whose storage exceeds it: every view of the buffer, unless the planner
    hands it a storage of its own extent) and reads back equal to the buffer; the same save with the
    planner's storage trick undone clones, so the probe can fail. The written pieces hold the piece's
    bytes, not the buffer's: the file is about the pieces' size."""
    from omnitron.core.checkpoint import dist, dist_planner
    from omnitron.core.checkpoint.integrity import file_digest

    p = _param((64, 48), True, 0, 2, None, 2)
    flat = torch.randn(p.numel() * 4, dtype=torch.float64).to(dtype)  # the bucket; the slice is 1/4 of it
    lo = p.numel() // 3
    part = flat[lo:lo + p.numel() // 2]

    def save(where):
        os.makedirs(where)
        pieces = {"optim/exp_avg/w": (global_shape(p, 2), slice_pieces(p, (2, 1), part, lo))}
        dist.write(where, 0, pieces, {}, collective=False)
        return pieces

    clones = []
    real = torch.Tensor.clone
    monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **kw: clones.append(t.nbytes) or real(t, *a, **kw))
    pieces = save(str(tmp_path / "zero_copy"))
    assert clones == []
    where = tmp_path / "zero_copy"
    files = [str(where / f) for f in os.listdir(where) if f == ".metadata" or f.endswith(".distcp")]
    data = sum(os.path.getsize(f) for f in files if f.endswith(".distcp"))  # the pieces, not the whole buffer
    assert part.nbytes <= data < part.nbytes + 16384, (data, part.nbytes)
    monkeypatch.setattr(dist_planner, "exact_storage", lambda v: v)
    save(str(tmp_path / "cloned"))
    assert sum(clones) == part.nbytes  # DCP copied every piece
    sums = {os.path.basename(f): file_digest(f) for f in files}
    back = {k: (shape, [(o, torch.zeros_like(v)) for o, v in ps]) for k, (shape, ps) in pieces.items()}
    dist.read(back, str(tmp_path / "zero_copy"), sums, collective=False)
    for (_, got), (_, want) in zip(back["optim/exp_avg/w"][1], pieces["optim/exp_avg/w"][1]):
        assert torch.equal(got, want)
