"""All-to-all (DeepSpeed-Ulysses, Megatron's ``--cp-comm-type a2a``) and all-gather (``allgather``) context
parallelism, on the same load-balanced sequence split as the ring (:mod:`.layout`).

``a2a``: before attention an all-to-all trades sequence for heads: each cp rank sends head group ``j`` of
its sequence chunks to rank ``j`` and receives its own head group over the whole sequence. The chunks
arrive in the ranks' load-balanced order; a fixed permutation puts them in sequence order, full causal
attention runs on ``heads / cp`` heads, and the inverse permutation and all-to-all bring the output back
to this rank's chunks with every head. Needs the local heads divisible by cp (key/value heads that are not
are repeated per query head first, grouped-query attention's expansion).

``allgather``: keys and values are all-gathered over cp (their gradients reduce-scattered back); each
rank's queries attend over the whole sequence with the causal mask of their global positions: as blocks on the
backend's block kernel (the ring's flash kernel with log-sum-exp; with attention dropout the hash masks of
:mod:`omnitron.kernels.hash_dropout` at the rows' global positions, drawn inside the fused Triton block on GPUs
and by the chunked reference on the CPU); with a sliding window or sinks, the ring's tiles (:mod:`.tiles`) against
each rank's gathered block, the sinks added after the merge: no ``[s/cp, s]`` scores on either.

Both are differentiable (the collectives' backward is the reverse collective) and give the one-process
result up to the attention kernel's rounding.
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.context.blocks import BlockedAttention
from omnitron.core.parallel.context.layout import chunk_positions
from omnitron.core.parallel.context.tiles import step_plan
from omnitron.core.parallel.tensor.mappings import gather_from_sp
from omnitron.core.transformer.moe.dispatch import all_to_all


def _order(seq: int, group, device) -> torch.Tensor:
    """Global position of each row of the ranks' chunks concatenated in rank order."""
    return torch.cat([chunk_positions(seq, group.size, r, device) for r in range(group.size)])


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, s/cp, d]`` (all heads, this rank's chunks) -> ``[b, h/cp, s, d]`` (rank order of chunks)."""
    b, h, s, d = x.shape
    cp = group.size
    parts = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # [cp, b, h/cp, s_l, d]
    got = all_to_all(parts.reshape(cp, -1), [1] * cp, [1] * cp, group)  # row j: rank j's chunks of my heads
    return got.reshape(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_heads_to_sequence`."""
    b, hc, s_all, d = x.shape
    cp = group.size
    parts = x.reshape(b, hc, cp, s_all // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp, b, h/cp, s_l, d]
    got = all_to_all(parts.reshape(cp, -1), [1] * cp, [1] * cp, group)  # row j: my chunks of rank j's heads
    return got.reshape(cp, b, hc, s_all // cp, d).transpose(0, 1).reshape(b, cp * hc, s_all // cp, d)


def head_slice(t: torch.Tensor | None, group) -> torch.Tensor | None:
    """The entries of per-head ``t [h]`` (attention sinks) of the head group this rank holds after
    :func:`_heads_to_sequence` (group rank ``j``: heads ``j h/n .. (j+1) h/n - 1``); None stays None."""
    return None if t is None else t.view(group.size, -1)[group.rank]


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, attend) -> torch.Tensor:
    """Causal attention over the cp-split sequence by all-to-all; ``attend(q, k, v)`` is the full causal
    attention (``[b, h, s, d]``, grouped-query heads allowed)."""
    cp, hq, hkv = group.size, q.shape[1], k.shape[1]
    if hq % cp:
        raise ValueError(f"--cp-comm-type a2a splits the {hq} local attention heads over --context-parallel-size "
                         f"{cp}: they must be a multiple of it; use --cp-comm-type p2p or allgather")
    if hkv % cp:  # too few key/value heads to split: repeat them per query head
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    seq = q.shape[2] * cp
    order = _order(seq, group, q.device)
    natural = torch.argsort(order)  # row of the concatenation holding position p
    qs, ks, vs = (_heads_to_sequence(t, group).index_select(2, natural) for t in (q, k, v))
    out = attend(qs, ks, vs)
    return _sequence_to_heads(out.index_select(2, order).contiguous(), group)


def allgather_tasks(local_length: int, group) -> list:
    """The blocks of this rank's queries (two chunks of ``c`` rows) against the gathered keys in sequence
    order under the causal mask: each chunk sees every earlier chunk whole and its own chunk causally."""
    c, r, n = local_length // 2, group.rank, group.size
    tasks = []
    for rows, chunk in ((slice(0, c), r), (slice(c, 2 * c), 2 * n - 1 - r)):
        if chunk > 0:
            tasks.append((rows, slice(0, chunk * c), False))
        tasks.append((rows, slice(chunk * c, (chunk + 1) * c), True))
    return tasks


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, attend_masked=None,
                        kernel=None, scale: float | None = None, window=None, drop=None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's queries against the all-gathered keys and values. With ``kernel`` (a :class:`.blocks.BlockKernel`)
    the causal blocks run on it and merge by log-sum-exp (no ``[s/cp, s]`` scores; ``drop``: the hash dropout of
    this rank's rows against the whole sequence in order, :mod:`omnitron.kernels.hash_dropout`): those of
    :func:`allgather_tasks`, or with a sliding ``window`` or ``sinks [hq]`` the ring's tiles against each rank's
    gathered block (:func:`_ring_tiles`). Without ``kernel``: ``attend_masked(q, k, v, keep)`` with a boolean
    ``keep [s_q, s_k]`` (True = attend: causal, within the sliding ``window`` of
    :mod:`omnitron.core.transformer.window` when given)."""
    seq = q.shape[2] * group.size
    order = _order(seq, group, q.device)
    natural = torch.argsort(order)

    def gather(t, rows=natural):  # [b, h, s_l, d] -> [b, h, s, d], rows in ``rows`` order (gradient: reduce-scatter)
        full = gather_from_sp(t.permute(2, 0, 1, 3).contiguous(), group, grad_is_partial=True)
        return (full if rows is None else full.index_select(0, rows)).permute(1, 2, 0, 3)

    if kernel is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if window is None and sinks is None:
            return BlockedAttention.apply(q, gather(k), gather(v), allgather_tasks(q.shape[2], group), kernel, scale,
                                          drop)
        drop = None if drop is None else drop._replace(k_pos=drop.k_pos[order])  # keys in the ranks' order
        tiles = _ring_tiles(q.shape[2], group, window, q.device)
        return BlockedAttention.apply(q, gather(k, None), gather(v, None), tiles, kernel, scale, drop, sinks)
    from omnitron.core.transformer.window import keep_mask

    keep = keep_mask(chunk_positions(seq, group.size, group.rank, q.device), torch.arange(seq, device=q.device),
                     window)
    return attend_masked(q, gather(k), gather(v), keep)


def _ring_tiles(local_length: int, group, window, device) -> list:
    """The tiles (:func:`.tiles.step_plan`) of this rank's queries against the keys gathered in the ranks' order:
    rank ``j``'s block is the one the ring brings at step ``rank - j``, its key rows shifted to ``j``'s place."""
    tiles = []
    for j in range(group.size):
        off = j * local_length
        for t in step_plan((group.rank - j) % group.size, group.rank, group.size, local_length, True, window, device):
            cols = range(local_length)[t.cols]
            tiles.append(t._replace(cols=slice(off + cols.start, off + cols.stop)))
    return tiles
