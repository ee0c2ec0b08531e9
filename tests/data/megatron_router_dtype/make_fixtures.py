"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-CORE'S OWN ROUTER CODE: the routing of bf16 tokens and
bf16 logits that omnitron's router must reproduce bit for bit (tests/models/test_moe_router_dtype.py).

Needs a Megatron-LM checkout (snapshot d98e8a6 was used) and torch; runs on CPU, offline, in a second or two, without
Transformer Engine (so ``router_gating_linear`` is the plain ``torch.mm`` and routing the unfused path). omnitron is
not imported. Run from the omnitron root:

    MEGATRON=/path/to/Megatron-LM python tests/data/megatron_router_dtype/make_fixtures.py

For each seed of :data:`SEEDS`: bf16 tokens ``x [T, H]``, a bf16 gate weight ``[E, H]``, a float32 expert bias
``[E]`` and bf16 logits ``[T, E]`` (drawn in that order). Megatron's ``Router.gating`` (moe/router.py) turns the
tokens into logits with ``moe_router_dtype`` unset (bf16, the tokens' dtype) and ``fp32``; its
``topk_routing_with_score_function`` (moe/moe_utils.py, as ``TopKRouter.routing`` calls it) routes those and the
drawn logits under each case of :data:`CASES`; its ``compute_routing_scores_for_aux_loss`` gives the
load-balancing loss's scores and picks of the drawn logits. Stand-in on CPU, which changes no number:
``torch.cuda.current_device`` is "cpu" (``Router.gating`` moves a CPU weight there).

Stored compactly (the file stays ~100 KB): a routing map with exactly k experts per token as those experts'
indices ``[T, k]`` (uint8, ascending), the probabilities at them ``[T, k]`` (Megatron's dtype), the aux scores
``[T, E]`` once per score function.
"""
from __future__ import annotations

import os
import sys
import types

import torch

sys.path.insert(0, os.environ.get("MEGATRON", "/tmp/megatron"))
HERE = os.path.dirname(os.path.abspath(__file__))
H, E, T = 32, 16, 96
SEEDS = (11, 12, 13, 14)
FLAGS = {"default": None, "fp32": "fp32"}  # --moe-router-dtype
CASES = {  # name -> TransformerConfig's (and omnitron's GPTConfig's) MoE router fields
    "softmax": dict(moe_router_topk=2),
    "pre_softmax": dict(moe_router_topk=3, moe_router_pre_softmax=True),
    "groups_scaled": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                          moe_router_topk_scaling_factor=2.5),
    "sigmoid_bias": dict(moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "sigmoid_top1": dict(moe_router_topk=1, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=1.5),
}


def draw(seed: int) -> dict:
    """A seed's inputs: bf16 tokens, gate weight (std H^-1/2) and logits (std 2), a float32 expert bias (std 0.1)."""
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(T, H, generator=g).bfloat16(),
            "weight": (torch.randn(E, H, generator=g) * H ** -0.5).bfloat16(),
            "expert_bias": torch.randn(E, generator=g) * 0.1,
            "logits": (torch.randn(T, E, generator=g) * 2).bfloat16()}


def compact(routing_probs: torch.Tensor, routing_map: torch.Tensor, k: int) -> dict:
    """``{"experts" [T, k] uint8 ascending, "probs" [T, k]}`` of Megatron's dense ``[T, E]`` outputs."""
    assert bool((routing_map.sum(dim=-1) == k).all()), "a token routed to other than k experts"
    experts = routing_map.nonzero()[:, 1].view(T, k)
    return {"experts": experts.to(torch.uint8), "probs": routing_probs.gather(1, experts)}


def route(logits: torch.Tensor, case: dict, expert_bias: torch.Tensor) -> dict:
    """Megatron's routing of ``logits`` under ``case`` (the arguments ``TopKRouter.routing`` passes)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    k = case["moe_router_topk"]
    probs, routing_map = topk_routing_with_score_function(
        logits, k, use_pre_softmax=case.get("moe_router_pre_softmax", False),
        num_groups=case.get("moe_router_num_groups"), group_topk=case.get("moe_router_group_topk"),
        scaling_factor=case.get("moe_router_topk_scaling_factor"),
        score_function=case.get("moe_router_score_function", "softmax"),
        expert_bias=expert_bias if case.get("moe_router_enable_expert_bias") else None)
    return compact(probs, routing_map, k)


def gating(inputs: dict, flag: str | None) -> torch.Tensor:
    """Megatron's ``Router.gating`` of the seed's tokens under ``--moe-router-dtype flag`` (no gate bias)."""
    from megatron.core.transformer.moe.router import Router

    router = types.SimpleNamespace(weight=torch.nn.Parameter(inputs["weight"].clone()), bias=None,
                                   config=types.SimpleNamespace(moe_router_dtype=flag))
    with torch.no_grad():
        return Router.gating(router, inputs["x"])


def main() -> None:
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = lambda: "cpu"
    assert moe_utils.te_general_gemm is None, "run without Transformer Engine (its GEMM is not torch.mm's)"
    out = {"shape": dict(T=T, H=H, E=E), "cases": CASES, "inputs": {}, "gating": {}, "routing": {}, "aux": {}}
    for seed in SEEDS:
        inputs = out["inputs"][seed] = draw(seed)
        for flag_name, flag in FLAGS.items():
            logits = gating(inputs, flag)
            for name, case in CASES.items():
                out["gating"][f"{name}/{flag_name}/{seed}"] = route(logits, case, inputs["expert_bias"])
        for name, case in CASES.items():
            out["routing"][f"{name}/{seed}"] = route(inputs["logits"], case, inputs["expert_bias"])
            score = case.get("moe_router_score_function", "softmax")
            picks, scores = moe_utils.compute_routing_scores_for_aux_loss(inputs["logits"], case["moe_router_topk"],
                                                                          score)
            out["routing"][f"{name}/{seed}"]["aux_experts"] = compact(scores, picks, case["moe_router_topk"])["experts"]
            out["aux"][f"{score}/{seed}"] = scores
    torch.save(out, os.path.join(HERE, "fixtures.pt"))


if __name__ == "__main__":
    main()
