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
                params_dtype=torch.float64, add_bias_linear=False)  # DeepSeek's layers, routers included, have no bias
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


def _ref_balance_loss(z: torch.Tensor, k: int, b: int, coeff: float, score_function: str, seq: bool) -> torch.Tensor:
    """The load-balancing loss of logits ``z [s*b, E]`` (token ``i * b + j``) as DeepSeek-V3 / Megatron define it,
    token by token: scores ``s'`` (softmax, or the sigmoid normalised over all E experts, for any k), counts of
    each token's top k of ``s'`` over ALL experts (no group limit, no expert bias), ``coeff * E / k * sum_e f_e P_e``
    per sequence (``seq``) or over the micro-batch, with ``f_e`` the count share and ``P_e`` the mean score."""
    T, E = z.shape
    rows = [[i * b + j for i in range(T // b)] for j in range(b)] if seq else [list(range(T))]
    total = 0.0
    for tokens in rows:
        for e in range(E):
            count, p = 0.0, 0.0
            for t in tokens:
                act = [torch.exp(z[t, x]) if score_function == "softmax" else torch.sigmoid(z[t, x]) for x in range(E)]
                s = [a / sum(act) for a in act]
                count += 1.0 if e in sorted(range(E), key=lambda x: -s[x].item())[:k] else 0.0
                p = p + s[e]
            total = total + E / k * (count / len(tokens)) * (p / len(tokens))
    return coeff * total / len(rows)


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
@pytest.mark.parametrize("case", [0, 1, 2, 3])
def test_balance_loss_counts_the_unbiased_unrestricted_top_k(case, balancing):
    """The load-balancing loss counts each token's top k of its scores over all experts, not the router's picks
    (which the group limit and the expert bias steer, each alone or together: cases 0, 2 and 1): value and input
    gradient against :func:`_ref_balance_loss`.
    Logits are set exactly (router weight [I | 0]) and spaced 0.37 apart, so float32 routing has no near-ties."""
    from omnitron.core.transformer.moe.router import TopKRouter

    c = _config(**CASES[case], moe_router_load_balancing_type=balancing, moe_aux_loss_coeff=0.07)
    router = TopKRouter(c, partial_grad=False).train()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    E, k, b = c.num_experts, c.moe_router_topk, 3
    with torch.no_grad():
        router.weight.copy_(torch.eye(E, c.hidden_size, dtype=torch.float64))
        if router.expert_bias is not None:
            router.expert_bias.copy_(torch.randn(E, generator=gen) * 0.5)
    z = torch.stack([torch.randperm(E, generator=gen) for _ in range(4 * b)]).double() * 0.37 - 1.3
    x = torch.cat([z, torch.zeros(4 * b, c.hidden_size - E, dtype=torch.float64)], 1).requires_grad_(True)
    _, experts, aux = router(x, b)
    unrestricted = torch.topk(z, k, dim=1)[1]  # the scores' order is the logits' for softmax and sigmoid alike
    assert not torch.equal(experts.sort(1)[0], unrestricted.sort(1)[0])  # the case steers some pick
    zr = z.clone().requires_grad_(True)
    ref = _ref_balance_loss(zr, k, b, 0.07, c.moe_router_score_function, balancing == "seq_aux_loss")
    # float64 (the router takes the model's dtype): the loss sums <= 4 b x E = 72 one-signed terms, <= 72 u = 8e-15
    # relative (u = 1.1e-16); a logit's gradient sums <= 72 terms of either sign and magnitude <= coeff = 0.07, so
    # <= 72 u x 72 x 0.07 = 4e-14 absolute: 1e-12 relative and 1e-13 absolute leave a factor >= 2 (a float32
    # router: ~1e-8 relative)
    torch.testing.assert_close(aux, ref.detach(), rtol=1e-12, atol=0)
    aux.backward()
    ref.backward()
    torch.testing.assert_close(x.grad[:, :E], zr.grad, rtol=1e-12, atol=1e-13)


def _bias_update_case(seed: int) -> dict:
    """tp2 x dp2: two routers per rank with this rank's step counts (tp rank 0 heavy on experts 0-3, tp rank 1 on
    4-7, so the dp-only sums disagree in sign with the whole sums), updated with and without sequence parallelism."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.transformer.moe.router import TopKRouter, update_expert_bias

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), backend=be)
    c = _config(**CASES[2])
    out = {}
    for sp in (True, False):
        routers = [TopKRouter(c, partial_grad=sp).train().to(be.device()) for _ in range(2)]
        for i, r in enumerate(routers):
            r.tokens_per_expert.copy_(_step_counts(seed, i, groups.tp.rank, groups.dp.rank, sp))
        update_expert_bias(routers, groups, sequence_parallel=sp)
        out[sp] = [r.expert_bias.tolist() for r in routers]
        assert not any(r.tokens_per_expert.any() for r in routers)
    return out


def _step_counts(seed: int, router: int, tp_rank: int, dp_rank: int, sp: bool) -> torch.Tensor:
    """Integer token counts ``[8]`` of one router on one rank: without sequence parallelism the tp ranks route the
    same tokens (the same counts), with it each tp rank counts its own shard's."""
    gen = torch.Generator().manual_seed(seed * 16 + router * 4 + (tp_rank if sp else 0) * 2 + dp_rank)
    heavy = torch.zeros(8)
    heavy[4 * (tp_rank if sp else router % 2):][:4] = 12.0
    return heavy + torch.randint(0, 4, (8,), generator=gen).float()


def test_expert_bias_update_sums_the_counts_of_the_ranks_whose_tokens_differ():
    """``update_expert_bias`` moves each router's bias by ``rate * sign(mean - count)`` of its counts summed over
    dp x cp and, under sequence parallelism, tp (whose ranks then route different shards); without it the tp
    ranks hold the same counts. Against the rule applied to the counts summed here (rank order tp-cp-ep-dp-pp:
    tp rank = rank % 2, dp rank = rank // 2). Exact: integer counts, a float32 bias of +-rate from zero."""
    from omnitron.testing.distributed import run_distributed

    seed = int.from_bytes(__import__("os").urandom(3), "little")
    rate = CASES[2]["moe_router_bias_update_rate"]
    got = run_distributed(_bias_update_case, 4, seed)
    for rank, res in enumerate(got):
        for sp in (True, False):
            for i in range(2):
                ranks = [(t, d) for t in range(2) for d in range(2)] if sp else [(rank % 2, d) for d in range(2)]
                n = sum(_step_counts(seed, i, t, d, sp) for t, d in ranks)
                want = torch.sign(n.mean() - n).mul(rate).float()
                assert res[sp][i] == want.tolist(), (seed, rank, sp, i, res[sp][i], want.tolist())
    # the test discriminates: at sequence parallelism the dp-only sums (tp not reduced) give other signs
    n_dp = sum(_step_counts(seed, 0, 0, d, True) for d in range(2))
    n_all = sum(_step_counts(seed, 0, t, d, True) for t in range(2) for d in range(2))
    assert not torch.equal(torch.sign(n_dp.mean() - n_dp), torch.sign(n_all.mean() - n_all))
