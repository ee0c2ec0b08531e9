"""The gradient buffer's bucket layout against megatron-core's, on fixtures written by Megatron's own code
(tests/optim/megatron_buckets/make_fixtures.py, which says how to re-run it).

All-reduced (``fixtures.json``, Megatron's ``_compute_default_per_buffer_param_layout``): the same parameters in
the same buckets at the same offsets, a bucket closed as soon as it holds at least ``--ddp-bucket-size`` elements,
nothing padded. Sharded for the distributed optimizer (``distopt.json``, ``DistributedOptimizer.
_compute_per_buffer_param_layout`` and ``_build_model_gbuf_range``): every parameter at Megatron's 64-aligned
offset, every bucket at Megatron's range (ends padded to lcm(dp, 128)) with its ``numel_unpadded``, the shared
embedding in a bucket of its own, and every data-parallel rank owning exactly the pieces of exactly the parameters
Megatron's rank owns, at the same offsets in the bucket -- on random sizes and on GPT / Llama stage shapes, for
dp 1 to 16 and bucket sizes of one bucket, a running sum of the sizes (a bucket filled exactly) and random."""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

from omnitron.core.optim.distributed import _plan_buffer
from omnitron.core.parallel.data.buffers import GradBuffer

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_buckets")
with open(os.path.join(HERE, "fixtures.json")) as f:
    CASES = json.load(f)["cases"]
with open(os.path.join(HERE, "distopt.json")) as f:
    DISTOPT = json.load(f)["cases"]


def _buffer(sizes: list[int], bucket: int | None, shards: int, shared=(), sharded=True):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    isolate = frozenset(id(params[i]) for i in shared)
    return params, GradBuffer(params[::-1], torch.float32, bucket, shards, isolate, sharded=sharded)  # backward order


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_buckets_are_megatrons(case):
    params, buf = _buffer(case["sizes"], case["bucket_size"], 2, sharded=False)  # all-reduce: no padding at any dp
    assert [[b.offset, b.offset + b.data.numel()] for b in buf.buckets] == case["buckets"]
    assert buf.data.numel() == case["buckets"][-1][1]
    for p, (start, end, bucket) in zip(params, case["params"]):
        assert buf.param_range(p) == (start, end - start)
        assert buf.bucket_of[id(p)] is buf.buckets[bucket]


@pytest.mark.parametrize("case", DISTOPT, ids=[f"distopt{i}" for i in range(len(DISTOPT))])
def test_distributed_optimizer_layout_and_shards_are_megatrons(case):
    params, buf = _buffer(case["sizes"], case["bucket_size"], case["dp"], case["shared"])
    assert [[b.offset, b.offset + b.data.numel(), b.numel_unpadded] for b in buf.buckets] == case["buckets"]
    assert buf.data.numel() == case["buckets"][-1][1]
    for p, (start, end, bucket) in zip(params, case["params"]):
        assert buf.param_range(p) == (start, end - start)
        assert buf.bucket_of[id(p)] is buf.buckets[bucket]
    buf.allocate_param_buffer()
    index = {id(p): i for i, p in enumerate(params)}
    for rank, want in enumerate(case["ranks"]):
        slices, plans = [], []
        _plan_buffer(buf, types.SimpleNamespace(rank=rank, size=case["dp"], name="dp_cp"), params, index, slices,
                     plans, 0, False)
        got = [sorted([slices[j].param, slices[j].lo, slices[j].hi, off] for j, off in plan.slices) for plan in plans]
        assert got == want, rank


with open(os.path.join(HERE, "rule.json")) as f:
    RULE = json.load(f)["cases"]


class _Group:
    """A replica group of ``size`` ranks seen from its rank 0 (the layout does not depend on the rank)."""

    def __init__(self, size: int) -> None:
        self.size, self.rank, self.handle = size, 0, None

    def global_rank(self, r: int) -> int:
        return r


@pytest.mark.parametrize("case", RULE, ids=[f"rule{i}" for i in range(len(RULE))])
def test_bucket_size_rule_is_megatrons(case):
    """Megatron's bucket-size rule (``rule.json``: training.py's resolve_ddp_bucket_size and DDP's constructor with
    get_model's disable_bucketing): buckets of --ddp-bucket-size (default max(40M, 1M x dp)) only with
    --overlap-grad-reduce, only in the first model chunk of the first pipeline stage; one bucket per buffer
    otherwise. The wrappers :func:`wrap_data_parallel` builds for a pipeline rank's chunks hold Megatron's
    buckets and offsets, chunk by chunk."""
    from omnitron.core.parallel.data.config import DataParallelConfig
    from omnitron.core.training.components import wrap_data_parallel

    dp = case["dp"]
    ddp = DataParallelConfig(overlap_grad_reduce=case["overlap_grad_reduce"], bucket_size=case["ddp_bucket_size"],
                             use_distributed_optimizer=case["use_distributed_optimizer"])
    groups = types.SimpleNamespace(dp_cp=_Group(dp), edp=_Group(dp), pp=types.SimpleNamespace(
        rank=case["pp_rank"], size=case["pp_rank"] + 1), collectives=types.SimpleNamespace(broadcast=lambda *a, **k: None))
    chunks = [torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in sizes]) for sizes in case["chunks"]]
    wrapped = wrap_data_parallel(chunks, types.SimpleNamespace(ddp=ddp), groups, None)
    for c, (chunk, ddp_chunk, want) in enumerate(zip(chunks, wrapped, case["megatron"])):
        (buf,) = ddp_chunk.buffers
        got = [[b.offset, b.offset + b.data.numel()] + ([b.numel_unpadded] if ddp.use_distributed_optimizer else [])
               for b in buf.buckets]
        assert got == want["buckets"], (c, want["bucket_size"])
        for p, (start, end, bucket) in zip(chunk, want["params"]):
            assert buf.param_range(p) == (start, end - start)
            assert buf.bucket_of[id(p)] is buf.buckets[bucket]
