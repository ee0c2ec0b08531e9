"""MoE units in one process: the router and its load-balancing loss against a float64 plain-torch
reference written token by token, the dropless MoE layer against a dense per-token evaluation of
the same experts (forward, backward and the injected aux-loss gradient), and bad settings."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.transformer.moe import load_balancing_loss, top_k_routing


def _ref_routing(logits: torch.Tensor, k: int, pre_softmax: bool, coeff: float):
    """Token-by-token float64 reference: (probs [T, k], experts [T, k], aux loss)."""
    T, E = logits.shape
    probs, experts, counts = [], [], [0.0] * E
    for t in range(T):
        row = logits[t]
        picked = sorted(range(E), key=lambda e: -row[e].item())[:k]
        denom = torch.exp(row).sum() if pre_softmax else sum(torch.exp(row[e]) for e in picked)
        probs.append(torch.stack([torch.exp(row[e]) / denom for e in picked]))
        experts.append(picked)
        for e in picked:
            counts[e] += 1.0
    soft = torch.exp(logits) / torch.exp(logits).sum(dim=1, keepdim=True)
    aux = sum(coeff * E * (counts[e] / (T * k)) * soft[:, e].mean() for e in range(E))
    return torch.stack(probs), torch.tensor(experts), aux


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_router_matches_reference(pre_softmax):
    g = torch.Generator().manual_seed(11 + pre_softmax)
    for T, E, k in ((13, 4, 2), (9, 6, 1), (7, 5, 5)):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        ref_in = logits.clone().requires_grad_(True)
        ours_in = logits.clone().requires_grad_(True)
        rp, re, raux = _ref_routing(ref_in, k, pre_softmax, 0.05)
        probs, experts = top_k_routing(ours_in, k, pre_softmax)
        aux = load_balancing_loss(torch.softmax(ours_in, -1), experts, E, 0.05)
        assert torch.equal(experts, re)
        torch.testing.assert_close(probs, rp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(aux, raux, rtol=1e-12, atol=1e-12)
        w = torch.randn(T, k, generator=g, dtype=torch.float64)
        ((rp * w).sum() + 3.0 * raux).backward()
        ((probs * w).sum() + 3.0 * aux).backward()
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-12)


def _moe_config(**kw):
    from omnitron.core.models.gpt import gpt2_tiny

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, seq_length=8,
                max_position_embeddings=8, vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=20, moe_aux_loss_coeff=0.1,
                params_dtype=torch.float64)
    base.update(kw)
    return gpt2_tiny(**base)


# float64 layer against the dense float64 reference (u = 1.1e-16): they differ only in the order of sums (the
# dispatch sorts tokens by expert, the reference runs every expert densely). Each compared value is a sum of at most
# 24 tokens x 20 channels = 480 products: <= 480 u = 5.3e-14 of the sum of its terms' magnitudes, which these
# inputs (x ~ N(1, 1), weights ~0.3, every compared value <= 21) keep below ~200: <= 1.1e-11. TOL64 leaves a factor
# ~10; a float32 router (what the 1e-6 this replaced allowed for) moves probabilities by ~1e-8, a mis-weighted or
# mis-dispatched token by O(1).
TOL64 = 1e-10
# A float64 router against a float64 reference (the router takes the model's dtype): probabilities are a softmax
# over E = 6 logits, the losses and their gradients sums of <= T x E = 144 terms of one sign each (probabilities,
# counts): <= 144 u = 1.6e-14 relative each; ROUTER64 leaves a factor ~60 (a float32 router: ~1e-8).
ROUTER64 = 1e-12


def dense_moe_reference(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every token through every expert (plain torch), weighted by its router probabilities:
    ``(y [s, b, h], aux loss)``. Independent of the sort / all-to-all dispatch."""
    c = layer.router
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ c.weight.t() + (0.0 if c.bias is None else c.bias)  # the bias: --add-bias-linear
    probs, experts = top_k_routing(logits, c.k, c.pre_softmax)
    y = torch.zeros_like(tokens)
    for key, mlp in layer.experts.items():
        w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
        w2, b2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
        hdn = tokens @ w1.t() + (b1 if b1 is not None else 0)
        if mlp.swiglu:
            a, b = hdn.chunk(2, dim=-1)
            hdn = torch.nn.functional.silu(a) * b
        else:
            hdn = torch.nn.functional.gelu(hdn, approximate="tanh")
        out = hdn @ w2.t() + (b2 if b2 is not None else 0)
        weight = (probs * (experts == int(key))).sum(dim=1, keepdim=True)  # [T, 1], 0 if not picked
        y = y + weight * out
    aux = load_balancing_loss(torch.softmax(logits, -1), experts, c.num_experts, c.balancing["aux_loss"])
    return y.view_as(x), aux


