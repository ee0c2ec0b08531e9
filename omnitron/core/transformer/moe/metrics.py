"""The step's hooks into the MoE layers: the aux-loss gradient weight, and the logged aux loss (the
router losses added to the LM loss: load-balancing plus z-loss, whichever are enabled)."""
from __future__ import annotations

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.transformer.moe.layer import MoELayer


def moe_layers(modules) -> list:
    """Every :class:`MoELayer` inside ``modules`` (model chunks, wrapped or not)."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, MoELayer)]


def set_aux_loss_scale(modules, scale: float) -> None:
    """Weight of each micro-batch's load-balancing loss in backward: the step's loss scale divided by
    the number of micro-batches, the same weight the runtime gives each micro-batch's LM loss. Written in place
    into a float32 0-dim tensor on the layer's device: a compiled layer (``--torch-compile``) takes it as a graph
    input, where a float attribute was a constant its guard checked (--fp16: a recompilation at every new loss
    scale, eager after dynamo's 8), and a captured backward (``--cuda-graph-impl local``) reads its value now."""
    for layer in moe_layers(modules):
        held = layer.aux_loss_scale
        device = layer.router.weight.device
        if not isinstance(held, torch.Tensor) or held.device != device:
            held = layer.aux_loss_scale = torch.zeros((), dtype=torch.float32, device=device)
        held.fill_(scale)


def moe_aux_loss(modules, groups, collectives, num_microbatches: int) -> float:
    """Collective over pp and dp x cp: the load-balancing loss added to the LM loss this step (summed
    over layers, averaged over micro-batches and data-parallel replicas); resets the layers' totals."""
    return logged_loss(modules, moe_layers(modules), "aux_loss_total", groups, collectives, num_microbatches)


def logged_loss(modules, holders, attr: str, groups, collectives, num_microbatches: int) -> float:
    """Collective over pp and dp x cp: the sum of the ``holders``' ``attr`` totals (detached losses added this
    step), averaged over micro-batches and data-parallel replicas; resets them to None."""
    total = torch.zeros(1, dtype=torch.float64)
    for holder in holders:
        if getattr(holder, attr) is not None:
            total += getattr(holder, attr).detach().double().cpu()
            setattr(holder, attr, None)
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    total = total.to(device)
    for group in (groups.pp, groups.dp_cp):
        if group.handle is not None:
            collectives.all_reduce(total, op=ReduceOp.SUM, group=group.handle)
    return total.item() / (num_microbatches * groups.dp_cp.size)
