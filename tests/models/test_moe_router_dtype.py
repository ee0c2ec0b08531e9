"""The router's dtypes against Megatron's rule (megatron/core/transformer/moe/router.py ``Router.gating``, moe_utils.py
``router_gating_linear``, ``topk_routing_with_score_function``, ``compute_routing_scores_for_aux_loss``,
``z_loss_func`` at d98e8a6): the logits in ``--moe-router-dtype``'s dtype or, unset, the tokens' (bf16 in a bf16
model); the top-k on the logits; the scores (softmax, sigmoid) in float32; the probabilities scaled in float32, then
cast to the logits' dtype. :func:`_megatron_routing` transcribes its non-fused path line for line; on the same
logits the routing map and the probabilities must be Megatron's bit for bit."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config.parallel import ConfigError

H, E, T = 32, 16, 96


def _megatron_topk(scores, k, num_groups, group_topk):
    """moe_utils.py ``_compute_topk`` / ``group_limited_topk``."""
    if not group_topk:
        return torch.topk(scores, k=k, dim=1)
    group_scores = scores.view(T, num_groups, -1).topk(k // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, -1)
    masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked, k=k, dim=-1)


def _megatron_routing(logits, k, pre_softmax=False, groups=(None, None), scaling=None, score="softmax", bias=None):
    """moe_utils.py ``topk_routing_with_score_function`` (not fused): ``(routing_probs [T, E], routing_map)``."""
    if score == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top = _megatron_topk(scores, k, *groups)
        else:
            scores, top = _megatron_topk(logits, k, *groups)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
        if bias is not None:
            _, top = _megatron_topk(scores + bias.float(), k, *groups)
            scores = torch.gather(scores, dim=1, index=top)
        else:
            scores, top = _megatron_topk(scores, k, *groups)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else scores
    if scaling:
        probs = probs * scaling
    probs = probs.type_as(logits)
    return torch.zeros_like(logits).scatter(1, top, probs), torch.zeros_like(logits).int().scatter(1, top, 1).bool()


CASES = {
    "softmax": dict(moe_router_topk=2),
    "pre_softmax": dict(moe_router_topk=3, moe_router_pre_softmax=True),
    "groups_scaled": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                          moe_router_topk_scaling_factor=2.5),
    "sigmoid_bias": dict(moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True),
    "sigmoid_top1": dict(moe_router_topk=1, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=1.5),
}


def _router(case: str, dtype: torch.dtype, **kw):
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.transformer.moe.router import TopKRouter

    c = gpt2_tiny(num_layers=2, hidden_size=H, num_attention_heads=2, ffn_hidden_size=64, seq_length=T,
                  max_position_embeddings=T, vocab_size=64, num_experts=E, params_dtype=dtype, add_bias_linear=False,
                  **CASES[case], **kw)
    return c, TopKRouter(c, partial_grad=False).train()


def _megatron_kw(c, router) -> dict:
    return dict(pre_softmax=c.moe_router_pre_softmax, groups=(c.moe_router_num_groups, c.moe_router_group_topk),
                scaling=c.moe_router_topk_scaling_factor, score=c.moe_router_score_function, bias=router.expert_bias)


def _dense(probs, experts):
    return (torch.zeros(T, E, dtype=probs.dtype).scatter(1, experts, probs),
            torch.zeros(T, E, dtype=torch.bool).scatter(1, experts, True))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("flag", [None, "fp32"])
def test_bf16_router_routes_as_megatron_bit_for_bit(case, flag):
    """A bf16 model's router on fresh bf16 tokens and weights: Megatron's gating (``torch.mm`` in the router dtype:
    bf16 unset, float32 with ``--moe-router-dtype fp32``) and routing give the same map and probabilities, bitwise,
    in the logits' dtype."""
    c, router = _router(case, torch.bfloat16, moe_router_dtype=flag)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = torch.randn(T, H, generator=g).bfloat16()
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) * H ** -0.5)
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(E, generator=g) * 0.1)
    rd = torch.float32 if flag == "fp32" else torch.bfloat16
    logits = torch.mm(x.to(rd), router.weight.detach().to(rd).t())  # moe_utils.py RouterGatingLinearFunction
    want_probs, want_map = _megatron_routing(logits, c.moe_router_topk, **_megatron_kw(c, router))
    probs, experts, _ = router(x)
    assert probs.dtype == rd
    got_probs, got_map = _dense(probs, experts)
    assert torch.equal(got_map, want_map)
    assert torch.equal(got_probs, want_probs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_and_aux_scores_of_bf16_logits_are_megatrons(case):
    """The same on given bf16 logits (no GEMM in between), and the load-balancing loss's scores: Megatron's
    ``compute_routing_scores_for_aux_loss``, float32 from bf16 logits."""
    from omnitron.core.transformer.moe.router import aux_loss_scores

    c, router = _router(case, torch.bfloat16)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    logits = (torch.randn(T, E, generator=g) * 2).bfloat16()
    want_probs, want_map = _megatron_routing(logits, c.moe_router_topk, **_megatron_kw(c, router))
    got_probs, got_map = _dense(*router.route(logits))
    assert torch.equal(got_map, want_map) and torch.equal(got_probs, want_probs)
    scores = aux_loss_scores(logits, c.moe_router_score_function)
    if c.moe_router_score_function == "softmax":
        want = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        want = torch.sigmoid(logits.float())
        want = want / (want.sum(dim=-1, keepdim=True) + 1e-20)
    assert scores.dtype == torch.float32 and torch.equal(scores, want)


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
