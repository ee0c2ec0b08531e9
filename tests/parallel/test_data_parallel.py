"""Data-parallel wrapper on 2 gloo processes against a float64 single-process reference; the order in which it
issues expert and dense bucket reductions, against stand-in groups in one process."""
import contextlib

import pytest
import torch

from omnitron.core.config import ConfigError, ParallelConfig
from omnitron.core.parallel.data import DataParallelConfig, num_microbatches
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

M = 3
# The float64 cases against the float64 reference (u = 2**-53 = 1.1e-16): the same gradient summed in another order.
# An entry sums 2 ranks x M micro-batches x 4 samples = 24 products of <= 16-term contractions (tanh's derivative
# included): reordering n <= 40 terms moves it by <= 40 u = 4.4e-15 times the sum of the terms' magnitudes (<= ~1
# here: inputs and weights O(1)), so F64_TOL's atol 1e-13 leaves a factor 20 over the worst case where an entry
# cancels to ~0, and its rtol 1e-12 more elsewhere. A float32 run needed 1e-5; a bucket scaled by 1 +- 1e-6 (a
# wrong 1 / dp, a micro-batch counted with the wrong weight) or reduced in float32 fails here.
F64_TOL = dict(rtol=1e-12, atol=1e-13)


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def _batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 + 10 * rank + i)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


CASES = {  # name: (overlap, fp32 accumulation, reduce-scatter, dtype)
    "sync": (False, False, False, torch.float64),
    "overlap": (True, False, False, torch.float64),
    "overlap_rs": (True, False, True, torch.float64),
    "bf16_fp32acc": (True, True, False, torch.bfloat16),
    "bf16_bf16acc": (True, False, False, torch.bfloat16),  # --bf16 --grad-reduce-in-bf16: bf16 buffers and sums
}


def ddp_worker() -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.data import DistributedDataParallel
    from omnitron.core.parallel.groups import ParallelGroups

    from omnitron.core.parallel.tensor.sharding import to_device

    be = get_backend()
    groups, dev = ParallelGroups.build(ParallelConfig(), backend=be), be.device()
    rank, out = groups.dp.rank, {}
    for name, (overlap, fp32, rs, dtype) in CASES.items():
        model = to_device(_model(dtype), dev)
        with torch.no_grad():  # replicas disagree until DDP broadcasts rank 0's weights
            for p in model.parameters():
                p.add_(rank)
        ddp = DistributedDataParallel(model, groups, DataParallelConfig(
            overlap_grad_reduce=overlap, accumulate_allreduce_grads_in_fp32=fp32, reduce_scatter=rs, bucket_size=200))
        launched_early = []
        for step in range(2):  # the second step checks zero_grad_buffer resets everything
            ddp.zero_grad_buffer()
            for i in range(M):
                x, y = (t.to(dev) for t in _batch(rank, i))
                ctx = ddp.no_sync() if i < M - 1 else contextlib.nullcontext()
                with ctx:
                    wide = torch.float64 if dtype == torch.float64 else torch.float32  # the loss's dtype
                    loss = ((ddp(x.to(dtype)).to(wide) - y.to(wide)) ** 2).mean() / M
                    loss.backward()
                launched_early.append([b.launched for b in ddp.buckets])
            ddp.finish_grad_sync()
        rec = {"params": [p.detach().double().clone() for p in model.parameters()],
               "grads": [p.main_grad.clone() for p in model.parameters()],
               "grad_dtype": model[0].weight.main_grad.dtype, "launched": launched_early,
               "bucket_sizes": [b.data.numel() for b in ddp.buckets],
               "contiguous": all(p.main_grad.untyped_storage().data_ptr() == ddp.buffers[0].data.untyped_storage()
                                 .data_ptr() for p in model.parameters())}
        if rs:
            rec["shards"] = [b.shard(rank).clone() for b in ddp.buckets]
            ids = [id(p) for p in model.parameters()]
            rec["bucket_params"] = [[(ids.index(id(p)), ddp.buffers[0].param_range(p)[0] - b.offset) for p in b.params]
                                    for b in ddp.buckets]  # (parameter, offset in its bucket: 64-aligned)
        out[name] = rec
    return out


def _reference(dtype):
    """float64 grads of the mean loss over both ranks' micro-batches (rank 0's initial weights)."""
    model = _model(dtype).double()
    for r in range(2):
        for i in range(M):
            x, y = _batch(r, i)
            (((model(x.double()) - y.double()) ** 2).mean() / M / 2).backward()
    return [p.grad for p in model.parameters()], [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=[requires_sim(), pytest.mark.slow])])