@pytest.mark.parametrize("swiglu", [False, True])
def test_moe_layer_matches_dense_evaluation(swiglu):
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import init_full
    from omnitron.core.transformer.moe import MoELayer

    c = _moe_config(swiglu=swiglu, add_bias_linear=not swiglu, moe_router_pre_softmax=swiglu)
    layer = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            init = ("normal", 0.3) if p.init[0] == "normal" else ("normal", 0.1)  # non-zero biases too
            p.copy_(init_full(name, tuple(p.shape), init, seed=5))
        layer.router.weight[1] = -20.0 * torch.ones(c.hidden_size, dtype=torch.float64)  # expert 1: no tokens
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64) + 1.0).requires_grad_(True)
    w = torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64)
    layer.aux_loss_scale = 2.5
    y, bias = layer(x)
    assert bias is None
    (y * w).sum().backward()
    ours = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    ours_x = x.grad.clone()
    counts = torch.bincount(layer.router(x.detach().reshape(-1, c.hidden_size).float())[1].reshape(-1), minlength=6)
    assert counts.max() != counts.min() and counts.min() == 0, counts  # uneven groups, one empty
    layer.zero_grad()
    x.grad = None
    ry, raux = dense_moe_reference(layer, x)
    ((ry * w).sum() + 2.5 * raux).backward()
    # float64 throughout (a float64 model routes in float64 since the router takes the model's dtype)
    torch.testing.assert_close(y, ry, rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(ours_x, x.grad, rtol=TOL64, atol=TOL64)
    for n, p in layer.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(ours[n], ref, rtol=TOL64, atol=TOL64, msg=lambda m: f"{n}: {m}")
    assert layer.aux_loss_total.dtype == torch.float64
    torch.testing.assert_close(layer.aux_loss_total, raux.detach(), rtol=TOL64, atol=0.0)


def _filled_layer(c, grouped: bool, seed: int):
    """An MoE layer of ``c`` (grouped GEMM or not) with every parameter drawn N(0, 0.3) from ``seed``."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe import MoELayer

    layer = MoELayer(dataclasses.replace(c, moe_grouped_gemm=grouped), groups=ParallelGroups.single(),
                     sequence_parallel=False, backend=get_backend(), out_std=0.02)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    return layer


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_gemm_computes_the_per_expert_gemms(swiglu, monkeypatch):
    """--moe-grouped-gemm (torch._grouped_mm, fp32) against the per-expert path above (checked against the float64
    dense reference): forward and every gradient, with an expert that gets no tokens. Both are fp32 sums of the
    same products in another order: ~1e-7 relative, the 1e-5 bound is a hundredfold margin."""
    from omnitron.core.transformer.moe import experts as E

    ran, real = [], E.grouped_expert_mlps
    monkeypatch.setattr(E, "grouped_expert_mlps", lambda *a: ran.append(1) or real(*a))
    c = _moe_config(swiglu=swiglu, add_bias_linear=not swiglu, params_dtype=torch.float32)
    outs = []
    for grouped in (False, True):
        layer = _filled_layer(c, grouped, 7)
        with torch.no_grad():
            layer.router.weight[1] = -20.0  # expert 1: no tokens
        g = torch.Generator().manual_seed(3)
        x = torch.randn(8, 3, c.hidden_size, generator=g).requires_grad_(True)
        y, _ = layer(x)
        y.sum().backward()  # a stride-0 gradient, which torch._grouped_mm's backward alone refuses
        outs.append((y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}))
    assert ran, "the grouped path did not run"
    (y0, gx0, g0), (y1, gx1, g1) = outs
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_grouped_gemm_keeps_no_copy_of_the_expert_weights(recompute):
    """The grouped path stacks the experts' weights for ``torch._grouped_mm``; the stack is not what backward
    keeps (it is stacked again there): after the forward, the grouped layer holds the bytes the per-expert layer
    holds plus the int32 group offsets (4 bytes an expert), where keeping the stacks held a copy of every local
    expert's fc1 and fc2 weights more (23,040 bytes here). Under recomputation (omnitron's checkpoint, torch's
    non-reentrant one) the same, and the gradients are the per-expert path's."""
    from omnitron.core.parallel.tensor.random import checkpoint
    from omnitron.kernels.alloc_log import Timeline

    c = _moe_config(swiglu=True, add_bias_linear=False, params_dtype=torch.float32)
    held, grads = [], []
    for grouped in (False, True):
        layer = _filled_layer(c, grouped, 5)
        x = torch.randn(8, 3, c.hidden_size, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        tl = Timeline()
        with tl:
            y = checkpoint(lambda t: layer(t)[0], None, x) if recompute else layer(x)[0]
        live = {i for i, (op, n) in enumerate(tl.events) if op is not None}
        live -= {n for op, n in tl.events if op is None}
        held.append(sum(tl.events[i][1] for i in live))
        y.square().sum().backward()
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    assert held[1] - held[0] == (4 * c.num_experts if not recompute else 0), held
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # the bound of the test above


def test_bad_moe_settings_are_named():
    from omnitron.core.models.gpt.config import validate_model

    with pytest.raises(ConfigError, match="--moe-router-topk 5 must be between 1 and --num-experts 4"):
        _moe_config(num_experts=4, moe_router_topk=5)
    with pytest.raises(ConfigError, match="--num-experts must be a positive integer"):
        _moe_config(num_experts=0)
    with pytest.raises(ConfigError, match="--moe-router-load-balancing-type sinkhorn: Sinkhorn routing"):
        _moe_config(moe_router_load_balancing_type="sinkhorn")
    c = _moe_config()
    with pytest.raises(ConfigError, match="--num-experts 6 is not divisible by --expert-model-parallel-size 4"):
        validate_model(c, ParallelConfig(expert_model_parallel_size=4))
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 4 is neither 1 nor"):
        validate_model(c, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                         expert_tensor_parallel_size=4))
    validate_model(c, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2))  # etp = tp
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 2 needs an MoE model"):
        validate_model(dataclasses.replace(c, num_experts=None), ParallelConfig(expert_model_parallel_size=2))
    validate_model(c, ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                     expert_tensor_parallel_size=1))
    odd = _moe_config(seq_length=7)  # without sequence parallelism the MoE layer pads its tp slices
    validate_model(odd, ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match="--seq-length 7 is not divisible by --tensor-model-parallel-size 2, "
                                          "which --sequence-parallel requires"):
        validate_model(odd, ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True))


