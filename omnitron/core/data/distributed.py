"""Which ranks read data, and sharing one read across a tensor-parallel group.

Only the first pipeline stage (tokens, position_ids) and the last (labels, loss_mask) use a
batch, unless samples carry ``document_ids`` (``--reset-attention-mask``): every stage's attention
needs those. Inside a tensor-parallel group either every rank reads the same indices (the sampler
takes the data-parallel rank only, so they agree), or member 0 reads and ``broadcast_batch``
sends the batch to the others: one read per group instead of one per rank.
"""
from __future__ import annotations

import torch

INT_KEYS = ("tokens", "labels", "position_ids")


def needs_batch(groups, document_ids: bool = False) -> bool:
    """True on the first and last pipeline stages (the ranks whose model consumes a batch); on every
    stage when batches carry ``document_ids`` (each stage's attention masks by document)."""
    return document_ids or groups.pp.is_first or groups.pp.is_last


def broadcast_batch(batch: dict[str, torch.Tensor] | None, *, group, collectives, micro_batch_size: int,
                    seq_length: int, device: torch.device | str = "cpu",
                    document_ids: bool = False) -> dict[str, torch.Tensor]:
    """Member 0 of ``group`` passes its collated batch; every member returns it on ``device``.

    Two broadcasts: the int64 fields stacked ``[3, b, s]`` (``[4, b, s]`` with ``document_ids``, which
    every member must then pass) and the float32 ``loss_mask [b, s]``.
    At group size 1 the batch is only moved to ``device``.
    """
    int_keys = INT_KEYS + (("document_ids",) if document_ids else ())
    if group.size == 1 or group.handle is None:
        if batch is None:
            raise ValueError("broadcast_batch: a group of one must pass its own batch")
        return {k: v.to(device) for k, v in batch.items()}
    shape = (micro_batch_size, seq_length)
    if group.rank == 0:
        if batch is None:
            raise ValueError("broadcast_batch: member 0 of the group must pass the batch it read")
        if document_ids and "document_ids" not in batch:
            raise ValueError("broadcast_batch(document_ids=True): the batch has no document_ids; build the "
                             "dataset with --reset-attention-mask or pass document_ids=False")
        bad = {k: tuple(batch[k].shape) for k in (*int_keys, "loss_mask") if tuple(batch[k].shape) != shape}
        if bad:
            raise ValueError(f"broadcast_batch: expected [micro_batch_size, seq_length] = {shape}, got {bad}")
        ints = torch.stack([batch[k].to(device=device, dtype=torch.int64) for k in int_keys])
        mask = batch["loss_mask"].to(device=device, dtype=torch.float32).contiguous()
    else:
        ints = torch.empty((len(int_keys), *shape), dtype=torch.int64, device=device)
        mask = torch.empty(shape, dtype=torch.float32, device=device)
    src = group.global_rank(0)
    collectives.broadcast(ints, src, group=group.handle)
    collectives.broadcast(mask, src, group=group.handle)
    out = {k: ints[i] for i, k in enumerate(int_keys)}
    out["loss_mask"] = mask
    return out
