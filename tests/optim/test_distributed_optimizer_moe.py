"""--use-distributed-optimizer with MoE expert parameters, against the replicated optimizer.

Expert masters and moments are sharded over the expert-data-parallel group (edp), dense ones over
dp x cp. One spawn of 4 gloo ranks trains a tiny MoE GPT (4 experts, top-2, aux loss) under
ep2 x dp4 (edp 2; AdamW, overlapped reduce-scatter) and tp2 x ep2 with expert tensor parallelism 1
(edp 2, dp 2; sequence parallel, fp16 with dynamic loss scaling whose first steps overflow), with
tight clipping, weight decay and small buckets. Losses, gradient norms, parameters and state dicts
must equal the plain optimizer's; checkpoint state crosses both ways; each rank holds ~1/dp of the
dense and ~1/edp of the expert state. tp2 x etp2 (ep 1, edp 2, SP, AdamW) does the same with the
experts split over tp. A hand-made dp4 x ep2 model whose two ranks own no gradient
element at all checks that those ranks still take part (norm, overflow check, gathers), and that an
inf in one rank's expert slice skips the step everywhere.
"""
from __future__ import annotations

import os

import pytest
import torch
from test_distributed_optimizer import TOL, _case, _close, _state_close

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1", "--moe-ffn-hidden-size", "24", "--moe-aux-loss-coeff", "0.01"]
CASES = {  # name: (tp, pp, extra flags)
    "ep2dp4_adam": (1, 1, [*MOE, "--overlap-grad-reduce"]),
    # NOTE: no biases: a key bias has zero gradient (the softmax ignores a shift shared by every key), so its Adam
    # state is fp16 rounding noise that the two optimizers need not share (one element differed by 4.6e-5 in a
    # master, 2026-12-06, once the routers gained their --add-bias-linear bias)
    "tp2ep2_fp16": (2, 1, [*MOE, "--sequence-parallel", "--fp16", "--initial-loss-scale", "524288",
                           "--hysteresis", "1", "--disable-bias-linear"]),
    # expert tensor parallelism 2 (experts split over tp; edp 2): fc2's etp-replicated bias counts once
    "tp2etp2_adam": (2, 1, [*MOE[:4], "--expert-tensor-parallel-size", "2", *MOE[8:], "--sequence-parallel"]),
}
TINY_STEPS = 3


class _Tiny(torch.nn.Module):
    """loss = mean((x @ a^T * b - t)^2): ``a`` [1, 2] dense, ``b`` [1, 1] an expert (one per ep rank); float64."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([[0.5, -1.0]], dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.tensor([[0.3 + ep_rank]], dtype=torch.float64))
        self.b.expert = True

    def forward(self, x, t):
        return ((x @ self.a.t() * self.b - t) ** 2).mean()


def _tiny(distributed: bool) -> dict:
    """dp4 x ep2: the dense bucket pads 2 elements to lcm(4, 128) = 128 (4 shards of 32: rank 0 owns both) and the
    expert bucket 1 to 128 (2 shards; edp ranks are world {0, 2} and {1, 3}: ranks 0 and 1 own their expert), so
    world ranks 2 and 3 own nothing under the distributed optimizer."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import DistributedOptimizer, MixedPrecisionOptimizer
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import to_device
    from omnitron.core.precision.loss_scaler import ConstantLossScaler

    be, rank = get_backend(), dist.get_rank()
    groups = ParallelGroups.build(ParallelConfig(expert_model_parallel_size=2), backend=be)
    model, dev = to_device(_Tiny(groups.ep.rank), be.device()), be.device()
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(use_distributed_optimizer=distributed),
                                  collectives=be.collectives)
    cfg = OptimizerConfig(lr=0.1, weight_decay=0.1, clip_grad=0.05)
    cls, kw = (DistributedOptimizer, {"chunks": [ddp]}) if distributed else (MixedPrecisionOptimizer, {})
    opt = cls(list(model.named_parameters()), cfg, groups, backend=be, loss_scaler=ConstantLossScaler(1.0), **kw)
    g = torch.Generator().manual_seed(100 + rank)
    out = {"owns": len(getattr(opt, "slices", [])), "losses": [], "norms": []}
    for step in range(TINY_STEPS + 1):
        ddp.zero_grad_buffer()
        loss = model(*(torch.randn(4, n, generator=g, dtype=torch.float64).to(dev) for n in (2, 1)))
        loss.backward()
        ddp.finish_grad_sync()
        if step == TINY_STEPS:
            if not distributed:
                break
            if rank == 1:  # the owner of the one expert element of ep rank 1
                model.b.main_grad.fill_(float("inf"))
            out["inf_skipped"] = opt.step(0.1).skipped
            break
        out["losses"].append(loss.item())
        out["norms"].append(opt.step(0.1).grad_norm)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["state"] = opt.state_dict()
    return out


