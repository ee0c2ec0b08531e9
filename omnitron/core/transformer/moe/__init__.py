"""Mixture-of-Experts with expert parallelism (Megatron's ``--num-experts``, ``--moe-router-topk``,
``--expert-model-parallel-size``): a top-k softmax router with a load-balancing loss, dropless
all-to-all dispatch over ``groups.ep``, and experts that are the dense model's MLP."""
from omnitron.core.transformer.moe.dispatch import all_to_all, combine, dispatch
from omnitron.core.transformer.moe.layer import MoELayer
from omnitron.core.transformer.moe.metrics import moe_aux_loss, set_aux_loss_scale
from omnitron.core.transformer.moe.router import TopKRouter, load_balancing_loss, top_k_routing
from omnitron.core.transformer.moe.validate import validate_moe

__all__ = ["MoELayer", "TopKRouter", "top_k_routing", "load_balancing_loss", "dispatch", "combine", "all_to_all",
           "validate_moe", "set_aux_loss_scale", "moe_aux_loss"]