def test_cli_flags_reach_the_model():
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(["--model", "gpt2_tiny", "--num-experts", "4", "--moe-router-topk", "1",
                        "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff", "0.02", "--mock-data",
                        "--moe-router-pre-softmax", "--moe-ffn-hidden-size", "96"], world_size=2)
    m = s.model
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.moe_router_pre_softmax,
            m.moe_ffn_hidden_size) == (4, 1, 0.02, True, 96)
    assert s.parallel.expert_model_parallel_size == 2
    with pytest.raises(ConfigError, match="--num-experts 3 is not divisible"):
        parse_settings(["--model", "gpt2_tiny", "--num-experts", "3", "--expert-model-parallel-size", "2",
                        "--mock-data"], world_size=2)
    # top-1 softmax after the pick weighs every token 1: no router gradient, refused for training as Megatron does
    with pytest.raises(ConfigError, match="--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax"):
        parse_settings(["--model", "gpt2_tiny", "--num-experts", "4", "--moe-router-topk", "1", "--mock-data"],
                       world_size=1)
    for extra in (["--moe-router-pre-softmax"], ["--moe-router-score-function", "sigmoid"]):
        parse_settings(["--model", "gpt2_tiny", "--num-experts", "4", "--moe-router-topk", "1", "--mock-data",
                        *extra], world_size=1)


