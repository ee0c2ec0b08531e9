"""``--moe-expert-load-out FILE`` (omnitron's; Megatron-LM has no flag that writes one): the routing histogram
of a training run, the file ``omnitron plan --moe-expert-load`` reads.

Each decoder MoE layer's router counts its top-k picks per expert **before any capacity** (what the plan's
routing model takes as the shares, :mod:`omnitron.plan.routing`), in training forwards only (not evaluation,
not a full recomputation's second forward), into an int64 ``[E]`` tensor on the device: one ``scatter_add_``
a forward, no host sync. :func:`write` (at each checkpoint save and at the end of training) sums them over the
ranks whose tokens differ (dp x cp, and tp under sequence parallelism: without it the tp ranks route the same
tokens), places each layer at its ordinal among the model's MoE layers (the pipeline stages hold different
layers: summed over pp into one ``[MoE layers, E]`` table), and global rank 0 writes
``{"tokens_per_expert": [[count per expert], ...]}`` atomically (a temporary file renamed over the target).
The counts are this process's run: a resumed run counts from where it resumed. The multi-token prediction
depths' MoE layers are not decoder layers and are left out (the plan prices the decoder's).
"""
from __future__ import annotations

import json
import os

import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.transformer.moe.metrics import moe_layers
from omnitron.core.transformer.moe.pattern import moe_layer_pattern


def _decoder_moe(modules) -> list:
    return [m for m in moe_layers(modules) if m.layer_number is not None]


def start(modules, cfg) -> None:
    """Give every decoder MoE layer's router a zeroed pick counter on its device. ConfigError without experts."""
    if not cfg.num_experts:
        raise ConfigError("--moe-expert-load-out counts the routers' picks of an MoE model; give --num-experts "
                          "or drop it")
    for layer in _decoder_moe(modules):
        router = layer.router
        router.expert_picks = torch.zeros(cfg.num_experts, dtype=torch.int64, device=router.weight.device)


def histogram(modules, cfg, groups, sequence_parallel: bool) -> torch.Tensor:
    """``[MoE layers, E]`` int64: the picks of every decoder MoE layer in the model's order, summed over the
    token-holding ranks (module docstring). Collective over dp x cp, tp under SP, and pp."""
    rows = [i for i, moe in enumerate(moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)) if moe]
    ordinal = {layer: j for j, layer in enumerate(rows)}
    mine = _decoder_moe(modules)
    device = next(p.device for m in modules for p in m.parameters())
    table = torch.zeros(len(rows), cfg.num_experts, dtype=torch.int64, device=device)
    for layer in mine:
        table[ordinal[layer.layer_number]] += layer.router.expert_picks
    table = M.all_reduce(table, groups.dp_cp)
    if sequence_parallel:
        table = M.all_reduce(table, groups.tp)
    return M.all_reduce(table, groups.pp)


def write(path: str, modules, cfg, groups, sequence_parallel: bool) -> None:
    """:func:`histogram` written to ``path`` by global rank 0, atomically. Collective (every rank calls it)."""
    table = histogram(modules, cfg, groups, sequence_parallel).tolist()
    if groups.rank != 0:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"tokens_per_expert": table}, f)
        f.write("\n")
    os.replace(tmp, path)
