"""Global-norm clipping and overflow skipping across tp x pp ranks equal the single-process step."""
from __future__ import annotations

import torch

from omnitron.testing.distributed import run_distributed

# full parameter name -> (shape, how it is split over tp: None replicated, else the dim), pipeline stage
LAYOUT = {
    "embed": ((10, 4), 0, 0),       # vocab-parallel embedding on stage 0 (tied with "out" on stage 1)
    "a.w": ((8, 4), 0, 0), "a.b": ((8,), 0, 0), "a.w2": ((4, 8), 1, 0), "a.b2": ((4,), None, 0),
    "b.norm": ((4,), None, 1), "b.w": ((6, 4), 0, 1), "b.b": ((6,), 0, 1),
}


def _full_grads(seed: int) -> dict[str, torch.Tensor]:
    """Gradients of the whole model, about a fifth of their elements exactly zero (--log-num-zeros-in-grad)."""
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(shape, generator=g) * 2 for n, (shape, _, _) in LAYOUT.items()}
    for t in out.values():
        t[torch.rand(t.shape, generator=g) < 0.2] = 0.0
    return out


def _full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(shape, generator=g) for n, (shape, _, _) in LAYOUT.items()}


def _shard(t, dim, tp, r):
    return t if dim is None else t.chunk(tp, dim)[r].clone()


def _worker(inject_inf: bool):
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import MixedPrecisionOptimizer
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision import ConstantLossScaler

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                                  be.collectives)
    tp, stage = groups.tp.rank, groups.pp.rank
    full_p, full_g = _full_params(), _full_grads(3)
    named, dup = [], []
    items = [(n, spec) for n, spec in LAYOUT.items() if spec[2] == stage]
    if stage == 1:
        items.append(("out", LAYOUT["embed"]))  # the tied copy on the last stage
    for name, (shape, dim, _) in items:
        src = "embed" if name == "out" else name
        p = torch.nn.Parameter(_shard(full_p[src], dim, 2, tp).to(be.device()))  # the backend under test's
        p.tensor_model_parallel = dim is not None
        p.main_grad = _shard(full_g[src], dim, 2, tp).to(be.device()) * 8.0  # loss scale 8
        if inject_inf and groups.rank == 3 and name == "b.norm":
            p.main_grad[0] = float("inf")
        named.append((name, p))
        if name == "out":
            dup.append(p)
    cfg = OptimizerConfig(optimizer="sgd", lr=0.1, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0)
    opt = MixedPrecisionOptimizer(named, cfg, groups, backend=be, loss_scaler=ConstantLossScaler(8.0), duplicates=dup)
    res = opt.step(0.1, count_zeros=True)
    return {"skipped": res.skipped, "norm": res.grad_norm, "zeros": res.num_zeros_in_grad, "tp": tp, "stage": stage,
            "params": {n: p.detach().clone() for n, p in named}}


def _bundle():
    return _worker(False), _worker(True)


# Bounds (fp32, u = 2**-24 = 6e-8). The 150 gradient elements (randn x 2, scaled by 8 and unscaled: exact, powers of
# two) give a sum of 150 positive fp32 squares, partial sums per rank, then a 4-rank fp32 all-reduce: <= 150 u
# relative, the norm (a square root) <= 75 u + u = 4.6e-6 relative (NORM_REL 1e-5). The clip factor 1 / (norm +
# 1e-6) ~ 0.04 carries that and one fp32 rounding; the update 0.1 x coef x g (|g| <= 8 at 4 sigma: <= 0.033) then
# errs by <= 0.033 x (4.6e-6 + 2 u) = 1.6e-7, and storing p - update (both sides round it, |p| <= 4) by <= 2 u x 4
# = 4.8e-7: <= 6.4e-7 absolute, inside atol 1e-6 (a wrong clip, a 4-element shard counted twice or a missed tied copy
# moves the norm, hence every update, by >= ~1%: >= 3e-4 on the largest).
NORM_REL, PARAM_ATOL = 1e-5, 1e-6


def test_clip_and_skip_over_tp2_pp2():
    results = run_distributed(_bundle, 4)
    full_p, full_g = _full_params(), _full_grads(3)
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in full_g.values())).item()
    coef = 1.0 / (norm + 1e-6)
    zeros = sum(int((g == 0).sum()) for g in full_g.values())
    for clean, dirty in results:
        assert dirty["skipped"] and not clean["skipped"]
        assert abs(clean["norm"] - norm) <= NORM_REL * norm
        assert clean["zeros"] == zeros  # each element once: tp shards, replicated and tied tensors
        for name, p in clean["params"].items():
            src = "embed" if name == "out" else name
            shape, dim, _ = LAYOUT[src]
            expect = _shard(full_p[src] - 0.1 * coef * full_g[src], dim, 2, clean["tp"])
            torch.testing.assert_close(p, expect, rtol=0, atol=PARAM_ATOL)
        for name, p in dirty["params"].items():
            src = "embed" if name == "out" else name
            assert torch.equal(p, _shard(full_p[src], LAYOUT[src][1], 2, dirty["tp"]))
