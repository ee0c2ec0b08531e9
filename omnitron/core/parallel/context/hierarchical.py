"""Hierarchical context parallelism (Megatron-Core's ``--cp-comm-type a2a+p2p`` with
``--hierarchical-context-parallel-sizes A P``, ``A x P = cp``): the all-to-all inside groups of ``A``
consecutive cp ranks, the ring across the ``P`` groups.

The data layout is the load-balanced split of :mod:`.layout` (cp rank ``r`` holds chunks ``r`` and
``2cp-1-r`` of ``c`` rows), whatever the comm type. Number the cp ranks ``r = g * A + j`` (``g``: the
a2a group, ``j``: the rank inside it). The a2a group ``g`` (ranks ``gA .. gA+A-1``) holds the early
chunks ``gA .. gA+A-1`` (consecutive: positions ``[gAc, (g+1)Ac)``) and the late chunks
``2cp-A-gA .. 2cp-1-gA`` (also consecutive). Its all-to-all (:func:`.ulysses._heads_to_sequence`) gives
member ``j`` the head group ``j`` of all ``2A`` chunks; reordered as [the early chunks ascending, the late
chunks ascending] they are the two *super-chunks* ``g`` and ``2P-1-g`` of ``A c`` rows: exactly the
load-balanced layout of a cp-``P`` split. So ring attention (:mod:`.ring`) over the ``P`` ranks holding
the same head group (cp ranks ``j, A+j, 2A+j, ...``: the p2p group, where member ``g`` is a2a group
``g``) is exact without any new mask: its causal block structure holds for the super-chunks. The
inverse reorder and all-to-all bring the output back to this rank's chunks with every head.

Degenerate sizes: ``A == 1`` is the ring (no all-to-all); ``P == 1`` is Ulysses on the a2a group (the
ring is replaced by the full causal attention ``attend``). Key/value heads that do not divide by ``A``
are repeated per query head first (as in ``a2a``). Attention dropout: the ring's hash masks
(:mod:`omnitron.kernels.hash_dropout`) number member ``j``'s heads from ``j hq / A`` (its head group's place
among the layer's heads) at the super-chunks' global positions, so they are one process's; with ``P == 1``,
``attend`` draws them. Differentiable:
the all-to-all's backward is the inverse all-to-all, the ring is its own autograd Function.
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.context.blocks import REFERENCE, BlockKernel
from omnitron.core.parallel.context.ring import ring_attention
from omnitron.core.parallel.context.ulysses import _heads_to_sequence, _sequence_to_heads


def super_chunk_order(a2a_size: int, local_length: int, device=None) -> torch.Tensor:
    """Rows of the all-to-all's output (the ``a2a_size`` ranks' slices of ``local_length`` rows in rank order,
    each an early then a late chunk) in super-chunk order: the early chunks of ranks ``0 .. A-1``, then the late
    chunks of ranks ``A-1 .. 0`` (both ascending in position)."""
    c = local_length // 2
    early = [torch.arange(j * 2 * c, j * 2 * c + c, device=device) for j in range(a2a_size)]
    late = [torch.arange(j * 2 * c + c, (j + 1) * 2 * c, device=device) for j in reversed(range(a2a_size))]
    return torch.cat(early + late)


def check_sizes(heads: int, a2a_size: int) -> None:
    """Raise ValueError unless the ``heads`` local attention heads split over the a2a size."""
    if heads % a2a_size:
        raise ValueError(f"--cp-comm-type a2a+p2p splits the {heads} local attention heads over the a2a size "
                         f"{a2a_size} (--hierarchical-context-parallel-sizes): they must be a multiple of it")


def a2a_p2p_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, a2a_group, p2p_group, collectives,
                      attend, scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                      kernel: BlockKernel = REFERENCE, window=None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this cp rank's slice over the whole cp-split sequence, hierarchically.

    ``q [b, hq, s/cp, d]``, ``k, v [b, hkv, s/cp, d]`` in the load-balanced order of :mod:`.layout` (cp =
    ``a2a_group.size x p2p_group.size``, the groups of :func:`omnitron.core.parallel.grid.rank_grid`'s
    ``cp_a2a`` / ``cp_p2p``). ``attend(q, k, v)``: full causal attention (used when the p2p size is 1).
    The ring's arguments (``collectives``, ``scale``, ``dropout_p``, ``seed``, ``kernel``) as in
    :func:`.ring.ring_attention`, and ``window`` (the super-chunks are a cp-``P`` layout, so the ring's global
    positions hold) and ``sinks`` (``[hq / A]``: this member's head group's, :func:`.ulysses.head_slice`;
    ``attend`` applies its own). Returns ``[b, hq, s/cp, dv]``."""
    a, p = a2a_group.size, p2p_group.size
    hq, hkv, s_l = q.shape[1], k.shape[1], q.shape[2]
    check_sizes(hq, a)
    if s_l % 2:
        raise ValueError(f"a2a+p2p attention: the local sequence ({s_l}) must hold two equal chunks; "
                         f"--seq-length must be divisible by 2 x --context-parallel-size")
    order = None
    if a > 1:
        if hkv % a:  # too few key/value heads to split: repeat them per query head
            k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
        order = super_chunk_order(a, s_l, q.device)
        q, k, v = (_heads_to_sequence(t, a2a_group).index_select(2, order) for t in (q, k, v))
    if p > 1:
        out = ring_attention(q, k, v, group=p2p_group, collectives=collectives, causal=True, scale=scale,
                             dropout_p=dropout_p, seed=seed, kernel=kernel, window=window, sinks=sinks,
                             head_offset=a2a_group.rank * (hq // a))
    else:
        out = attend(q, k, v)
    if order is not None:
        out = _sequence_to_heads(out.index_select(2, torch.argsort(order)).contiguous(), a2a_group)
    return out
