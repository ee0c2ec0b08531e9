"""Core attention of one context-parallel rank's slice over the whole cp-split sequence, shared by
:class:`~omnitron.core.transformer.attention.SelfAttention` and
:class:`~omnitron.core.transformer.mla.MLASelfAttention`.

The module ``m`` carries what :func:`omnitron.core.parallel.context.apply_context_parallel` set
(``cp_group``, ``cp_comm_type``, ``cp_subgroups``) and its ``tracker`` and ``backend``. Per
``--cp-comm-type``: ``p2p`` the ring (:mod:`omnitron.core.parallel.context.ring`), ``a2a`` / ``allgather``
(:mod:`.ulysses`), ``a2a+p2p`` (:mod:`.hierarchical`). Every path takes the softmax ``scale`` (MLA's
YaRN scale), a value head dim that differs from the query's (MLA), a causal sliding ``window`` and
attention ``sinks [hq]`` (:mod:`omnitron.core.transformer.window`). The all-to-all paths split the heads,
so each rank applies the sinks of the head group it holds (:func:`.ulysses.head_slice`).

Attention dropout is the counter-based hash of :mod:`omnitron.kernels.hash_dropout` on every path: the seed is drawn
once per call from the tracker's model-parallel stream
(:meth:`~omnitron.core.parallel.tensor.random.RNGTracker.draw_seed`: no host sync; the same on every cp rank, whose
streams are seeded alike, different on each tp rank, layer and call, replayed by recomputation), positions are global
and heads numbered before the all-to-all's head split, so every layout (windows and sinks included) draws the masks of
one process. Without context parallelism (``cp_group`` None) a layer with a sliding window or sinks runs here too, on
one rank's blocks (:func:`_full`): memory ``O(s x tile)``, not ``O(s^2)``.
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.context.blocks import BlockedAttention, backend_kernel
from omnitron.core.parallel.context.layout import chunk_positions
from omnitron.core.parallel.context.ring import ring_attention
from omnitron.core.parallel.context.tiles import step_plan
from omnitron.kernels.hash_dropout import block_positions


def _full(m, p: float, scale: float, window, sinks, seed: int = 0, head0: int = 0):
    """``attend(q, k, v)``: causal attention over a whole sequence (rows in order) on this rank's heads (the first
    is head ``head0`` of the layer's, for the hash dropout of ``seed``), with this rank's ``sinks``.

    It runs the ring's blocks on one rank (:class:`.blocks.BlockedAttention` over the tiles of
    :func:`.tiles.step_plan` for a one-rank ring): one causal block on the backend's flash kernel where it has
    one (with dropout the fused Triton block on GPUs, the chunked reference elsewhere, drawing the hash masks);
    under a sliding window only the tiles it reaches, the cut ones masked. No ``[s, s]`` scores are made."""
    kernel = backend_kernel(m.backend)

    def attend(q, k, v):
        pos = torch.arange(q.shape[2], device=q.device)
        drop = block_positions(pos, pos, seed, p, head0, q.device)
        tiles = step_plan(0, 0, 1, q.shape[2], True, window, q.device)
        return BlockedAttention.apply(q, k, v, tiles, kernel, scale, drop, sinks)

    return attend


def cp_attention(m, q, k, v, p: float, *, scale: float | None = None, window=None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``q [b, hq, s/cp, d]``, ``k [b, hkv, s/cp, d]``, ``v [b, hkv, s/cp, dv]`` of this cp rank's chunks ->
    ``[b, hq, s/cp, dv]``; ``p`` the attention dropout (0 in eval), ``window`` / ``sinks`` as in
    :mod:`omnitron.core.transformer.window`. ``m.cp_group`` None (cp = 1: a sliding window or sinks, whose
    masked softmax would make ``[b, hq, s, s]`` scores): the whole sequence on :func:`_full`'s blocks."""
    from omnitron.core.parallel.context.ulysses import a2a_attention, allgather_attention, head_slice

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sinks = None if sinks is None else sinks.to(q.device)
    comm, group = m.cp_comm_type, m.cp_group
    # the hash dropout's seed from the tp-rank-specific stream (module docstring), drawn on every path alike
    seed = m.tracker.hash_seed(q) if p > 0.0 else 0
    if group is None:  # no context parallelism: the blocks of a one-rank ring over the whole sequence
        return _full(m, p, scale, window, sinks, seed)(q, k, v)
    if comm == "a2a":
        head0 = group.rank * (q.shape[1] // group.size)  # the first head of this rank's head group
        return a2a_attention(q, k, v, group=group,
                             attend=_full(m, p, scale, window, head_slice(sinks, group), seed, head0))
    if comm == "allgather":
        seq = q.shape[2] * group.size
        drop = block_positions(chunk_positions(seq, group.size, group.rank, q.device),
                               torch.arange(seq, device=q.device), seed, p, 0, q.device)
        return allgather_attention(q, k, v, group=group, kernel=backend_kernel(m.backend), scale=scale,
                                   window=window, drop=drop, sinks=sinks)
    kw = dict(collectives=m.backend.collectives, scale=scale, dropout_p=p, seed=seed,
              kernel=backend_kernel(m.backend), window=window)
    if comm == "a2a+p2p":
        from omnitron.core.parallel.context.hierarchical import a2a_p2p_attention

        if m.cp_subgroups is None:
            raise ValueError("--cp-comm-type a2a+p2p: the attention module has no a2a/p2p sub-groups; build the "
                             "model over groups made with --hierarchical-context-parallel-sizes")
        a2a, p2p = m.cp_subgroups
        local = head_slice(sinks, a2a) if a2a.size > 1 else sinks
        head0 = a2a.rank * (q.shape[1] // a2a.size)  # the ring's / attend's first head (hierarchical.py)
        return a2a_p2p_attention(q, k, v, a2a_group=a2a, p2p_group=p2p, sinks=local,
                                 attend=_full(m, p, scale, window, local, seed, head0), **kw)
    return ring_attention(q, k, v, group=group, causal=True, sinks=sinks, **kw)