# ---- capacity, shared experts, layer pattern, router extras -----------------------------------
def _ref_capacity(gates: torch.Tensor, picked: torch.Tensor, topk: int, factor: float, policy: str, pad: bool):
    """Expert by expert: its assignments ranked by (-probability, token) or by token, the first
    ceil(factor * T * k / E) kept; padding appends unrouted tokens in token order (weight 0)."""
    import math

    T, E = picked.shape
    cap = min(T, math.ceil(factor * T * topk / E))
    mask = torch.zeros(T, E, dtype=torch.bool)
    for e in range(E):
        mine = [t for t in range(T) if picked[t, e]]
        if policy == "probs":
            mine.sort(key=lambda t: (-gates[t, e].item(), t))
        kept = mine[:cap]
        if pad:
            kept += [t for t in range(T) if not picked[t, e]][:cap - len(kept)]
        for t in kept:
            mask[t, e] = True
    return mask


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_matches_per_expert_reference(policy):
    from omnitron.core.transformer.moe.capacity import routing_mask

    g = torch.Generator().manual_seed(40 + len(policy))
    for T, E, k, factor in ((24, 4, 2, 1.0), (17, 6, 1, 0.5), (9, 3, 3, 0.7), (20, 5, 2, 3.0)):
        probs, experts = top_k_routing(torch.randn(T, E, generator=g, dtype=torch.float64), k, False)
        gates = torch.zeros(T, E, dtype=torch.float64).scatter(1, experts, probs)
        picked = torch.zeros(T, E, dtype=torch.bool).scatter(1, experts, True)
        for pad in (False, True):
            ours = routing_mask(gates, picked, k, factor, policy, pad)
            assert torch.equal(ours, _ref_capacity(gates, picked, k, factor, policy, pad)), (T, E, k, factor, pad)
        if factor <= 1.0:  # over-full experts exist: something is dropped
            assert routing_mask(gates, picked, k, factor, policy).sum() < picked.sum()
    assert torch.equal(routing_mask(gates, picked, k, None), picked)  # dropless


def _shared_mlp(mlp, tokens: torch.Tensor) -> torch.Tensor:
    """A dense GeLU MLP in plain torch."""
    hdn = tokens @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    return torch.nn.functional.gelu(hdn, approximate="tanh") @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias


