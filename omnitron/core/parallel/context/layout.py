"""Megatron's load-balanced sequence split for causal context parallelism.

The sequence is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` (an early and a late chunk), so under a causal mask every rank attends to the
same number of (query, key) pairs. Everything in a rank's slice keeps this order: tokens,
labels, loss mask, position ids and the activations ``[s / cp, b, h]``.
"""
from __future__ import annotations

import torch


def check_divisible(seq_length: int, cp: int) -> None:
    """Raise ValueError unless ``seq_length`` splits into ``2 * cp`` equal chunks."""
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x --context-parallel-size {cp} = "
                         f"{2 * cp} (each context-parallel rank holds two equal chunks); change --seq-length")


def chunk_positions(seq_length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions ``[seq_length / cp]`` (int64) held by cp rank ``rank``, in local order."""
    check_divisible(seq_length, cp)
    c = seq_length // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, last])


def local_positions(local_length: int, group, device=None) -> torch.Tensor:
    """Position ids ``[local_length]`` of this rank's slice (``arange`` without context parallelism)."""
    if group.size == 1:
        return torch.arange(local_length, device=device)
    return chunk_positions(local_length * group.size, group.size, group.rank, device)


def split_sequence(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (a copy; the identity at ``cp == 1``)."""
    if cp == 1:
        return t
    return t.index_select(dim, chunk_positions(t.shape[dim], cp, rank, t.device))


def context_parallel_batch(batch: dict, group) -> dict:
    """This cp rank's slice of a micro-batch of ``[b, s]`` tensors (tokens, labels, loss mask, positions).

    Positions are added when the batch has none (the slice is not ``arange``). ``cp_num_tokens``
    is the whole micro-batch's loss-token count divided by cp: with :func:`context_parallel_loss`
    every rank's share of the mean is ``local loss sum / all tokens`` times cp, which the
    data-parallel average over ``dp x cp`` turns back into the one-process mean.
    """
    if group.size == 1:
        return batch
    cp, rank = group.size, group.rank
    out = {k: split_sequence(v, 1, cp, rank) if torch.is_tensor(v) and v.dim() == 2 else v for k, v in batch.items()}
    ref = batch.get("tokens", batch.get("labels"))
    if out.get("position_ids") is None and ref is not None:
        out["position_ids"] = chunk_positions(ref.shape[1], cp, rank, ref.device).expand(ref.shape[0], -1)
    mask = batch.get("loss_mask")
    count = mask.float().sum() if mask is not None else torch.tensor(float(batch["labels"].numel()))
    out["cp_num_tokens"] = count / cp
    return out


def context_parallel_loss(total: torch.Tensor, count, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` of a loss function turned into this cp rank's share (see :func:`context_parallel_batch`)."""
    if isinstance(batch, dict) and "cp_num_tokens" in batch:
        return total, batch["cp_num_tokens"].to(total.device)
    return total, count
