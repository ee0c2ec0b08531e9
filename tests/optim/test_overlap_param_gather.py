"""--overlap-param-gather and the flat parameter buffers of the distributed optimizer.

One spawn of 4 gloo ranks runs:

* training (dp4 with two micro-batches per step and overlapped gradient reduction; pp2 x dp2 with
  virtual chunks) with the distributed optimizer, with and without --overlap-param-gather: losses,
  gradient norms, a validation pass started while gathers are pending, and the final parameters must be
  bit-identical (same arithmetic, only the wait moves). A checkpoint saved mid-run with gathers pending
  resumes bit-exactly; only data x context parallel rank 0 writes optimizer tensors.
* a hand-built bf16 model at dp4 whose all-gathers run only when waited on (a lazy collectives shim,
  deterministic where gloo completes in a background thread): after the step every parameter is stale,
  the first layer's forward pre-hook brings its own parameters up to date while the last layer's stay
  stale, no gather is waited inside the step, and every gather writes into the model's own storage.
* the in-place flat all-gather against the expected concatenation (fp32 and bf16), and its size check.
"""
from __future__ import annotations

import contextlib
import os
import types

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.optim.test_distributed_optimizer import _args, _Run

STEPS, MORE = 3, 2
CASES = {  # name: (pp, extra flags); both with several micro-batches per step
    "dp4": (1, ["--overlap-grad-reduce", "--global-batch-size", "8"]),
    "pp2dp2_vp": (2, ["--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--global-batch-size", "8"]),
}


def _params(run) -> dict:
    run.c.optimizer.finish_param_gather()
    return run.params()


def _pending(run) -> bool:
    return any(b.param_handle is not None for ch in run.c.chunks for b in ch.buckets)


def _val(run) -> float:
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import evaluate

    return evaluate(run.c, data_iterator(run.c, run.c.train_data, 0), 1)["val_loss"]


def _training(pp, extra, root) -> dict:
    """Distributed optimizer with and without overlap; a checkpoint of the overlapped run resumes."""
    from omnitron.core.checkpoint.io import read_shard
    from omnitron.core.training import checkpointing

    save = os.path.join(root, "ckpt")
    args = _args(1, pp, extra, root, True) + ["--save", save, "--ckpt-format", "torch"]  # reads its rank files
    ref, ov = _Run(args), _Run(args + ["--overlap-param-gather"])
    out = {"ref": ref.steps(STEPS), "ov": ov.steps(STEPS), "pending": _pending(ov)}
    out["ref_val"], out["ov_val"] = _val(ref), _val(ov)
    out["ref"] += ref.steps(1)
    out["ov"] += ov.steps(1)
    ov.c.iteration = STEPS + 1
    path = checkpointing.save(ov.c)  # gathers pending: save must finish them first
    shard = read_shard(path, ov.c.groups.rank)["optimizer"]
    out["writes_optimizer"], out["tensors_from"] = bool(shard["tensors"]), shard.get("tensors_from")
    out["shard_bytes"] = os.path.getsize(os.path.join(path, f"rank_{ov.c.groups.rank:05d}.pt"))
    out["dp_cp_rank"] = ov.c.groups.dp_cp.rank
    resumed = _Run(args + ["--overlap-param-gather", "--load", save])
    checkpointing.load(resumed.c)
    from omnitron.core.training.loop import data_iterator

    resumed.it = data_iterator(resumed.c, resumed.c.train_data, resumed.c.consumed_samples)
    out["ref_more"], out["ov_more"], out["resumed_more"] = ref.steps(MORE), ov.steps(MORE), resumed.steps(MORE)
    out["ref_params"], out["ov_params"] = _params(ref), _params(ov)
    out["resumed_params"] = _params(resumed)
    return out


class _LazyGather:
    """Collectives whose in-place all-gather runs only when its handle is waited on; records the buffers, and the
    order the gathers were launched in (``launched``: buffer addresses)."""

    def __init__(self, coll) -> None:
        self.coll, self.waits, self.buffers, self.launched = coll, 0, set(), []

    def __getattr__(self, name):
        return getattr(self.coll, name)

    def all_gather_in_place(self, buffer, group=None, async_op=False):
        self.buffers.add(buffer.data_ptr())
        self.launched.append(buffer.data_ptr())
        lazy = self

        class Handle:
            def wait(self) -> None:
                lazy.waits += 1
                lazy.coll.all_gather_in_place(buffer, group=group)

        handle = Handle()
        if not async_op:
            handle.wait()
        return handle


