"""The MoE layer under tensor parallelism WITHOUT sequence parallelism (tokens replicated over tp, as in sharded
inference) against the one-process layer, float64, on 2 gloo ranks.

Token counts that tp does not divide are the point: a decoding step holds one position (``s = 1``) for one or
three prompts, and a prompt's prefill may be odd. Layouts: tp 2 with the experts split over tp (etp 2, sharded
inference's layout), whole experts on every tp rank (etp 1), and tp 2 x ep 2 (etp 1). Configs: GeLU experts with
biases; SwiGLU experts with a shared expert and an expert capacity that drops assignments. Output, input gradient,
every parameter's gradient and the aux loss equal the one-process layer's.
"""
from __future__ import annotations

import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed

H, E = 16, 4
SHAPES = [(1, 1), (1, 3), (5, 1), (5, 2), (4, 2)]  # (s, b): decode steps, odd prefills, an even one
LAYOUTS = [(2, 1, 2), (2, 1, 1), (2, 2, 1)]  # (tp, ep, etp)
CONFIGS = ("gelu", "extras")
# float64 parity. Routing: the router computes float64 logits (router_dtype keeps a float64 model's) from the same
# tokens and weights in both runs, so the same experts and gates. Everything differs only in the order of sums: etp 2
# splits fc2's contraction (f <= 24 terms) and the shared expert's row-parallel fc2 in two partial sums; ep and the tp
# slices change the order in which the expert weights' gradients add their T <= 15 rows and the two tp ranks' partial
# sums. With n <= 32 terms, each below ~4 (weights N(0, 0.3), tokens N(0.5, 1), width <= 24), the error is <= n u
# sum|terms| ~ 32 x 1.1e-16 x 128 = 4.5e-13; the router's weight gradient sums the T <= 15 tokens' rows of the gates'
# gradients in another order too, the same bound.
RTOL = ATOL = 1e-12


def _config(kind: str):
    from omnitron.core.models.gpt import gpt2_tiny

    extras = dict(swiglu=True, moe_shared_expert_intermediate_size=8, moe_expert_capacity_factor=1.0,
                  moe_token_drop_policy="probs") if kind == "extras" else {}
    return gpt2_tiny(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=24, seq_length=8,
                     max_position_embeddings=8, vocab_size=64, hidden_dropout=0.0, num_experts=E, moe_router_topk=2,
                     moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.1, params_dtype=torch.float64, **extras)


def _layer(kind: str, groups):
    """The MoE layer of ``kind`` over ``groups``, its parameters the same full tensors in every layout (experts
    split over etp, the shared expert over tp)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import full_shape, init_full, shard_param, to_device
    from omnitron.core.transformer.moe import MoELayer

    layer = MoELayer(_config(kind), groups=groups, sequence_parallel=False, backend=get_backend(), out_std=0.02)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            group = groups.etp if getattr(p, "expert", False) else groups.tp
            full = init_full(name, full_shape(p, group.size), ("normal", 0.3), seed=17)
            p.copy_(shard_param(full, p, group.size, M.local_rank(group)))
    return to_device(layer, get_backend().device())  # where the groups' collectives run (sim: not the host)


def _run(layer, x: torch.Tensor, w: torch.Tensor) -> dict:
    """Forward and backward of ``(layer(x) * w).sum()``: output, input gradient, parameter gradients, aux loss."""
    device = next(layer.parameters()).device
    x = x.to(device).requires_grad_(True)
    y, _ = layer(x)
    (y * w.to(device)).sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in layer.named_parameters()}
    return {"y": y.detach().cpu(), "dx": x.grad.cpu(), "grads": grads, "aux": layer.aux_loss_total.cpu()}


def _full_grads(layer, grads: dict, groups) -> dict:
    """Every parameter's whole gradient: expert gradients summed over the ranks holding the same experts (edp),
    shards merged over etp (experts) or tp (shared expert), every ep rank's experts gathered."""
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import gather_param

    params = dict(layer.named_parameters())
    for name, g in grads.items():
        expert = getattr(params[name], "expert", False)
        g = M.all_reduce(g, groups.edp) if expert else g
        grads[name] = gather_param(g, params[name], groups.etp if expert else groups.tp)
    layer.fuse_full_state("", grads)  # every ep rank's experts (a collective: on the groups' device)
    return {n: g.cpu() for n, g in grads.items()}


def _worker() -> list:
    """Each (config, layout, shape): the tp layer's results and the one-process layer's, on this rank."""
    from omnitron.backends import get_backend

    torch.manual_seed(0)
    out = []
    for tp, ep, etp in LAYOUTS:
        groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                     expert_tensor_parallel_size=etp), backend=get_backend())
        for kind in CONFIGS:
            for s, b in SHAPES:
                x = torch.randn(s, b, H, dtype=torch.float64) + 0.5  # fresh tokens, the same on both ranks
                w = torch.randn(s, b, H, dtype=torch.float64)
                layer = _layer(kind, groups)
                got = _run(layer, x, w)
                got["grads"] = _full_grads(layer, got["grads"], groups)
                want = _run(_layer(kind, ParallelGroups.single()), x, w)
                want["grads"] = {n: g.cpu() for n, g in want["grads"].items()}
                out.append(((tp, ep, etp, kind, s, b), got, want))
    return out


def test_moe_layer_with_replicated_tokens_matches_one_process():
    """Output, input gradient, all parameter gradients and aux loss at tp 2 without sequence parallelism equal the
    one-process layer's, for token counts tp does not divide (the decode step of sharded generation)."""
    ranks = run_distributed(_worker, 2, env=REFERENCE_KERNELS)
    for rank, cases in enumerate(ranks):
        assert len(cases) == len(LAYOUTS) * len(CONFIGS) * len(SHAPES)
        for key, got, want in cases:
            where = f"rank {rank} (tp, ep, etp, config, s, b) = {key}"
            torch.testing.assert_close(got["y"], want["y"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} y: {m}")
            torch.testing.assert_close(got["dx"], want["dx"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} dx: {m}")
            torch.testing.assert_close(got["aux"], want["aux"], rtol=RTOL, atol=ATOL, msg=lambda m: f"{where} aux")
            assert got["grads"].keys() == want["grads"].keys(), where
            for name, g in got["grads"].items():
                torch.testing.assert_close(g, want["grads"][name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{where} {name}: {m}")
