"""Routing imbalance and dropped tokens in ``omnitron plan``'s speed model, from a measured routing histogram
(``omnitron plan --moe-expert-load FILE``).

Without one the plan prices **balanced routing**: every expert receives ``T k / E`` of a micro-batch's ``T k``
assignments. A histogram gives each expert's share ``p_e`` of the assignments, one row per MoE layer (the
router's picks before any capacity, e.g. counted in an earlier run). Per micro-batch and layer, as the engine
routes (:mod:`omnitron.core.transformer.moe.capacity`, :mod:`omnitron.core.transformer.moe.dispatch`):

- expert ``e`` takes ``c_e = p_e T k`` rows of one replica's micro-batch, at most the capacity
  ``ceil(F T k / E)`` under ``--moe-expert-capacity-factor F`` (exactly the capacity with
  ``--moe-pad-expert-input-to-capacity``); the excess is dropped, ``sum_e max(0, p_e T k - cap) / (T k)`` of
  the assignments (the tokens keep their residual);
- ep rank ``r`` holds experts ``[r E / ep, (r + 1) E / ep)`` and receives every source's rows for them:
  ``c_e ep etp / tp`` rows per local expert (its ep and etp peers' micro-batches, ``tp`` ranks sharing one);
- an ep group waits for its **busiest rank** (the one whose experts hold the most rows): its experts' GEMMs
  and activation, and its all-to-alls, priced at the larger of what a rank sends (``sum_e c_e / tp`` rows) and
  what the busiest receives (``sum_{e of r} c_e ep / tp``).

A histogram with one row per MoE layer prices each layer at its own row (in the model's order, so the pipeline
stage holding the skewed layers is the slower one); any other number of rows prices every MoE layer at the
mean of its cost over them. Assumed: every source routes by the same shares; a histogram summed over many steps
understates one micro-batch's imbalance by its sampling noise. The memory model takes the same rows
(:func:`expert_rows`) for each ep rank's experts and reports each stage's busiest
(:func:`omnitron.plan.memory.estimate`).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Sequence

from omnitron.core.config.parallel import ConfigError
from omnitron.core.transformer.moe.capacity import expert_capacity


@dataclass(frozen=True)
class ExpertLoad:
    """A routing histogram: each MoE layer's per-expert share of the assignments (each row sums to 1)."""

    path: str
    shares: tuple[tuple[float, ...], ...]
    key: str
    """A digest of the shares (what a cached layer cost is keyed by)."""

    def check(self, num_experts: int) -> None:
        """ConfigError unless every row has ``num_experts`` entries (the model's ``--num-experts``)."""
        if any(len(row) != num_experts for row in self.shares):
            raise ConfigError(f"--moe-expert-load {self.path}: rows of {len(self.shares[0])} experts, the model has "
                              f"{num_experts}; give one count per expert")


def read_expert_load(path: str) -> ExpertLoad:
    """The histogram in ``path``: JSON ``{"tokens_per_expert": [[count per expert], ...]}`` (one row per MoE
    layer; a flat list is one row for every layer). ConfigError naming the problem otherwise."""
    where = f"--moe-expert-load {path}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{where}: cannot read it as JSON ({err})") from None
    rows = data.get("tokens_per_expert") if isinstance(data, dict) else None
    if isinstance(rows, list) and rows and not isinstance(rows[0], list):
        rows = [rows]
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f'{where}: expected {{"tokens_per_expert": [[count per expert], ...]}}, one row per MoE '
                          'layer')
    shares = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(v, (int, float)) and v >= 0 for v in row):
            raise ConfigError(f"{where}: row {i} is not a list of non-negative counts (one per expert)")
        if len(row) != len(rows[0]):
            raise ConfigError(f"{where}: row {i} has {len(row)} experts, row 0 {len(rows[0])}; give one count per "
                              "expert in every row")
        total = float(sum(row))
        if total <= 0:
            raise ConfigError(f"{where}: row {i} counts no assignment; give the router's picks per expert")
        shares.append(tuple(v / total for v in row))
    shares = tuple(shares)
    return ExpertLoad(path, shares, hashlib.sha1(repr(shares).encode()).hexdigest())


def rows_floor(x: float) -> int:
    """Rows as a whole number (floor, with float rounding below a whole number forgiven)."""
    return int(math.floor(x + 1e-6))


def expert_rows(cfg, tokens: int, share: Sequence[float] | None) -> list[float]:
    """``c_e``: rows each expert takes of one micro-batch of ``tokens`` tokens (module docstring); balanced
    (``share`` None): ``T k // E`` each."""
    E, k = cfg.num_experts, cfg.moe_router_topk
    c = [float(tokens * k // E)] * E if share is None else [p * tokens * k for p in share]
    if cfg.moe_expert_capacity_factor is not None:
        cap = expert_capacity(tokens, k, E, cfg.moe_expert_capacity_factor)  # as the engine sizes it
        c = [float(cap)] * E if cfg.moe_pad_expert_input_to_capacity else [min(v, cap) for v in c]
    return c


def dropped(cfg, tokens: int, share: Sequence[float] | None) -> float:
    """The fraction of the assignments the capacity drops (0 dropless or padded beyond them)."""
    taken = expert_rows(cfg, tokens, share)
    want = [p * tokens * cfg.moe_router_topk for p in share] if share is not None else taken
    return sum(max(0.0, w - t) for w, t in zip(want, taken)) / (tokens * cfg.moe_router_topk)


def busiest_rank(rows: Sequence[float], ep: int) -> int:
    """The ep rank whose experts (``E / ep`` contiguous ones each) hold the most rows (the first on a tie)."""
    local = len(rows) // ep
    loads = [sum(rows[r * local:(r + 1) * local]) for r in range(ep)]
    return loads.index(max(loads))


def imbalance(cfg, tokens: int, load: ExpertLoad, ep: int) -> tuple[float, float]:
    """(the busiest ep rank's rows over the mean rank's, the dropped fraction), each the mean over the
    histogram's layers: what the plan prints beside a prediction."""
    ratio, drop = 0.0, 0.0
    for share in load.shares:
        c = expert_rows(cfg, tokens, share)
        r, local = busiest_rank(c, ep), cfg.num_experts // ep
        ratio += sum(c[r * local:(r + 1) * local]) / (sum(c) / ep) if sum(c) else 1.0
        drop += dropped(cfg, tokens, share)
    return ratio / len(load.shares), drop / len(load.shares)


def describe(cfg, settings, rates) -> str:
    """The MoE routing the prediction priced: balanced, or the histogram's imbalance and drops at this ep.
    ``cfg``: the model config as training builds it (:func:`omnitron.plan.memory.model_config`, which the caller
    holds: the memory model imports this module's users)."""
    load = getattr(rates, "expert_load", None)
    if load is None:
        return "MoE: balanced routing (every expert receives tokens x top-k / experts rows)"
    from omnitron.plan import work

    pc = settings.parallel
    x = work.local_shapes(cfg, pc.tensor_model_parallel_size, pc.context_parallel_size,
                          settings.training.micro_batch_size)
    ratio, drop = imbalance(cfg, x.tokens, load, pc.expert_model_parallel_size)
    return (f"MoE: routing from {load.path} ({len(load.shares)} layer(s)): the busiest ep rank's experts take "
            f"{ratio:.2f}x the mean rank's rows, {100 * drop:.2f}% of assignments dropped (means over its layers); "
            "memory on each stage's busiest ep rank")
