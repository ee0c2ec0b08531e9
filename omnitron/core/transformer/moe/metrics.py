"""The step's hooks into the MoE layers: the aux-loss gradient weight, and the logged aux loss (the
router losses added to the LM loss: load-balancing plus z-loss, whichever are enabled)."""
from __future__ import annotations

import torch

from omnitron.backends.collectives import ReduceOp


def moe_layers(modules) -> list:
    """Every :class:`MoELayer` inside ``modules`` (model chunks, wrapped or not)."""
    from omnitron.core.transformer.moe.layer import MoELayer

    return [m for mod in modules for m in mod.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(modules, scale: float) -> None:
    """Weight of each micro-batch's load-balancing loss in backward: the step's loss scale divided by
    the number of micro-batches, the same weight the runtime gives each micro-batch's LM loss."""
    for layer in moe_layers(modules):
        layer.aux_loss_scale = scale


def moe_aux_loss(modules, groups, collectives, num_microbatches: int) -> float:
    """Collective over pp and dp x cp: the load-balancing loss added to the LM loss this step (summed
    over layers, averaged over micro-batches and data-parallel replicas); resets the layers' totals."""
    total = torch.zeros(1, dtype=torch.float64)
    for layer in moe_layers(modules):
        if layer.aux_loss_total is not None:
            total += layer.aux_loss_total.detach().double().cpu()
            layer.aux_loss_total = None
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    total = total.to(device)
    for group in (groups.pp, groups.dp_cp):
        if group.handle is not None:
            collectives.all_reduce(total, op=ReduceOp.SUM, group=group.handle)
    return total.item() / (num_microbatches * groups.dp_cp.size)
