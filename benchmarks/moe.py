"""Mixture-of-Experts layer vs a dense MLP with the same active parameters per token, and where the MoE time goes.

The dense MLP has ffn width ``F``; the MoE layer has ``E`` experts of width ``F / k`` and routes each
token to ``k`` of them, so both run the same GEMM FLOPs per token (plus the router). Every variant
is forward + backward of ``(layer(x) * w).sum()`` on ``T`` tokens (the same global tokens for every
layout), GeLU MLPs with biases, aux-loss 0.01:

- ``ep=1``: one process (2 threads on CPU), all experts local;
- ``ep=2``: 2 gloo processes x 1 thread, each holding half the experts and half the tokens (dp 2);
  the dense MLP at 2 processes is plain data parallelism (no communication in the layer);
- ``dropless`` (every routed pair processed) vs ``capacity 1.0`` (``--moe-expert-capacity-factor 1``:
  each expert takes at most ``ceil(T_rank * k / E)`` pairs, the lowest-probability ones dropped).

On CPU both layouts run in one spawned world of 2 ranks and are interleaved round by round (ep=1
on rank 0 while rank 1 waits in a barrier), so noise hits all alike; medians over rounds.

Columns: ``ms`` median wall ms per fwd+bwd (slowest rank); ``tok/s`` = T / ms; ``vs dense`` the
dense MLP's time over this one's at the same ep (above 1: faster than dense); ``CPU ms`` process
CPU time summed over ranks; ``kept`` the fraction of routed (token, expert) pairs processed. The
breakdown times the layer's parts separately, each forward + backward, on the same tokens:
``router`` (router GEMM, top-k, softmax, aux loss, routing/capacity mask), ``permute`` (gather
the pairs expert-major, regroup, weighted scatter-add back: :func:`dispatch` + :func:`combine`
with identity experts, minus the all-to-all), ``all-to-all`` (time inside the row all-to-alls,
forward and backward, measured by wrapping the dispatcher's exchange; the per-expert count
exchange stays in ``permute``), ``experts`` (the expert MLPs on the dispatched rows). ``dispatch
share`` = (router + permute + all-to-all) / (router + permute + all-to-all + experts).

    python benchmarks/moe.py [--ep 1,2] [--size small] [--rounds 10] [--json FILE]
    OMNITRON_BACKEND=cuda python benchmarks/moe.py --ep 1 --size large   (one GPU, bf16)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel import dump_json, interleaved, print_table  # noqa: E402

SIZES = {  # hidden, dense ffn F, experts E, top-k, tokens T per step
    "small": dict(hidden=256, ffn=1024, experts=8, topk=2, tokens=4096),
    "large": dict(hidden=2048, ffn=8192, experts=8, topk=2, tokens=16384),
}
LAYERS = [("dense MLP", None), ("MoE dropless", None), ("MoE capacity 1.0", 1.0)]


class _A2ATimer:
    """Wraps the dispatcher's row all-to-all (forward and backward both call it) and sums its time."""

    def __init__(self, sync) -> None:
        import importlib

        module = importlib.import_module("omnitron.core.transformer.moe.dispatch")
        self.inner, self.sync, self.total = module._all_to_all, sync, 0.0
        module._all_to_all = self

    def __call__(self, *args):
        self.sync()
        t = time.perf_counter()
        out = self.inner(*args)
        self.sync()
        self.total += time.perf_counter() - t
        return out


def _config(size: dict, capacity: float | None):
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=1, hidden_size=size["hidden"], num_attention_heads=4, ffn_hidden_size=size["ffn"],
                     num_experts=size["experts"], moe_router_topk=size["topk"],
                     moe_ffn_hidden_size=size["ffn"] // size["topk"], moe_aux_loss_coeff=0.01,
                     moe_expert_capacity_factor=capacity)


