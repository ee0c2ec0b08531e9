"""The router's dtypes against Megatron's own code (megatron/core/transformer/moe/router.py ``Router.gating``,
moe_utils.py ``topk_routing_with_score_function``, ``compute_routing_scores_for_aux_loss``, ``z_loss_func`` at
d98e8a6): the logits in ``--moe-router-dtype``'s dtype or, unset, the tokens' (bf16 in a bf16 model); the top-k on
the logits; the scores (softmax, sigmoid) in float32; the probabilities scaled in float32, then cast to the logits'
dtype. tests/data/megatron_router_dtype/fixtures.pt holds what Megatron's functions gave on seeded bf16 tokens,
weights and logits (written by its make_fixtures.py, which says how to re-run it); on the same inputs omnitron's
routing map and probabilities must be Megatron's bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.config.parallel import ConfigError

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "..", "data", "megatron_router_dtype", "fixtures.pt"),
                      weights_only=True)
T, H, E = (FIXTURES["shape"][n] for n in ("T", "H", "E"))
CASES = FIXTURES["cases"]
SEEDS = sorted(FIXTURES["inputs"])


def _router(case: str, dtype: torch.dtype, **kw):
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.transformer.moe.router import TopKRouter

    c = gpt2_tiny(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=64, seq_length=T,
                  max_position_embeddings=T, vocab_size=64, num_experts=E, params_dtype=dtype, add_bias_linear=False,
                  **CASES[case], **kw)
    return c, TopKRouter(c, partial_grad=False).train()


def _dense(probs, experts):
    """``(probs [T, E], routing map [T, E])`` of the picked experts' ``probs [T, k]`` (Megatron's layout)."""
    experts = experts.long()
    return (torch.zeros(T, E, dtype=probs.dtype).scatter(1, experts, probs),
            torch.zeros(T, E, dtype=torch.bool).scatter(1, experts, True))


def _assert_routes_as(probs, experts, want: dict, where: str) -> None:
    got_probs, got_map = _dense(probs, experts)
    want_probs, want_map = _dense(want["probs"], want["experts"])
    assert probs.dtype == want["probs"].dtype, f"{where}: {probs.dtype}, Megatron's {want['probs'].dtype}"
    assert torch.equal(got_map, want_map), f"{where}: {int((got_map != want_map).sum())} routing-map entries differ"
    assert torch.equal(got_probs, want_probs), \
        f"{where}: probabilities differ by up to {float((got_probs.float() - want_probs.float()).abs().max())}"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("flag", [None, "fp32"])
def test_bf16_router_routes_as_megatron_bit_for_bit(case, flag):
    """A bf16 model's router on Megatron's bf16 tokens and weights: Megatron's ``Router.gating`` (``torch.mm`` in the
    router dtype: bf16 unset, float32 with ``--moe-router-dtype fp32``) and routing gave the same map and
    probabilities, bitwise, in the logits' dtype."""
    c, router = _router(case, torch.bfloat16, moe_router_dtype=flag)
    rd = torch.float32 if flag == "fp32" else torch.bfloat16
    for seed in SEEDS:
        inputs = FIXTURES["inputs"][seed]
        with torch.no_grad():
            router.weight.copy_(inputs["weight"])
            if router.expert_bias is not None:
                router.expert_bias.copy_(inputs["expert_bias"])
        probs, experts, _ = router(inputs["x"])
        assert probs.dtype == rd
        _assert_routes_as(probs, experts, FIXTURES["gating"][f"{case}/{flag or 'default'}/{seed}"],
                          f"{case}, --moe-router-dtype {flag}, seed {seed}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_and_aux_scores_of_bf16_logits_are_megatrons(case):
    """The same on given bf16 logits (no GEMM in between), and the load-balancing loss's scores and picks:
    Megatron's ``compute_routing_scores_for_aux_loss``, float32 from bf16 logits."""
    from omnitron.core.transformer.moe.router import aux_loss_picks, aux_loss_scores

    c, router = _router(case, torch.bfloat16)
    for seed in SEEDS:
        inputs, want = FIXTURES["inputs"][seed], FIXTURES["routing"][f"{case}/{seed}"]
        if router.expert_bias is not None:
            with torch.no_grad():
                router.expert_bias.copy_(inputs["expert_bias"])
        _assert_routes_as(*router.route(inputs["logits"]), want, f"{case}, seed {seed}")
        scores = aux_loss_scores(inputs["logits"], c.moe_router_score_function)
        want_scores = FIXTURES["aux"][f"{c.moe_router_score_function}/{seed}"]
        assert scores.dtype == torch.float32 and torch.equal(scores, want_scores), f"{case}, seed {seed}: aux scores"
        got_picks = _dense(scores, aux_loss_picks(scores, c.moe_router_topk))[1]
        assert torch.equal(got_picks, _dense(scores, want["aux_experts"])[1]), f"{case}, seed {seed}: aux picks"


def test_bf16_z_loss_takes_the_logsumexp_in_bf16():
    """Megatron's ``z_loss_func`` takes ``logsumexp`` of the bf16 logits (a bf16 result); omnitron squares and
    averages that in float32 (a bf16 token count is not exact past 256). Against float64 of the same bf16 logsumexp:
    float32 sum of T squares, relative error <= T x 2^-24 ~ 6e-6 (T = 96); rtol 1e-5. A logsumexp taken in float32
    instead differs by up to 2^-9 relative per token (bf16 rounding), ~1e-3 in the mean of these draws."""
    from omnitron.core.transformer.moe.router import z_loss

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    logits = (torch.randn(T, E, generator=g) * 3 + 4).bfloat16()
    lse = torch.logsumexp(logits, dim=-1)
    assert lse.dtype == torch.bfloat16
    want = 0.01 * lse.double().square().mean()
    got = z_loss(logits, 0.01)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_router_dtype_flag_parses_and_fp64_is_refused():
    from omnitron.core.training.arguments import parse_settings

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "2", "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--bf16", "--num-experts", "4"]
    assert parse_settings(base, 1).model.moe_router_dtype is None
    assert parse_settings(base + ["--moe-router-dtype", "fp32"], 1).model.moe_router_dtype == "fp32"
    with pytest.raises(ConfigError, match="--moe-router-dtype fp64"):
        parse_settings(base + ["--moe-router-dtype", "fp64"], 1)
