"""``finalize_model_grads``: every gradient reduction a step needs after its last backward.

Order (Megatron's): data-parallel reduction of each chunk's buckets; gradients that are partial sums
over tensor ranks (``param.sequence_parallel``: norm weights fed sequence shards, QK-norm weights, the
replicated key/value projection of replicated-KV attention) summed over ``groups.tp``; tied
word-embedding gradients summed over ``groups.embedding`` (first and last pipeline stage) so both
copies take the same update (on one rank, without communication, when a V-shaped schedule puts both
stages there). Under FSDP2 (``--use-torch-fsdp2``) the sums run over each rank's local
gradient shards: tp ranks shard their (identical-shape) replicated parameters alike, and the two stages'
embedding copies have the same shape and the same dp sharding, so the shards summed are the same rows.
"""
from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from omnitron.core.parallel.data.wrapper import unwrap_model
from omnitron.core.parallel.data.fsdp import local_shard


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient this rank holds: ``main_grad``, else ``.grad`` (FSDP2's DTensor: its local shard)."""
    if getattr(p, "main_grad", None) is not None:
        return p.main_grad
    return None if p.grad is None else local_shard(p.grad)


def _all_reduce_coalesced(grads: list[torch.Tensor], group, coll) -> None:
    """Sum ``grads`` over ``group`` in one collective per dtype, in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        coll.all_reduce(flat, group=group.handle)
        for g, r in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(r)


def sequence_parallel_params(chunk) -> list[torch.nn.Parameter]:
    """Parameters marked ``param.sequence_parallel = True`` (replicated over tp, fed sequence shards)."""
    return [p for p in unwrap_model(chunk).parameters() if getattr(p, "sequence_parallel", False)]


def finalize_model_grads(chunks: list, groups, *, collectives=None, sequence_parallel_params_fn=None) -> None:
    """Finish data-parallel sync, then sum sequence-parallel and tied-embedding gradients.

    ``chunks`` are this rank's model chunks (DDP-wrapped or not). Chunks may define
    ``shared_embedding_parameters()``; on the first and last pipeline stage these lists must match
    in length and shape. ``sequence_parallel_params_fn(chunk)`` overrides the default selection.
    """
    coll = collectives or groups.collectives  # None: a one-process layout, nothing to reduce
    for c in chunks:
        if hasattr(c, "finish_grad_sync"):
            c.finish_grad_sync()
    # NOTE: not only under --sequence-parallel: replicated-KV weights and QK-norm weights are partial over tp
    # whenever tp > 1; the attribute marks exactly the partial ones (norms carry it under SP only)
    if groups.tp.size > 1:
        pick = sequence_parallel_params_fn or sequence_parallel_params
        grads = [g for c in chunks for p in pick(c) if (g := _grad(p)) is not None]
        if grads:
            _all_reduce_coalesced(grads, groups.tp, coll)
    if groups.embedding.size > 1:
        owners = []  # per chunk holding tied copies: their gradients
        for c in chunks:
            fn = getattr(unwrap_model(c), "shared_embedding_parameters", None)
            shared = list(fn()) if fn is not None else []
            if shared:
                owners.append([g if (g := _grad(p)) is not None else _zero_grad(p) for p in shared])
        if len(owners) > 1:  # a V-shaped schedule: the first and the last stage are chunks of this rank
            _sum_local_copies(owners)
        elif owners:
            _all_reduce_coalesced(owners[0], groups.embedding, coll)


def _sum_local_copies(owners: list[list[torch.Tensor]]) -> None:
    """Give every chunk's copy of a tied parameter the sum of the copies' gradients (no communication: the
    other ranks of ``groups.embedding`` hold no copy then)."""
    for copies in zip(*owners):
        total = copies[0].clone()
        for g in copies[1:]:
            total += g
        for g in copies:
            g.copy_(total)


def _zero_grad(p: torch.nn.Parameter) -> torch.Tensor:
    p.grad = torch.zeros_like(p)
    return local_shard(p.grad)


def scale_gradients(chunks: list, factor: float) -> None:
    """Multiply every gradient of ``chunks`` by ``factor`` in place (one op per gradient buffer of a wrapped
    chunk): ``--calculate-per-token-loss`` divides the reduced gradients by the step's token count."""
    for c in chunks:
        buffers = getattr(c, "buffers", None)
        if isinstance(buffers, list) and buffers:
            for buf in buffers:
                buf.data.mul_(factor)
            continue
        for p in c.parameters():
            if (g := _grad(p)) is not None:
                g.mul_(factor)
