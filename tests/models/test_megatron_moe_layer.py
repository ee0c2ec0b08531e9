"""omnitron's MoE layer against megatron-core's own (fixtures written by Megatron's code on CPU:
tests/data/megatron_moe/make_fixtures.py, which says how to re-run it): the same weights and tokens give the same
output, input gradient, parameter gradients and router losses for expert capacity with the ``probs`` drop policy
(dropped and padded), Megatron's list form of the load-balancing losses, seq_aux_loss with sigmoid group-limited
routing, the z-loss and a shared expert; with the expert bias and a capacity, the step's tokens per expert (the
routing map after the capacity) and the bias's update. (The ``position`` policy is left out: Megatron keeps its
capacity with ``torch.topk`` over 0/1 values, whose order among equal values the CPU kernel leaves unspecified.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "megatron_moe")
with open(os.path.join(HERE, "fixtures.json")) as _f:
    FIXTURES = json.load(_f)


def _megatron_name(name: str) -> str:
    """omnitron's ``experts.<global index>.`` is Megatron's ``experts.local_experts.<local index>.`` at ep 1."""
    return name.replace("experts.", "experts.local_experts.", 1) if name.startswith("experts.") else name


def _layer(settings: dict, seed: int):
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe import MoELayer

    sh = FIXTURES["shape"]
    c = gpt2_tiny(num_layers=2, hidden_size=sh["h"], num_attention_heads=2, ffn_hidden_size=2 * sh["h"],
                  seq_length=sh["s"], max_position_embeddings=sh["s"], vocab_size=64, hidden_dropout=0.0,
                  attention_dropout=0.0, num_experts=sh["E"], moe_router_topk=sh["k"], moe_ffn_hidden_size=sh["f"],
                  swiglu=True, add_bias_linear=False, params_dtype=torch.float64, **settings)
    layer = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    params = {_megatron_name(n): p for n, p in layer.named_parameters()}
    g = torch.Generator().manual_seed(seed)  # make_fixtures.draw: the names sorted, router 0.5, others 0.3
    with torch.no_grad():
        for n in sorted(params):
            params[n].copy_(torch.randn(params[n].shape, generator=g, dtype=torch.float64)
                            * (0.5 if n.startswith("router") else 0.3))
    return c, layer.train(), params


def _logged(c, tracker: dict) -> float:
    """The router losses added to the LM loss from Megatron's tracker (each loss without its coefficient)."""
    types, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    pairs = zip(types, coeffs) if isinstance(types, list) else [(types, coeffs)]
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}
    total = sum(v * tracker[name[t]] for t, v in pairs if t != "none")
    return total + (c.moe_z_loss_coeff or 0.0) * tracker["z_loss"]


@pytest.mark.parametrize("case", sorted(FIXTURES["cases"]))
def test_moe_layer_matches_megatron_core(case):
    ref = FIXTURES["cases"][case]
    c, layer, params = _layer(ref["settings"], ref["seed"])
    sh = FIXTURES["shape"]
    g = torch.Generator().manual_seed(ref["seed"] + 1)
    x = torch.randn(sh["s"], sh["b"], sh["h"], generator=g, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(sh["s"], sh["b"], sh["h"], generator=g, dtype=torch.float64)
    layer.aux_loss_scale = FIXTURES["scale"]
    bias = layer.router.expert_bias
    if bias is not None:  # make_fixtures: drawn from seed + 2, float32
        bias.copy_(torch.randn(sh["E"], generator=torch.Generator().manual_seed(ref["seed"] + 2)) * 0.3)
    y, _ = layer(x)
    (y * dy).sum().backward()
    # Both route in float32 (Megatron's --moe-router-dtype fp32) on float64 tokens: the gates carry float32 rounding
    # (~6e-8 relative), the float64 experts none, so the outputs agree to ~1e-7 relative at worst. The router losses
    # and their gradients are float32 sums of O(T E) = 32 positive terms in possibly another order: ~32 x 6e-8
    # = 2e-6 relative; 1e-5 leaves room, far below the O(1) effect of any wrong drop, count or coefficient.
    torch.testing.assert_close(y.detach().flatten(), torch.tensor(ref["y"], dtype=torch.float64), rtol=1e-6,
                               atol=1e-7)
    torch.testing.assert_close(x.grad.flatten(), torch.tensor(ref["dx"], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert sorted(n for n, p in params.items() if p.grad is not None) == sorted(ref["grads"])
    for n, want in ref["grads"].items():
        torch.testing.assert_close(params[n].grad.flatten(), torch.tensor(want, dtype=torch.float64), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{n}: {m}")
    logged = 0.0 if layer.aux_loss_total is None else layer.aux_loss_total.item()
    assert logged == pytest.approx(_logged(c, ref["tracker"]), rel=1e-5)
    if bias is not None:  # counts are integers, the update a float32 sign step: both exact
        from omnitron.core.parallel.groups import ParallelGroups
        from omnitron.core.transformer.moe.router import update_expert_bias

        assert layer.router.tokens_per_expert.tolist() == ref["tokens_per_expert"]
        update_expert_bias([layer], ParallelGroups.single(), sequence_parallel=False)
        assert bias.tolist() == ref["updated_expert_bias"]