def _worker(root):
    torch.set_num_threads(1)
    out = {name: _case(tp, pp, extra, os.path.join(root, name)) for name, (tp, pp, extra) in CASES.items()}
    out["tiny"] = {"plain": _tiny(False), "dist": _tiny(True)}
    return out


def _check_case(name: str, rank: int, r: dict, tp: int, pp: int, results: list[dict]) -> None:
    fp16 = "fp16" in name
    # NOTE: fp16 parameters round masters equal to ~1e-7: allow a flipped last bit; the AdamW cases train float64
    # (test_distributed_optimizer's TOL: the MoE adds the edp reduce-scatter, <= 2 partial sums, to its analysis)
    rtol, ptol = (1e-4, dict(rtol=1e-3, atol=1e-3)) if fp16 else (TOL, dict(rtol=TOL, atol=TOL / 10))
    _close(r["dist"], r["plain"], rtol)
    assert all(n is not None and n > 0.05 for _, n, s in r["plain"] if not s), "clipping must be active"
    assert any(".experts." in k for k in r["plain_params"]), "the model must have expert parameters"
    for k, p in r["plain_params"].items():
        torch.testing.assert_close(r["dist_params"][k], p, **ptol, msg=lambda m: f"{name} {k}: {m}")
    _state_close(r["dist_state"], r["plain_state"], 1e-4 if fp16 else TOL, 1e-6 if fp16 else TOL / 10)
    for other in ("dist_more", "d2p_more", "p2d_more"):
        _close(r[other], r["plain_more"], rtol)
    for k, p in r["plain_more_params"].items():
        torch.testing.assert_close(r["p2d_params"][k], p, **ptol)
    # every dense element owned by exactly one rank of dp x cp, every expert element by one of edp, and a rank's
    # state no more than its slices (1/dp of each dense bucket, 1/edp of each expert bucket, Megatron's padding)
    per_param = 12 if fp16 else 16  # fp32 masters + moments; float64 moments
    assert r["edp"] == 2 and r["expert_numel"] > 0, (name, r["edp"])
    plain_b, dist_b = r["bytes"]
    assert plain_b == per_param * r["numel"], (name, plain_b)
    assert sum(results[q][name]["owned"][0] for q in r["peers"]) == r["numel"] - r["expert_numel"], (name, rank)
    assert sum(results[q][name]["owned"][1] for q in r["edp_peers"]) == r["expert_numel"], (name, rank)
    assert dist_b == per_param * sum(r["owned"]) and dist_b <= per_param * r["padded"], (name, rank, dist_b)


def _check_tiny(results: list[dict]) -> None:
    assert [r["tiny"]["dist"]["owns"] for r in results] == [2, 1, 0, 0], "ranks 2 and 3 must own no element"
    for rank, res in enumerate(results):
        plain, dist_ = res["tiny"]["plain"], res["tiny"]["dist"]
        assert len(set(plain["norms"])) == TINY_STEPS and min(plain["norms"]) > 0.05, "clipping must be active"
        for key in ("losses", "norms"):  # float64, 3 elements: TOL's analysis with n <= 4 terms a sum
            for a, b in zip(dist_[key], plain[key], strict=True):
                assert abs(a - b) <= TOL * abs(b), (rank, key, a, b)
        assert dist_["inf_skipped"], f"rank {rank} must skip the step with an inf in rank 1's expert slice"
        for n, p in plain["params"].items():  # the skipped step left the parameters alone
            torch.testing.assert_close(dist_["params"][n], p, rtol=TOL, atol=TOL / 10)
        _state_close(dist_["state"], plain["state"], TOL, TOL / 10)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=[pytest.mark.slow, requires_sim()])])
def test_distributed_optimizer_shards_experts_over_edp(tmp_path, backend):
    results = run_distributed(_worker, 4, str(tmp_path), backend=backend)
    for name, (tp, pp, _) in CASES.items():
        if backend == "sim" and "fp16" in name:
            # NOTE: runs on sim but is not compared there: the tolerances above hold where plain and distributed
            # norms agree to the bit (cpu). On sim attention takes SDPA's math path (torch has no fused kernel
            # for an out-of-tree device), the fp16 activations round differently, the two optimizers' grad
            # norms then differ in the 8th digit, and fp16 parameter rounding amplifies that to 2.5e-5 in a
            # master after 3 steps (measured 2026-12-01), past the 1e-6 written for a flipped last bit.
            continue
        for rank, res in enumerate(results):
            _check_case(name, rank, res[name], tp, pp, results)
        if "fp16" in name:
            assert results[0][name]["plain"][0][2], "the first fp16 step overflows at the initial scale"
    _check_tiny(results)
