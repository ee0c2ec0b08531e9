"""Mixture-of-Experts with expert parallelism (Megatron's ``--num-experts``, ``--moe-router-topk``,
``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``): a top-k softmax or sigmoid
router with load-balancing and z losses, all-to-all dispatch over ``groups.ep`` (dropless or with
an expert capacity), experts that are the dense model's MLP (optionally split over ``groups.etp``),
an optional shared expert, and ``--moe-layer-freq`` to choose the MoE layers."""
from omnitron.core.transformer.moe.dispatch import all_to_all, combine, dispatch
from omnitron.core.transformer.moe.layer import MoELayer
from omnitron.core.transformer.moe.metrics import moe_aux_loss, set_aux_loss_scale
from omnitron.core.transformer.moe.router import TopKRouter, load_balancing_loss, top_k_routing
from omnitron.core.transformer.moe.validate import validate_moe

__all__ = ["MoELayer", "TopKRouter", "top_k_routing", "load_balancing_loss", "dispatch", "combine", "all_to_all",
           "validate_moe", "set_aux_loss_scale", "moe_aux_loss"]