@pytest.mark.parametrize("policy,pad", [("probs", False), ("position", True)])
def test_moe_layer_capacity_and_shared_expert_match_reference(policy, pad):
    """Dropped assignments contribute nothing (kept ones as in the dense evaluation); the shared
    expert is added for every token; padding changes no number."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import init_full
    from omnitron.core.transformer.moe import MoELayer

    c = _moe_config(moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy,
                    moe_pad_expert_input_to_capacity=pad, moe_shared_expert_intermediate_size=12)
    layer = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), ("normal", 0.3), seed=9))
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64) + 0.5).requires_grad_(True)
    w = torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64)
    y, _ = layer(x)
    (y * w).sum().backward()
    ours = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    ours_x = x.grad.clone()
    layer.zero_grad()
    x.grad = None
    tokens = x.reshape(-1, c.hidden_size)
    logits = tokens @ layer.router.weight.t() + (0.0 if layer.router.bias is None else layer.router.bias)
    probs, experts = top_k_routing(logits, c.moe_router_topk, False)
    gates = torch.zeros_like(logits).scatter(1, experts, probs)
    picked = torch.zeros(logits.shape, dtype=torch.bool).scatter(1, experts, True)
    kept = _ref_capacity(gates.detach(), picked, c.moe_router_topk, 0.75, policy, False)
    assert kept.sum() < picked.sum()  # the capacity drops something here
    ry = _shared_mlp(layer.shared_experts, tokens)
    for key, mlp in layer.experts.items():
        e = int(key)
        ry = ry + (gates[:, e] * kept[:, e]).unsqueeze(-1) * _shared_mlp(mlp, tokens)
    aux = load_balancing_loss(torch.softmax(logits, -1), experts, c.num_experts, layer.router.balancing["aux_loss"])
    ((ry.view_as(x) * w).sum() + aux).backward()
    # float64 throughout: TOL64's analysis (the shared expert's 12 channels add <= 24 x 12 products a value)
    torch.testing.assert_close(y, ry.view_as(x), rtol=TOL64, atol=TOL64)
    torch.testing.assert_close(ours_x, x.grad, rtol=TOL64, atol=TOL64)
    for n, p in layer.named_parameters():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(ours[n], ref, rtol=TOL64, atol=TOL64, msg=lambda m: f"{n}: {m}")


def test_sigmoid_scores_and_z_loss_match_reference():
    from omnitron.core.transformer.moe.router import aux_loss_scores, sigmoid_routing, z_loss

    g = torch.Generator().manual_seed(8)
    for T, E, k in ((11, 5, 2), (6, 4, 1)):
        logits = torch.randn(T, E, generator=g, dtype=torch.float64)
        a, b = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        ref_probs, ref_z = [], 0.0
        for t in range(T):
            s = [1.0 / (1.0 + torch.exp(-a[t, e])) for e in range(E)]
            top = sorted(range(E), key=lambda e: -s[e].item())[:k]
            tot = sum(s[e] for e in top)
            ref_probs.append(torch.stack([s[e] / tot if k > 1 else s[e] for e in top]))
            ref_z = ref_z + torch.log(sum(torch.exp(a[t, e]) for e in range(E))) ** 2 / T
        probs, _ = sigmoid_routing(b, k)
        z = z_loss(b, 0.01)
        torch.testing.assert_close(probs, torch.stack(ref_probs), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(z, 0.01 * ref_z, rtol=1e-12, atol=1e-12)
        scores = aux_loss_scores(b.detach(), "sigmoid")  # normalised over the experts for any k, as Megatron
        torch.testing.assert_close(scores, torch.sigmoid(a.detach()) / torch.sigmoid(a.detach()).sum(-1, True))
        wt = torch.randn(T, k, generator=g, dtype=torch.float64)
        ((torch.stack(ref_probs) * wt).sum() + 0.01 * ref_z).backward()
        ((probs * wt).sum() + z).backward()
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12)


def test_layer_pattern_parameter_count_and_errors():
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.config import num_parameters
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe import MoELayer
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    assert moe_layer_pattern("([0]+[1]*3)*2", 8) == [False, True, True, True] * 2
    assert moe_layer_pattern(2, 5) == [True, False, True, False, True]
    assert moe_layer_pattern("[1, 0,1]", 3) == [True, False, True]
    assert moe_layer_pattern([0, 1], 2) == [False, True]
    c = _moe_config(num_layers=4, moe_layer_freq="[0,1]*2", moe_shared_expert_intermediate_size=8)
    model = GPTModel(c, ParallelGroups.single(), seed=1)
    kinds = [isinstance(model.decoder.layers[str(i)].mlp, MoELayer) for i in range(4)]
    assert kinds == [False, True, False, True]
    assert num_parameters(c) == sum(p.numel() for p in model.parameters())
    for bad, match in (("[1,0]", "needs exactly --num-layers 4"), ("[1,2,0,0]", "each 0 \\(dense MLP\\) or 1"),
                       ("([1]+", "not an integer or a 0/1 list"), ("__import__('os')", "not an integer"),
                       (0, "must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            _moe_config(num_layers=4, moe_layer_freq=bad)
    for kw, match in ((dict(moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
                      (dict(moe_token_drop_policy="random"), "--moe-token-drop-policy 'random'"),
                      (dict(moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
                      (dict(moe_router_score_function="tanh"), "--moe-router-score-function 'tanh'"),
                      (dict(moe_shared_expert_intermediate_size=0), "--moe-shared-expert-intermediate-size must")):
        with pytest.raises(ConfigError, match=match):
            _moe_config(**kw)
    from omnitron.core.models.gpt.config import validate_model

    with pytest.raises(ConfigError, match="--moe-shared-expert-intermediate-size 9 is not divisible"):
        validate_model(_moe_config(moe_shared_expert_intermediate_size=9), ParallelConfig(tensor_model_parallel_size=2))


def test_extra_cli_flags_reach_the_model():
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(["--model", "gpt2_tiny", "--num-experts", "4", "--mock-data", "--moe-layer-freq",
                        "([0]+[1])*2", "--moe-shared-expert-intermediate-size", "64", "--moe-expert-capacity-factor",
                        "1.5", "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
                        "--moe-router-score-function", "sigmoid", "--moe-z-loss-coeff", "0.001"], world_size=1)
    m = s.model
    assert (m.moe_layer_freq, m.moe_shared_expert_intermediate_size, m.moe_expert_capacity_factor,
            m.moe_token_drop_policy, m.moe_pad_expert_input_to_capacity, m.moe_router_score_function,
            m.moe_z_loss_coeff) == ("([0]+[1])*2", 64, 1.5, "position", True, "sigmoid", 0.001)


def test_negative_capacity_factor_is_dropless_as_megatron():
    """Megatron's TransformerConfig turns a negative --moe-expert-capacity-factor into None (dropless): every pick
    is processed, where a capacity would drop some; with the padding flag it asks for a capacity, in one line."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.transformer.moe import MoELayer
    from omnitron.core.transformer.moe.capacity import routing_mask

    s = parse_settings(["--model", "gpt2_tiny", "--num-experts", "4", "--mock-data", "--moe-expert-capacity-factor",
                        "-1"], world_size=1)
    assert s.model.moe_expert_capacity_factor is None
    c = _moe_config(moe_expert_capacity_factor=-1.0)
    layer = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    g = torch.Generator().manual_seed(23)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=g, dtype=torch.float64))
    tokens = torch.randn(24, c.hidden_size, generator=g, dtype=torch.float64)
    gates, mask = layer._route(tokens, 3)
    picked = gates > 0
    assert torch.equal(mask, picked) and picked.sum() == 24 * 2  # every token's two picks
    assert routing_mask(gates, picked, 2, 1.0).sum() < picked.sum()  # a capacity would drop some here
    with pytest.raises(ConfigError, match="--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"):
        _moe_config(moe_expert_capacity_factor=-1.0, moe_pad_expert_input_to_capacity=True)


