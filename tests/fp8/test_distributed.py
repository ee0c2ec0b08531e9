"""FP8 across gloo processes: float8 tensors travel as uint8 views, and shared amaxes make
tensor-parallel shards, data-parallel replicas (delayed) and context-parallel sequence shards (tensorwise, a
linear outside tp) quantize exactly as the whole tensor does (one spawn for every case)."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim


def _fp8_travel(world: int) -> dict:
    """all_gather / broadcast / send-recv of float8 tensors over gloo; bit patterns must survive."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    coll, dev = be.collectives, be.device()
    rank = dist.get_rank()
    out = {}
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        g = torch.Generator().manual_seed(100 + rank)
        mine = (torch.randn(6, 5, generator=g) * 30).to(dt).to(dev)
        gathered = torch.empty(world * 6, 5, dtype=dt, device=dev)
        coll.all_gather(gathered, mine)
        expect = torch.cat([(torch.randn(6, 5, generator=torch.Generator().manual_seed(100 + r)) * 30).to(dt)
                            for r in range(world)])
        out[f"gather_{dt}"] = torch.equal(gathered.cpu().view(torch.uint8), expect.view(torch.uint8))
        b = mine.clone() if rank == 0 else torch.zeros(6, 5, dtype=dt, device=dev)
        coll.broadcast(b, src=0)
        out[f"bcast_{dt}"] = torch.equal(b.cpu().view(torch.uint8), expect[:6].view(torch.uint8))
        out[f"dtype_{dt}"] = gathered.dtype == dt and b.dtype == dt
    return out


def _tp_parity(tp: int) -> dict:
    """Column- and row-parallel FP8 GEMMs on shards vs the same FP8 GEMM on the whole tensors."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear, amax_groups_for
    from omnitron.core.precision.fp8.enable import tensorwise_role_groups
    from omnitron.core.precision.fp8.scaling import AmaxReducer

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), backend=be)
    dev = be.device()
    r = groups.tp.rank
    errs = {}

    def allsum(t):
        t = t.clone()
        dist.all_reduce(t, group=groups.tp.handle)
        return t

    for recipe in ("tensorwise", "delayed", "blockwise"):
        cfg = FP8Config(fp8_recipe=recipe, fp8_format="hybrid", fp8_amax_history_len=3)
        ex_full = FP8Linear(cfg, be.fp8)  # single-process reference, same inputs
        agroups = amax_groups_for(cfg, groups)  # delayed: both layers' amaxes reduced together, as enable_fp8 does
        reducer = AmaxReducer(agroups, be.collectives) if recipe == "delayed" else None
        # tensorwise: each operand reduced only over the groups it differs over (enable_fp8's choice)
        roles = {k: tensorwise_role_groups(k, groups) if recipe == "tensorwise" else None for k in ("column", "row")}
        coll = _Counting(be.collectives)
        ex_col = FP8Linear(cfg, be.fp8, amax_groups=agroups, collectives=coll, reducer=reducer,
                           role_groups=roles["column"])
        ex_row = FP8Linear(cfg, be.fp8, amax_groups=agroups, collectives=coll, reducer=reducer,
                           role_groups=roles["row"])
        worst = 0.0
        for step in range(3):  # several steps so delayed scaling uses its history
            g = torch.Generator().manual_seed(step)  # identical on every rank
            x = torch.randn(64, 256, generator=g) * (1 + 10 * step)
            x[3, 7] = 500.0
            w = torch.randn(256, 256, generator=g) * 0.05
            gy = torch.randn(64, 256, generator=g) * 1e-2
            x, w, gy = x.to(dev), w.to(dev), gy.to(dev)  # drawn on the host (same on every backend), used on the device
            xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
            yf = ex_full(xf, wf, None)
            yf.backward(gy)
            cols = slice(r * 256 // tp, (r + 1) * 256 // tp)
            # column parallel: w rows split; x replicated; dx partial sums over tp
            xc, wc = x.clone().requires_grad_(), w[cols].clone().requires_grad_()
            yc = ex_col(xc, wc, None)
            yc.backward(gy[:, cols])
            # row parallel: x columns and w columns split; y partial sums over tp
            xr, wr = x[:, cols].clone().requires_grad_(), w[:, cols].clone().requires_grad_()
            yr = ex_row(xr, wr, None)
            yr.backward(gy)
            for a, b in ((yc, yf[:, cols]), (allsum(xc.grad), xf.grad), (wc.grad, wf.grad[cols]),
                         (allsum(yr), yf), (xr.grad, xf.grad[:, cols]), (wr.grad, wf.grad[:, cols])):
                worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        errs[recipe] = worst
        errs[recipe + " all-reduces"] = coll.calls
    return errs


class _Counting:
    """Collectives that count all-reduces and delegate everything."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def all_reduce(self, *a, **kw):
        self.calls += 1
        return self.inner.all_reduce(*a, **kw)


