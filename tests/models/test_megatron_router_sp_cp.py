"""The router's losses under sequence and context parallelism against megatron-core's own TopKRouter on two ranks
(fixtures: tests/data/megatron_moe/make_router_sp_cp_fixtures.py, which says how to re-run it).

Megatron routes each rank's tokens (a tp shard of the sequence under sequence parallelism, cp's load-balanced
chunks) and reduces the load-balancing statistics (counts and token totals; per sequence for seq_aux_loss) over its
tp x cp group, the z-loss's coefficient divided by its size. omnitron's router on the whole micro-batch in one
process must give what Megatron's training makes of the two ranks: the router weight's reduced gradient, each
rank's input gradient and the logged losses. (omnitron's own tp x cp layouts equal its one-process run:
tests/parallel/test_expert_context_parallel.py.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "megatron_moe", "router_sp_cp.json")
with open(PATH) as _f:
    FIXTURES = json.load(_f)
NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


def _router(settings: dict):
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.transformer.moe.router import TopKRouter

    sh = FIXTURES["shape"]
    c = gpt2_tiny(num_layers=2, hidden_size=sh["h"], num_attention_heads=2, ffn_hidden_size=24, seq_length=sh["s"],
                  max_position_embeddings=sh["s"], vocab_size=64, num_experts=sh["E"], params_dtype=torch.float64,
                  add_bias_linear=False, moe_router_dtype="fp32", **settings)  # the fixtures' router dtype
    return c, TopKRouter(c, partial_grad=False).train()


def _logged(c, logged: dict) -> float:
    """The router losses added to the LM loss, from Megatron's reduced tracker (each loss without its coefficient)."""
    types, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    pairs = zip(types, coeffs) if isinstance(types, list) else [(types, coeffs)]
    total = sum(v * logged[NAMES[t]] for t, v in pairs if t != "none" and v > 0)
    return total + (c.moe_z_loss_coeff or 0.0) * logged.get("z_loss", 0.0)


@pytest.mark.parametrize("mode", ["tp", "cp"])
@pytest.mark.parametrize("case", sorted(FIXTURES["cases"]))
def test_router_losses_match_megatron_under_sp_and_cp(case, mode):
    c, router = _router(FIXTURES["cases"][case])
    sh = FIXTURES["shape"]
    s, b, h, E = sh["s"], sh["b"], sh["h"], sh["E"]
    g = torch.Generator().manual_seed(FIXTURES["seed"])  # make_router_sp_cp_fixtures.draw
    w = torch.randn(E, h, generator=g, dtype=torch.float64)
    x = torch.randn(s, b, h, generator=g, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(s, b, E, generator=g, dtype=torch.float64)
    with torch.no_grad():
        router.weight.copy_(w)
    probs, experts, aux = router(x.reshape(-1, h), b)
    gates = probs.new_zeros(s * b, E).scatter(1, experts, probs)
    ((gates * dy.reshape(-1, E)).sum() + aux).backward()
    # Both routers compute in float32 from float64 tokens; the losses and their gradients are float32 sums of
    # O(T E) = 192 positive terms, Megatron's in two partial sums added by the all-reduce: ~192 x 6e-8 = 1.2e-5
    # relative at worst, ~sqrt(192) x 6e-8 = 1e-6 typically; rtol 2e-5 (above the worst case, so another CPU's
    # summation order passes) / atol 1e-6 sits far below the O(1) change of a token counted twice or left out, a
    # statistic reduced over the wrong group or a coefficient off by the group size.
    for rank in range(2):
        run = FIXTURES["runs"][f"{mode}{rank}"][case]
        mine = x.grad[run["positions"]].flatten()
        torch.testing.assert_close(mine, torch.tensor(run["dx"], dtype=torch.float64), rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} input gradient: {m}")
    run = FIXTURES["runs"][f"{mode}0"][case]
    torch.testing.assert_close(router.weight.grad.flatten(), torch.tensor(run["weight_grad"], dtype=torch.float64),
                               rtol=2e-5, atol=1e-6)
    assert aux.item() == pytest.approx(_logged(c, run["logged"]), rel=2e-5)