def _deferred(overlap: bool) -> dict:
    """Three steps of a hand-built bf16 model (two micro-batches each); snapshots around the first step."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import DistributedOptimizer
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), be.collectives)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).to(be.device(), torch.bfloat16)
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=overlap, bucket_size=50, overlap_grad_reduce=True,
        accumulate_allreduce_grads_in_fp32=True), collectives=be.collectives)  # buckets need --overlap-grad-reduce
    lazy = _LazyGather(be.collectives)
    shim = types.SimpleNamespace(collectives=lazy, kernels=be.kernels, current_device=be.current_device)
    opt = DistributedOptimizer(list(model.named_parameters()), OptimizerConfig(lr=1e-2, weight_decay=0.1), groups,
                               backend=shim, chunks=[ddp])
    gen = torch.Generator().manual_seed(100 + groups.rank)
    out = {"losses": [], "buckets": len(ddp.buckets)}
    first, last = model[0].weight, model[4].weight
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        for mb in range(2):
            x, y = (torch.randn(*shape, generator=gen).to(be.device()) for shape in ((4, 8), (4, 3)))
            with ddp.no_sync() if mb == 0 else contextlib.nullcontext():
                loss = ((ddp(x.bfloat16()).float() - y) ** 2).mean()
                loss.backward()
            out["losses"].append(loss.item())
        ddp.finish_grad_sync()
        waits, launched = lazy.waits, len(lazy.launched)
        opt.step(1e-2)
        if step == 0:
            out["waits_in_step"] = lazy.waits - waits
            where = {b.param_data.data_ptr(): k for k, b in enumerate(ddp.buckets)}  # buckets in backward order
            out["launch_order"] = [where[ptr] for ptr in lazy.launched[launched:]]
            stale = [p.detach().clone() for p in (first, last)]
            model[0](x.bfloat16())  # the first layer alone: its pre-hook waits for its own bucket only
            mid = [p.detach().clone() for p in (first, last)]
            opt.finish_param_gather()
            out["first"] = [torch.equal(t, first) for t in (stale[0], mid[0])]  # [after step, after pre-hook]
            out["last"] = [torch.equal(t, last) for t in (stale[1], mid[1])]
    opt.finish_param_gather()
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    out["into_model"] = (lazy.buffers == {b.param_data.data_ptr() for b in ddp.buckets}
                         and storages == {buf.param_data.untyped_storage().data_ptr() for buf in ddp.buffers})
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def _in_place() -> dict:
    from omnitron.backends import get_backend

    be = get_backend()
    coll = be.collectives
    rank, world = coll.rank(), coll.world_size()
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        buf = torch.full((world * 5,), -1.0, dtype=dt, device=be.device())
        buf[rank * 5:(rank + 1) * 5] = torch.randn(5, generator=torch.Generator().manual_seed(rank)).to(be.device(), dt)
        coll.all_gather_in_place(buf, async_op=True).wait()
        out[str(dt)] = buf
    try:
        coll.all_gather_in_place(torch.zeros(world * 5 + 1, device=be.device()))
    except ValueError as err:
        out["error"] = str(err)
    return out


def _worker(root):
    torch.set_num_threads(1)
    out = {name: _training(pp, extra, os.path.join(root, name)) for name, (pp, extra) in CASES.items()}
    out["deferred"] = {flag: _deferred(flag) for flag in (False, True)}
    out["in_place"] = _in_place()
    return out


@pytest.fixture(scope="module", params=[None, pytest.param("sim", marks=[pytest.mark.slow, requires_sim()])])
def results(request, tmp_path_factory):
    """The ranks' results (``request.param``: their backend; None: the session's; sim: 61 s on the loaded
    2-core machine, 2026-12-03)."""
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("overlap")), backend=request.param)


def _equal_params(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_overlap_matches_non_overlapped_bit_for_bit(results):
    for name in CASES:
        for rank, res in enumerate(results):
            r = res[name]
            assert r["pending"], (name, rank, "gathers must be pending after the step with --overlap-param-gather")
            assert r["ov"] == r["ref"], (name, rank)
            assert r["ov_val"] == r["ref_val"], (name, rank)
            assert r["ov_more"] == r["resumed_more"] == r["ref_more"], (name, rank)
            _equal_params(r["ov_params"], r["ref_params"])
            _equal_params(r["resumed_params"], r["ov_params"])
            assert all(n is not None and not s for _, n, s in r["ov"])


def test_checkpoint_optimizer_state_written_once_per_replica_group(results):
    for name in CASES:
        writers = {}
        for rank, res in enumerate(results):
            r = res[name]
            assert r["writes_optimizer"] == (r["dp_cp_rank"] == 0), (name, rank)
            assert (r["tensors_from"] is None) == (r["dp_cp_rank"] == 0), (name, rank)
            writers.setdefault(r["writes_optimizer"], []).append(r["shard_bytes"])
        # fp32 weights 4 B/param vs weights + two Adam moments 12 B/param
        assert max(writers[False]) < 0.5 * min(writers[True]), (name, writers)


def test_gather_is_deferred_to_the_forward_pre_hook(results):
    for rank, res in enumerate(results):
        plain, ov = res["deferred"][False], res["deferred"][True]
        assert ov["buckets"] == 3, "one bucket per linear layer (the test relies on it)"
        assert plain["waits_in_step"] == plain["buckets"] and ov["waits_in_step"] == 0
        assert plain["first"] == [True, True] and plain["last"] == [True, True]
        # the next forward needs the first layer first: the gathers launch in forward order, the buckets' (laid out
        # in backward order) reversed, as Megatron's ("all-gathers happen in reverse order of buckets")
        assert ov["launch_order"] == plain["launch_order"] == [2, 1, 0], (rank, ov["launch_order"])
        assert ov["first"] == [False, True], rank   # stale after the step, current after its own pre-hook
        assert ov["last"] == [False, False], rank   # still stale: its layer has not run
        assert ov["into_model"] and plain["into_model"]
        assert ov["losses"] == plain["losses"]
        for a, b in zip(ov["params"], plain["params"], strict=True):
            assert torch.equal(a, b)
    for a, b in zip(results[0]["deferred"][True]["params"], results[3]["deferred"][True]["params"]):
        assert torch.equal(a, b), "replicas must hold the same parameters"


def test_in_place_all_gather(results):
    for dt in (torch.float32, torch.bfloat16):
        want = torch.cat([torch.randn(5, generator=torch.Generator().manual_seed(r)).to(dt) for r in range(4)])
        for res in results:
            assert torch.equal(res["in_place"][str(dt)], want)
    assert "pad the buffer to a multiple of the group size" in results[0]["in_place"]["error"]


def test_overlap_needs_the_distributed_optimizer():
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.parallel.data import DataParallelConfig

    with pytest.raises(ConfigError, match="add --use-distributed-optimizer"):
        DataParallelConfig(overlap_param_gather=True)