def test_ddp_buckets_overlap_and_reduction_match_reference(backend):
    results = run_distributed(ddp_worker, 2, backend=backend)
    for name, (overlap, fp32, rs, dtype) in CASES.items():
        ref_grads, ref_params = _reference(dtype)
        tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else F64_TOL
        for rank, res in enumerate(results):
            rec = res[name]
            for p, w in zip(rec["params"], ref_params):  # broadcast from dp rank 0
                torch.testing.assert_close(p.double(), w, rtol=0, atol=0)
            # Megatron's rule: buckets of --ddp-bucket-size with --overlap-grad-reduce, else one bucket
            assert rec["contiguous"] and (len(rec["bucket_sizes"]) > 1 if overlap else len(rec["bucket_sizes"]) == 1), \
                (name, rec["bucket_sizes"])
            if rs:  # Megatron's distributed-optimizer layout: buckets end at multiples of lcm(dp, 128)
                assert all(n % 128 == 0 for n in rec["bucket_sizes"]), rec["bucket_sizes"]
            else:  # all-reduced: nothing padded
                assert sum(rec["bucket_sizes"]) == sum(p.numel() for p in rec["params"]), rec["bucket_sizes"]
            assert rec["grad_dtype"] == (torch.float32 if fp32 else dtype)
            for step in range(2):
                early = rec["launched"][step * M:(step + 1) * M]
                assert not any(any(x) for x in early[:-1]), f"{name}: reduction started before the last micro-batch"
                # with overlap every bucket is already in flight when backward returns; without, none is
                assert all(early[-1]) if overlap else not any(early[-1]), name
            if rs:
                for idx, shard in zip(rec["bucket_params"], rec["shards"]):
                    full = torch.zeros(2 * shard.numel(), dtype=shard.dtype)  # alignment gaps and end padding: 0
                    for i, off in idx:
                        full[off:off + ref_grads[i].numel()] = ref_grads[i].flatten()
                    torch.testing.assert_close(shard, full[rank * shard.numel():(rank + 1) * shard.numel()], **tol)
            else:
                for g, ref in zip(rec["grads"], ref_grads):
                    torch.testing.assert_close(g.double(), ref, **tol)


def test_num_microbatches_arithmetic():
    assert num_microbatches(64, 2, 4) == 8
    assert num_microbatches(8, 8, 1) == 1
    with pytest.raises(ConfigError, match=r"multiple of --micro-batch-size \(3\) x data-parallel size \(2\) = 6"):
        num_microbatches(64, 3, 2)
    with pytest.raises(ConfigError, match="--micro-batch-size must be a positive"):
        num_microbatches(64, 0, 2)
    with pytest.raises(ConfigError, match="--ddp-bucket-size"):
        DataParallelConfig(bucket_size=0)


class _Group:
    """A stand-in replica group of two ranks (this one rank 0), named for the record."""

    def __init__(self, name: str) -> None:
        self.name, self.size, self.rank, self.handle = name, 2, 0, name

    def global_rank(self, r: int) -> int:
        return r


class _Recorder:
    """Collectives that record ``(group, when)`` of each reduction; ``when`` is set by the test."""

    def __init__(self) -> None:
        self.calls, self.when = [], "backward"

    def all_reduce(self, tensor, group=None, async_op=False):
        self.calls.append((group, self.when))
        return _Done()

    def broadcast(self, tensor, src=0, group=None):
        pass


class _Done:
    def wait(self) -> None:
        pass


def test_expert_buckets_are_reduced_in_finish_grad_sync_only():
    """NCCL rule: every rank issues its collectives in one order. An expert that got no token on this rank has no
    gradient (its hooks never fire) while its edp peers' copies do, so an expert bucket launched from the hooks
    would start in backward on some ranks and in finish_grad_sync on others: expert buckets start in
    finish_grad_sync, dense ones from the hooks (overlapped). Here every parameter gets a gradient, so a wrapper
    launching ready expert buckets early shows it."""
    from types import SimpleNamespace

    from omnitron.core.parallel.data import DistributedDataParallel

    model = _model()
    for p in model[2].parameters():  # the middle layer plays the experts
        p.expert = True
    coll = _Recorder()
    groups = SimpleNamespace(dp_cp=_Group("dp_cp"), edp=_Group("edp"), collectives=coll)
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(overlap_grad_reduce=True, bucket_size=10))
    x, y = _batch(0, 0)
    ((ddp(x) - y) ** 2).mean().backward()
    coll.when = "finish"
    ddp.finish_grad_sync()
    dense, expert = (sum(1 for b in ddp.buckets if ddp._group_of[id(b)].name == n) for n in ("dp_cp", "edp"))
    assert expert >= 2 and dense >= 2, (dense, expert)  # several buckets of each kind (a bucket per tensor)
    assert [c for c in coll.calls if c[0] == "edp"] == [("edp", "finish")] * expert, coll.calls
    assert [c for c in coll.calls if c[0] == "dp_cp"] == [("dp_cp", "backward")] * dense, coll.calls
