"""Which (token, expert) pairs an expert processes: dropless, or capped at a capacity.

Megatron's ``--moe-expert-capacity-factor F``: each expert takes at most
``ceil((T k / E) F)`` of the micro-batch's ``T`` tokens (``k`` picks each, ``E`` experts).
Over-subscribed experts drop the lowest-probability assignments (``--moe-token-drop-policy probs``)
or the latest-position ones (``position``). A dropped assignment contributes nothing: the token
keeps its residual (and its other picks). ``--moe-pad-expert-input-to-capacity`` makes every
expert process exactly ``capacity`` rows, filling with tokens it was not routed to, at weight 0.

NOTE: ``T`` is the whole micro-batch of one data-parallel replica (all tensor-parallel shards of
its sequence), so every layout drops exactly what one process drops; Megatron counts the tokens
of each tensor-parallel shard under sequence parallelism.
"""
from __future__ import annotations

import math

import torch

DROP_POLICIES = ("probs", "position")


def expert_capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Rows per expert: ``ceil((tokens * topk / num_experts) * factor)``, at most ``tokens``.

    NOTE: evaluated in the order Megatron's ``get_capacity`` does, float rounding included: ``T=100, k=1, E=3,
    F=0.9`` is 31 there (100 / 3 * 0.9 rounds to 30.000000000000004), 30 in the order ``F T k / E``, and one row
    of capacity changes which tokens are dropped."""
    return min(tokens, math.ceil((tokens * topk / num_experts) * factor))


def routing_mask(gates: torch.Tensor, picked: torch.Tensor, topk: int, capacity_factor: float | None,
                 drop_policy: str = "probs", pad_to_capacity: bool = False) -> torch.Tensor:
    """``[T, E]`` bool: the (token, expert) pairs that are processed.

    ``gates [T, E]``: routing probability where picked, 0 elsewhere (only compared, not
    differentiated); ``picked [T, E]`` bool: the router's ``topk`` picks per token. Without a capacity factor that is
    ``picked``. With one, each expert keeps its ``capacity`` best assignments, best meaning the
    highest gate (``probs``; ties: earlier token) or the earliest token (``position``).
    """
    if capacity_factor is None:
        return picked
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop policy {drop_policy!r} is not one of {', '.join(DROP_POLICIES)}")
    T, E = picked.shape
    cap = expert_capacity(T, topk, E, capacity_factor)
    score = gates if drop_policy == "probs" else picked.to(gates.dtype)
    # a stable descending sort keeps equal scores in token order: ties go to the earlier token
    order = torch.sort(score, dim=0, descending=True, stable=True).indices[:cap]  # [cap, E] token ids
    within = torch.zeros_like(picked).scatter_(0, order, True)
    return within if pad_to_capacity else within & picked
