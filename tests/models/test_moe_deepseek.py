"""DeepSeek routing in the MoE router: group-limited top-k, the top-k scaling factor and the expert bias of
auxiliary-loss-free balancing, against a plain token-by-token float64 re-implementation, step by step."""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.groups import ParallelGroups


def _config(**kw):
    from omnitron.core.models.gpt import gpt2_tiny

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, seq_length=8,
                max_position_embeddings=8, vocab_size=64, num_experts=8, moe_router_topk=4, moe_ffn_hidden_size=20,
                params_dtype=torch.float64)
    base.update(kw)
    return gpt2_tiny(**base)


def _ref_route(row: list[float], c, bias: list[float] | None) -> tuple[list[int], list[float], float]:
    """One token: (picked experts in selection order, their combine weights, the decision's margin: the
    smallest gap at a group or top-k boundary), written from the DeepSeek-V3 paper / Megatron's
    topk_routing_with_score_function."""
    E, k = len(row), c.moe_router_topk
    if c.moe_router_score_function == "sigmoid":
        score = [1.0 / (1.0 + math.exp(-v)) for v in row]
    elif c.moe_router_pre_softmax:
        z = sum(math.exp(v) for v in row)
        score = [math.exp(v) / z for v in row]
    else:
        score = list(row)  # softmax after the pick: select on the logits
    select = [score[e] + (bias[e] if bias else 0.0) for e in range(E)]
    allowed, margin = range(E), math.inf
    if c.moe_router_group_topk:
        g, size = c.moe_router_num_groups, E // c.moe_router_num_groups
        per = k // c.moe_router_group_topk
        gscore = [sum(sorted(select[i * size:(i + 1) * size], reverse=True)[:per]) for i in range(g)]
        order = sorted(range(g), key=lambda i: -gscore[i])
        best = order[:c.moe_router_group_topk]
        margin = gscore[order[len(best) - 1]] - gscore[order[len(best)]]
        allowed = [e for e in range(E) if e // size in best]
    ranked = sorted(allowed, key=lambda e: -select[e])
    picked = ranked[:k]
    if len(ranked) > k:
        margin = min(margin, select[ranked[k - 1]] - select[ranked[k]])
    if c.moe_router_score_function == "sigmoid":
        tot = sum(score[e] for e in picked)
        w = [score[e] / tot if k > 1 else score[e] for e in picked]
    elif c.moe_router_pre_softmax:
        w = [score[e] for e in picked]
    else:
        z = sum(math.exp(row[e]) for e in picked)
        w = [math.exp(row[e]) / z for e in picked]
    f = c.moe_router_topk_scaling_factor or 1.0
    return picked, [x * f for x in w], margin


# The router computes in float32 (as Megatron's): logits over h = 16 products, a sigmoid / softmax and a
# normalisation over k <= 4 terms carry a relative error of about (h + k) u32 ~ 1e-6; a wrong pick, group, bias
# or scale moves a weight by O(1). A pick can flip on a near-tie within that error: tokens whose decision
# margin is under TIE (a hundred times that error) are not compared, and the counts follow the router's picks.
RTOL = 4e-6
TIE = 1e-4

CASES = [
    dict(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
         moe_router_topk_scaling_factor=2.5),
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
         moe_router_group_topk=2, moe_router_bias_update_rate=0.05),
    dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1),
    dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_topk_scaling_factor=0.5),
    dict(moe_router_pre_softmax=True, moe_router_num_groups=4, moe_router_group_topk=3, moe_router_topk=3),
    # Megatron's DeepSeek-V3 scripts pass --moe-router-pre-softmax with sigmoid scores: it changes nothing there
    dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=True, moe_router_enable_expert_bias=True,
         moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_routing_and_bias_updates_match_plain_reference(case):
    """Four steps of two micro-batches each: every token's experts and weights, and after every step the
    expert bias, equal the plain re-implementation (whose bias follows DeepSeek's sign rule itself)."""
    from omnitron.core.transformer.moe.router import TopKRouter, update_expert_bias

    c = _config(**CASES[case])
    router = TopKRouter(c, partial_grad=False).train()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen, dtype=torch.float64))
    bias = [0.0] * c.num_experts if c.moe_router_enable_expert_bias else None
    moved = False  # the bias left zero at some step (it can oscillate back to all zeros: +r, -r, +r, -r)
    for _ in range(4):
        counts = [0] * c.num_experts
        for _ in range(2):
            x = torch.randn(13, c.hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
            probs, experts, _ = router(x)
            logits = (x.detach() @ router.weight.detach().T).tolist()
            for t, row in enumerate(logits):
                picked, w, margin = _ref_route(row, c, bias)
                if margin > TIE:
                    assert experts[t].tolist() == picked, (t, experts[t], picked)
                    torch.testing.assert_close(probs[t].detach(), torch.tensor(w, dtype=probs.dtype), rtol=RTOL,
                                               atol=0)
                for e in experts[t].tolist():
                    counts[e] += 1
        update_expert_bias([router], ParallelGroups.single(), sequence_parallel=False)
        if bias is not None:
            mean = sum(counts) / len(counts)
            bias = [b + c.moe_router_bias_update_rate * ((mean > n) - (mean < n)) for b, n in zip(bias, counts)]
            assert router.expert_bias.tolist() == pytest.approx(bias, abs=1e-7)  # float32 buffer
            assert not router.tokens_per_expert.any()  # the counts restart each step
            moved = moved or any(b != 0.0 for b in bias)
    if bias is not None:
        assert moved and "expert_bias" in router.state_dict()


def test_bias_leaves_evaluation_counts_alone():
    """Forwards without grad (evaluation, generation) route with the bias but do not count."""
    from omnitron.core.transformer.moe.router import TopKRouter

    c = _config(**CASES[2])
    router = TopKRouter(c, partial_grad=False)
    with torch.no_grad():
        router.weight.normal_()
        router(torch.randn(5, c.hidden_size, dtype=torch.float64))
    assert not router.tokens_per_expert.any()


@pytest.mark.parametrize("kw, word", [
    (dict(moe_router_enable_expert_bias=True), "sigmoid"),
    (dict(moe_router_group_topk=2), "--moe-router-num-groups"),
    (dict(moe_router_group_topk=2, moe_router_num_groups=3), "divisible"),
    (dict(moe_router_group_topk=5, moe_router_num_groups=4), "between 1"),
    (dict(moe_router_group_topk=4, moe_router_num_groups=8, moe_router_topk=2), "--moe-router-topk"),
])
def test_deepseek_routing_refusals(kw, word):
    with pytest.raises(ConfigError, match=word):
        _config(**kw)