def _dp_delayed(seed: int) -> dict:
    """Delayed scaling (within-step reductions) over dp 2, each rank its own inputs: the amax histories against
    one process's on both ranks' rows concatenated (the max over the concatenation is the max of the ranks' maxes).
    The dp group is amax_groups_for's: without it each replica keeps its own histories and scales."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear, amax_groups_for
    from omnitron.core.precision.fp8.scaling import AmaxReducer

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), backend=be)  # every rank data-parallel
    dev, rank = be.device(), dist.get_rank()
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=4)
    agroups = amax_groups_for(cfg, groups)
    mine = FP8Linear(cfg, be.fp8, amax_groups=agroups, collectives=be.collectives,
                     reducer=AmaxReducer(agroups, be.collectives))
    one = FP8Linear(cfg, be.fp8)  # the single process: no groups, every rank's rows
    for step in range(4):
        g = torch.Generator().manual_seed(seed + step)  # the test's fresh seed: identical on every rank
        w = torch.randn(16, 32, generator=g)
        xs = [torch.randn(8, 32, generator=g) * (1 + 3 * r + step) for r in range(dist.get_world_size())]
        gys = [torch.randn(8, 16, generator=g) * 10 ** -(r + 1) for r in range(len(xs))]
        x, wr = xs[rank].to(dev).requires_grad_(), w.to(dev).requires_grad_()
        mine(x, wr, None).backward(gys[rank].to(dev))
        x1, w1 = torch.cat(xs).requires_grad_(), w.clone().requires_grad_()
        one(x1, w1, None).backward(torch.cat(gys))
    ours, ref = mine.state_dict(), one.state_dict()
    return {role: (ours[role]["amax_history"].cpu(), ref[role]["amax_history"]) for role in ref}


def _cp_tensorwise(seed: int) -> dict:
    """Tensorwise FP8 on a plain linear (no tp group: the amax groups, tp x cp, apply) at cp 2, each rank a
    sequence shard: output and gradients against one process on the whole sequence, whose scales they must share."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear, enable_fp8

    be = get_backend()
    world, rank, dev = dist.get_world_size(), dist.get_rank(), be.device()
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=world), backend=be)
    cfg = FP8Config(fp8_recipe="tensorwise", fp8_format="hybrid")
    g = torch.Generator().manual_seed(seed)  # the test's fresh seed: identical on every rank
    x = torch.randn(8 * world, 32, generator=g) * torch.linspace(1, 40, 8 * world)[:, None]  # shards' amaxes differ
    gy = torch.randn(8 * world, 16, generator=g) * torch.linspace(1e-3, 1, 8 * world)[:, None]
    fc = torch.nn.Linear(32, 16, bias=False)
    fc.weight.data.copy_(torch.randn(16, 32, generator=g))
    ref = torch.nn.Linear(32, 16, bias=False)
    ref.weight.data.copy_(fc.weight.data)
    model = torch.nn.Sequential(fc).to(dev)
    enable_fp8(model, cfg, groups, backend=be)
    rows = slice(rank * 8, (rank + 1) * 8)
    xs = x[rows].to(dev).requires_grad_()
    y = model(xs)
    y.backward(gy[rows].to(dev))
    xf = x.clone().requires_grad_()
    yf = FP8Linear(cfg, be.fp8)(xf, ref.weight, None)
    yf.backward(gy)
    wgrad = model[0].weight.grad.clone()
    dist.all_reduce(wgrad)  # the shards' partial weight gradients
    return {"y": (y.detach().cpu(), yf[rows].detach()), "dx": (xs.grad.cpu(), xf.grad[rows]),
            "dw": (wgrad.cpu(), ref.weight.grad)}


def _all_cases(world: int, seed: int) -> dict:
    torch.set_num_threads(1)
    return {"travel": _fp8_travel(world), "tp": _tp_parity(world), "dp": _dp_delayed(seed),
            "cp": _cp_tensorwise(seed)}


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=[requires_sim(), pytest.mark.slow])])
def test_fp8_over_gloo_and_tensor_parallel_amax_sharing(backend):
    seed = int.from_bytes(os.urandom(4), "little")  # the dp and cp cases' inputs
    results = run_distributed(_all_cases, 2, 2, seed, backend=backend)
    for res in results:
        assert all(res["travel"].values()), res["travel"]
        tp = res["tp"]
        # tensorwise over tp2 (cp1), 3 steps: column 2 per step (weight, output gradient: the input is whole),
        # row 2 (input, weight: the output gradient is whole), where reducing every operand took 6
        assert tp.pop("tensorwise all-reduces") == 3 * 4, tp
        assert tp.pop("blockwise all-reduces") == 0 and tp.pop("delayed all-reduces") > 0, tp
        for recipe, err in tp.items():
            # shards share the whole tensor's scales: only fp32 summation order differs
            assert err < 1e-5, (recipe, err)
        for role, (ours, ref) in res["dp"].items():  # a max is exact: the histories are equal bit for bit
            assert torch.equal(ours, ref) and ref.max() > 0, (seed, role, ours, ref)
        for name, (ours, ref) in res["cp"].items():
            # the same scales, so the same FP8 operands: rows and columns are independent in y and dx (equal up
            # to fp32 summation order, k = 32 terms: ~sqrt(32) u32 = 7e-7); dw sums the two shards' partial
            # products (the same order argument). Own-shard scales change operands by up to an FP8 step (6%).
            assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5, (seed, name)
