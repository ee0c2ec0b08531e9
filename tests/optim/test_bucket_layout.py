"""The gradient buffer's bucket layout against megatron-core's (fixtures written by Megatron's own
``_compute_default_per_buffer_param_layout``: tests/optim/megatron_buckets/make_fixtures.py, which says how to re-run
it): the same parameters in the same buckets at the same offsets, a bucket closed as soon as it holds at least
``--ddp-bucket-size`` elements. Cut into shards (the distributed optimizer's layout) every bucket keeps Megatron's
parameters and is padded at its end to the next multiple of the shard count (derived by hand: omnitron pads bucket
ends only, not Megatron's 64-element parameter starts, so those offsets are not Megatron's)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from omnitron.core.parallel.data.buffers import GradBuffer

with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_buckets", "fixtures.json")) as f:
    CASES = json.load(f)["cases"]


def _buffer(case: dict, shards: int) -> tuple[list[torch.nn.Parameter], GradBuffer]:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in case["sizes"]]
    return params, GradBuffer(params[::-1], torch.float64, case["bucket_size"], shards)  # backward order


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_buckets_are_megatrons(case):
    params, buf = _buffer(case, 1)
    assert [[b.offset, b.offset + b.data.numel()] for b in buf.buckets] == case["buckets"]
    for p, (start, end, bucket) in zip(params, case["params"]):
        assert buf.param_range(p) == (start, end - start)
        assert buf.bucket_of[id(p)] is buf.buckets[bucket]


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_sharded_buckets_keep_megatrons_parameters_and_pad_their_ends(shards):
    for case in CASES:
        params, buf = _buffer(case, shards)
        assert len(buf.buckets) == len(case["buckets"])
        offset = 0
        for k, (b, (lo, hi)) in enumerate(zip(buf.buckets, case["buckets"])):
            members = {id(p) for p, (_, _, bucket) in zip(params, case["params"]) if bucket == k}
            assert {id(p) for p in b.params} == members
            assert b.offset == offset and b.data.numel() == -(-(hi - lo) // shards) * shards
            for p in b.params:  # the parameters keep Megatron's places relative to their bucket's start
                start, _, _ = case["params"][next(i for i, q in enumerate(params) if q is p)]
                assert buf.param_range(p)[0] - b.offset == start - lo
            offset += b.data.numel()
        assert buf.data.numel() == offset
