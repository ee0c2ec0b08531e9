"""Full (layout-independent) views of a GPT stage's parameters and gradients.

Used by the parity tests and by checkpoint resharding: :func:`gather_full_state` returns every
parameter (or gradient) at its full, unpadded shape under its global name; :func:`shard_full_state`
loads such a dict into any layout. The last stage's copy of a tied word embedding is skipped
(it equals ``embedding.word_embeddings.weight``).
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.tensor.mappings import local_rank
from omnitron.core.parallel.tensor.sharding import gather_param, shard_param


def _grad_of(p: torch.Tensor) -> torch.Tensor | None:
    return getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad


def gather_full_state(model: torch.nn.Module, groups, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """``{global name: full tensor}`` of this stage's parameters (or their gradients, preferring
    ``main_grad``), gathered over ``groups.tp``; every tp rank gets the result. Collective over tp."""
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "shared_embedding", False):
            continue
        t = _grad_of(p) if grads else p.detach()
        if t is None:
            t = torch.zeros_like(p)
        out[name] = gather_param(t.detach(), p, groups.tp)
    for prefix, mod in model.named_modules():
        if hasattr(mod, "fuse_full_state"):
            mod.fuse_full_state(prefix + ".", out)
    return out


@torch.no_grad()
def shard_full_state(model: torch.nn.Module, full: dict[str, torch.Tensor], groups, *, strict: bool = True) -> None:
    """Copy this rank's shard of each full tensor in ``full`` into the model's parameters.

    The tied embedding copy on a last stage reads ``embedding.word_embeddings.weight``.
    ``strict`` raises on a missing name, naming it.
    """
    params = dict(model.named_parameters())
    for name, t in full_state_shards(model, full, groups.tp.size, local_rank(groups.tp), strict=strict).items():
        params[name].copy_(t)


def full_state_shards(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_size: int, tp_rank: int, *,
                      strict: bool = True, keep_dtype: bool = False) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor-parallel rank tp_rank's shard}`` of the full tensors in ``full``, at
    each parameter's dtype (``keep_dtype``: at the full tensor's, for optimizer state); pure (no
    communication), so checkpoint resharding can cut any rank's shard offline. ``strict`` raises on
    a missing name, naming it."""
    for prefix, mod in model.named_modules():
        if hasattr(mod, "split_full_state"):
            full = mod.split_full_state(prefix + ".", full)
    out = {}
    for name, p in model.named_parameters():
        key = getattr(p, "init_name", name)
        if key not in full:
            if strict:
                raise KeyError(f"full state has no tensor for parameter {key!r}")
            continue
        out[name] = shard_param(full[key] if keep_dtype else full[key].to(p.dtype), p, tp_size, tp_rank)
    return out


def sequence_parallel_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters whose gradients are partial over tp (``sequence_parallel=True``)."""
    return [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]


def allreduce_sequence_parallel_grads(model: torch.nn.Module, groups) -> None:
    """Sum, over ``groups.tp``, the gradients (``main_grad`` when present, else ``.grad``) of the
    parameters marked ``sequence_parallel``: norm weights/biases under sequence parallelism, row
    biases under sequence parallelism and QK-norm weights. One coalesced all-reduce."""
    if groups.tp.size == 1:
        return
    grads = [g for g in (_grad_of(p) for p in sequence_parallel_parameters(model)) if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).to(torch.promote_types(g.dtype, torch.float32)) for g in grads])  # f64 stays f64
    groups.tp.collectives.all_reduce(flat, group=groups.tp.handle)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