def test_resharding_an_expert_tensor_parallel_checkpoint_is_refused(tmp_path):
    """etp > 1 (the default at tp > 1) splits experts over tp; reading such a checkpoint under another
    layout is refused with the fix, while etp 1 metadata passes the check (and fails later, on the
    missing shards)."""
    import json

    from omnitron.core.checkpoint.io import FORMAT_VERSION, CheckpointError
    from omnitron.core.checkpoint.reshard import read_full_state

    def meta(etp):
        return {"format_version": FORMAT_VERSION, "iteration": 1, "world_size": 2, "shards": [],
                "model": {"num_experts": 4, "num_layers": 2},
                "layout": {"tensor_model_parallel_size": 2}, "config": {"expert_tensor_parallel_size": etp}}

    (tmp_path / "metadata.json").write_text(json.dumps(meta(None)))
    with pytest.raises(CheckpointError, match="expert tensor parallelism 2 .*--expert-tensor-parallel-size 1"):
        read_full_state(str(tmp_path))
    (tmp_path / "metadata.json").write_text(json.dumps(meta(1)))
    with pytest.raises(Exception) as info:
        read_full_state(str(tmp_path))
    assert "expert tensor parallelism" not in str(info.value)


def test_router_bias_follows_add_bias_linear():
    """Megatron-Core's router holds a bias [E] on its logits exactly with --add-bias-linear: so does this one (unless
    ``moe_router_bias`` says otherwise), the parameter count says it, and routing reads ``x W^T + b``: against the
    float64 token-by-token reference, with a bias spaced wider than the logits' range so that it decides every pick
    (no near-ties: gaps >= 0.37 against float32 rounding ~1e-6)."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.config import num_parameters
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe.router import TopKRouter

    for kw, has in ((dict(), True), (dict(add_bias_linear=False), False), (dict(moe_router_bias=False), False),
                    (dict(add_bias_linear=False, moe_router_bias=True), True)):
        c = _moe_config(**kw)
        model = GPTModel(c, ParallelGroups.single())
        assert sum(n.endswith("mlp.router.bias") for n, _ in model.named_parameters()) == (c.num_layers if has else 0)
        assert num_parameters(c) == sum(p.numel() for p in model.parameters()), kw
    c = _moe_config()
    router = TopKRouter(c, partial_grad=False).eval()
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    E, h = c.num_experts, c.hidden_size
    z = torch.stack([torch.randperm(E, generator=g) for _ in range(9)]).double() * 0.37
    bias = torch.randperm(E, generator=g).double() * 0.37 * E
    with torch.no_grad():
        router.weight.copy_(torch.eye(E, h, dtype=torch.float64))
        router.bias.copy_(bias)
    probs, experts, _ = router(torch.cat([z, torch.zeros(9, h - E, dtype=torch.float64)], 1))
    ref_probs, ref_experts, _ = _ref_routing(z + bias, c.moe_router_topk, False, 0.0)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(probs, ref_probs, rtol=ROUTER64, atol=0)  # float64 routing (ROUTER64)


def _recomputed_layer(seed: int, **kw):
    """A float64 MoE layer with random weights, run forward and backward through full recomputation
    (omnitron's ``checkpoint``): ``(layer, its input)``."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.random import checkpoint
    from omnitron.core.transformer.moe import MoELayer

    c = _moe_config(swiglu=True, add_bias_linear=False, **kw)
    layer = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    x = torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64).requires_grad_(True)
    checkpoint(lambda t: layer(t)[0], None, x).sum().backward()  # the backward recomputes the layer's forward
    return layer, x.detach().reshape(-1, c.hidden_size)


