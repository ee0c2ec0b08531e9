"""The fused QKV row layout, written once for the attention module and the checkpoint converters.

A full (layout-independent) ``linear_qkv`` weight or bias holds its rows per key/value group,
Megatron style: ``[g0: q heads of group 0 (hq/g of them), k0, v0 | g1: ... ]``, each head ``d``
rows, so a contiguous split over tp gives every rank whole groups. Hugging Face keeps q, k and v
apart (each in head order); replicated-KV attention keeps ``linear_q`` and ``linear_kv``
(``[g0: k0, v0 | g1: ...]``). These functions convert between them by reshapes and concatenations only.
"""
from __future__ import annotations

import torch


def group_cat(parts: list[torch.Tensor], groups: int) -> torch.Tensor:
    """Interleave ``parts`` per group: each part's rows are ``groups`` equal blocks, block ``i`` of every
    part (in order) forms group ``i`` of the result."""
    rest = parts[0].shape[1:]
    return torch.cat([p.reshape(groups, -1, *rest) for p in parts], 1).reshape(-1, *rest)


def group_split(t: torch.Tensor, groups: int, rows: list[int]) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`group_cat`: the parts whose blocks hold ``rows[j]`` rows per group."""
    rest = t.shape[1:]
    grouped = t.reshape(groups, -1, *rest)
    out, start = [], 0
    for n in rows:
        out.append(grouped[:, start:start + n].reshape(-1, *rest))
        start += n
    return tuple(out)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """Separate q ``[hq*d, ...]``, k / v ``[g*d, ...]`` (head order) -> the fused per-group rows."""
    return group_cat([q, k, v], groups)


def split_qkv(t: torch.Tensor, groups: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: (q, k, v) of fused rows with ``heads`` query heads in ``groups`` groups."""
    d = t.shape[0] // (heads + 2 * groups)  # head dim
    return group_split(t, groups, [heads // groups * d, d, d])


def q_rows(full: torch.Tensor, g: int, qpg: int, d: int) -> torch.Tensor:
    """Query rows (global head order) of fused QKV rows."""
    return group_split(full, g, [qpg * d, 2 * d])[0]


def kv_rows(full: torch.Tensor, g: int, qpg: int, d: int) -> torch.Tensor:
    """Key/value rows ``[g0: k, v | g1: k, v | ...]`` of fused QKV rows."""
    return group_split(full, g, [qpg * d, 2 * d])[1]