def _backward(fn, *inputs, weight=None):
    """Closure: ``fn`` on fresh leaf copies of ``inputs``, then backward of its (weighted) sum."""
    def run():
        y = fn(*[t.detach().requires_grad_(t.is_floating_point()) for t in inputs])
        (y.float().sum() if weight is None else (y * weight).float().sum()).backward()
    return run


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Layers built outside a model keep ``torch.empty`` storage: weights N(0, 0.02), biases 0 (router
    logits then have std ~0.3 on unit tokens: near-uniform, random routing, as after load balancing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.zeros(p.shape))
    return module


def _permute(x, gates, mask, group):
    """Dispatch and combine with identity experts: the layer's data movement alone."""
    from omnitron.core.transformer.moe.dispatch import combine, dispatch

    rows, plan = dispatch(x, mask, group)
    return combine(rows, gates, plan, group)


def _timed_a2a(fn, timer: _A2ATimer, record: list):
    """``fn`` that appends the all-to-all seconds spent inside each call to ``record``."""
    def run():
        before = timer.total
        fn()
        record.append(timer.total - before)
    return run


def _layer_variants(size: dict, groups, ep: int, dtype, kept: dict, timer: _A2ATimer, a2a: dict) -> dict:
    """``name -> (distributed, fn)`` for one expert-parallel size; ``kept[name]`` gets the processed
    share of routed pairs, ``a2a[name]`` the all-to-all seconds of each permute call."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.transformer.mlp import MLP
    from omnitron.core.transformer.moe import MoELayer
    from omnitron.core.transformer.moe.dispatch import dispatch
    from omnitron.core.transformer.moe.experts import run_experts

    be = get_backend()
    dev, T, h = be.current_device(), size["tokens"] // ep, size["hidden"]
    g = torch.Generator().manual_seed(0)
    xs, ws = torch.randn(ep, T, 1, h, generator=g), torch.randn(ep, T, 1, h, generator=g)
    d = M.local_rank(groups.dp) if ep > 1 else 0
    x, w = xs[d].to(dev, dtype), ws[d].to(dev, dtype)
    out = {}
    for label, capacity in LAYERS:
        c = _config(size, capacity)
        name = f"{label}, ep={ep}"
        if label.startswith("dense"):
            mlp = _init(MLP(c, group=groups.tp, sequence_parallel=False, backend=be, out_std=0.02,
                            skip_out_bias=False), 1).to(dev, dtype)
            out[name] = (ep > 1, _backward(lambda t, m=mlp: m(t)[0], x, weight=w))
            continue
        layer = _init(MoELayer(c, groups=groups, sequence_parallel=False, backend=be, out_std=0.02), 2).to(dev, dtype)
        out[name] = (ep > 1, _backward(lambda t, m=layer: m(t)[0], x, weight=w))
        gates, mask = layer._route(x.reshape(T, h))
        kept[name] = mask.sum().item() / (T * size["topk"])
        rows, plan = dispatch(x.reshape(T, h), mask, groups.ep)
        experts = list(layer.experts.values())
        out[name + " | router"] = (ep > 1, _backward(lambda t, m=layer: m._route(t)[0], x.reshape(T, h)))
        permute = _backward(lambda t, gt, m=mask: _permute(t, gt, m, groups.ep), x.reshape(T, h), gates.detach(),
                            weight=w.reshape(T, h))
        out[name + " | permute"] = (ep > 1, _timed_a2a(permute, timer, a2a.setdefault(name, [])))
        out[name + " | experts"] = (ep > 1, _backward(lambda r, p=plan, e=experts: run_experts(r, p.local_counts, e,
                                                                                              groups.etp), rows))
    return out


def moe_worker(eps: list[int], size_name: str, rounds: int, dtype_name: str) -> dict:
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    be, dtype = get_backend(), getattr(torch, dtype_name)
    world = dist.get_world_size() if dist.is_initialized() else 1
    barrier = dist.barrier if world > 1 else (lambda: None)
    variants, kept, a2a, timer = {}, {}, {}, _A2ATimer(be.synchronize)
    for ep in eps:
        groups = (ParallelGroups.single() if ep == 1 else
                  ParallelGroups.build(ParallelConfig(expert_model_parallel_size=ep), be.collectives))
        variants.update(_layer_variants(SIZES[size_name], groups, ep, dtype, kept, timer, a2a))
    rank = dist.get_rank() if world > 1 else 0
    times = interleaved(variants, rank, rounds, barrier, sync=be.synchronize)
    return {"times": times, "kept": kept, "a2a": {n: v[1:] for n, v in a2a.items()}}


def summarize(ranks: list[dict], size: dict) -> dict:
    def med(name: str, i: int, combine=max) -> float:
        runs = [r["times"][name] for r in ranks if r["times"][name]]
        return statistics.median(combine(x[k][i] for x in runs) for k in range(len(runs[0]))) * 1e3

    rows = []
    names = [n for n in ranks[0]["times"] if " | " not in n]
    for n in names:
        ep = n.split("ep=")[1]
        dense = med(f"dense MLP, ep={ep}", 0)
        row = {"variant": n, "ms": med(n, 0), "cpu_ms": med(n, 1, sum), "kept": ranks[0]["kept"].get(n)}
        row.update(tok_s=size["tokens"] / row["ms"] * 1e3, vs_dense=dense / row["ms"])
        if n + " | router" in ranks[0]["times"]:
            a2a = max(statistics.median(r["a2a"][n]) for r in ranks if r["a2a"].get(n)) * 1e3
            parts = {"router": med(n + " | router", 0), "permute": med(n + " | permute", 0) - a2a, "a2a": a2a,
                     "experts": med(n + " | experts", 0)}
            row.update(parts)
            row["dispatch_share"] = 1 - parts["experts"] / sum(parts.values())
        rows.append(row)
    return {"rows": rows, "size": size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", default=None,
                    help="comma-separated expert-parallel sizes (1, 2); default 1,2 on CPU, 1 on devices")
    ap.add_argument("--size", default=None, choices=sorted(SIZES), help="default: small on CPU, large on devices")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from omnitron.backends import get_backend

    be = get_backend()
    on_cpu = be.current_device().type == "cpu"
    eps = [int(e) for e in (args.ep or ("1,2" if on_cpu else "1")).split(",")]
    size_name = args.size or ("small" if on_cpu else "large")
    dtype = "float32" if on_cpu else "bfloat16"
    if max(eps) > 2:
        raise SystemExit("--ep: 1 and/or 2")
    if 2 in eps:
        from omnitron.testing.distributed import run_distributed

        ranks = run_distributed(moe_worker, 2, eps, size_name, args.rounds, dtype, timeout_s=600)
    else:  # one process, no process group (e.g. one GPU)
        if on_cpu:
            torch.set_num_threads(2)
        ranks = [moe_worker(eps, size_name, args.rounds, dtype)]
    size = SIZES[size_name]
    res = summarize(ranks, size)
    res.update(backend=be.name, device=be.capabilities().device_name, dtype=dtype, eps=eps, rounds=args.rounds)
    print(f"{res['device']} ({be.name}), {dtype}: T = {size['tokens']} tokens, hidden {size['hidden']}; dense ffn "
          f"{size['ffn']} vs {size['experts']} experts x ffn {size['ffn'] // size['topk']}, top-{size['topk']}; "
          f"fwd+bwd, median of {args.rounds} interleaved rounds")
    print_table(res["rows"], [("variant", "variant", ""), ("ms", "ms", ".1f"), ("tok/s", "tok_s", ".0f"),
                              ("vs dense", "vs_dense", ".2f"), ("CPU ms", "cpu_ms", ".1f"), ("kept", "kept", ".3f"),
                              ("router ms", "router", ".1f"), ("permute ms", "permute", ".1f"),
                              ("all-to-all ms", "a2a", ".1f"), ("experts ms", "experts", ".1f"),
                              ("dispatch share", "dispatch_share", ".0%")])
    dump_json(args.json, res)


if __name__ == "__main__":
    main()