def test_recomputed_layer_logs_its_losses_once():
    """Full recomputation reruns the MoE layer's forward in backward: the logged router losses (load balancing and
    z-loss) are the forward's, once, against the float64 token-by-token reference (before: twice the logged value
    under --recompute-granularity full)."""
    layer, tokens = _recomputed_layer(21, moe_z_loss_coeff=0.05)
    logits = tokens @ layer.router.weight.detach().t()
    _, experts, ref_aux = _ref_routing(logits, 2, False, 0.1)
    ref = ref_aux + 0.05 * torch.logsumexp(logits, dim=-1).square().mean()
    assert torch.equal(experts, layer.router(tokens)[1])  # the reference's picks are the router's
    torch.testing.assert_close(layer.aux_loss_total, ref, rtol=ROUTER64, atol=0.0)


def test_recomputed_router_counts_its_picks_once():
    """The expert-bias token counts (--moe-router-enable-expert-bias) under recomputation: each pick once."""
    layer, tokens = _recomputed_layer(22, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    logits = tokens.float() @ layer.router.weight.detach().float().t()
    picks = torch.topk(torch.sigmoid(logits), 2, dim=-1)[1]  # the bias is still zero
    assert torch.equal(layer.router.tokens_per_expert, torch.bincount(picks.reshape(-1), minlength=6).float())


@pytest.mark.parametrize("tokens,topk,experts,factor,megatron", [(100, 1, 3, 0.9, 31), (24, 2, 4, 1.0, 12),
                                                                   (10, 2, 3, 0.7, 5), (64, 8, 256, 1.0, 2)])
def test_capacity_rows_are_megatrons(tokens, topk, experts, factor, megatron):
    """The rows per expert Megatron's ``get_capacity(T k, E, F)`` gives (``ceil((T k / E) F)`` in float64,
    worked out by hand: 100 / 3 * 0.9 = 30.000000000000004 -> 31, where ``0.9 * 100 / 3`` is exactly 30)."""
    from omnitron.core.transformer.moe.capacity import expert_capacity

    assert expert_capacity(tokens, topk, experts, factor) == megatron


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_expert_bias_counts_the_pairs_the_capacity_keeps(policy, pad):
    """With --moe-expert-capacity-factor the expert bias's token counts are Megatron's routing map after
    ``apply_router_token_dropping``: expert e keeps min(capacity, its picks n_e) of its picks, and with
    --moe-pad-expert-input-to-capacity exactly capacity rows (capacity <= T). Hand-derived from the picks, whatever
    the policy keeps; under full recomputation, counted once (before: the router's picks n_e were counted)."""
    import math

    kw = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_expert_capacity_factor=0.5,
              moe_token_drop_policy=policy, moe_pad_expert_input_to_capacity=pad)
    layer, tokens = _recomputed_layer(torch.seed() % 2**31, **kw)
    with torch.no_grad():  # the same float32 routing of the same tokens: the same picks
        picks = layer.router(tokens)[1]
    E, k, T = layer.num_experts, layer.topk, tokens.shape[0]
    cap = math.ceil(T * k / E * 0.5)  # 24 tokens, k 2, 6 experts: 4 rows, below the mean demand of 8
    n = torch.bincount(picks.reshape(-1), minlength=E).double()
    want = torch.full((E,), float(cap), dtype=torch.float64) if pad else n.clamp(max=cap)
    assert layer.router.tokens_per_expert.double().tolist() == want.tolist()
