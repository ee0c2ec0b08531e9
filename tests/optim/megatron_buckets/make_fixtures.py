"""Writes ``fixtures.json`` and ``distopt.json`` beside this file WITH MEGATRON-LM'S OWN CODE: how megatron-core cuts
a gradient buffer into buckets (``fixtures.json``: ``_compute_default_per_buffer_param_layout`` of
megatron/core/distributed/param_and_grad_buffer.py, the layout without the distributed optimizer's padding), for
random parameter sizes and bucket sizes; and (``distopt.json``) the distributed optimizer's layout and shards:
``DistributedOptimizer._compute_per_buffer_param_layout`` (64-element parameter starts, bucket ends padded to
lcm(dp, 128), the shared embedding in a bucket of its own) and, for every data-parallel rank, the ranges
``DistributedOptimizer._build_model_gbuf_range`` gives it, on random parameter sizes and on transformer shapes.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU, offline. Run from the
omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/optim/megatron_buckets/make_fixtures.py [rule]

(``rule``: rewrite ``rule.json`` only.) 
omnitron is not imported. ``fixtures.json``: each case stores the parameter sizes in registration (forward) order,
the bucket size, and Megatron's bucket ranges ``[start, end)`` and each parameter's ``(start, end, bucket)``. Half
of the bucket sizes are a running sum of the backward-ordered sizes, so a bucket reaches its size exactly (Megatron
closes a bucket at ``>=``). ``distopt.json``: each case stores the sizes (forward order), which of them is flagged
``shared_embedding``, the bucket size (null: one bucket), the data-parallel size, Megatron's bucket ranges with
their ``numel_unpadded``, each parameter's ``(start, end, bucket)``, and per rank per bucket the owned pieces
``[param, start, end, in-bucket start]`` (the param's ``param`` range and its ``gbuf_world_in_bucket`` start).
``rule.json``: Megatron's bucket-size rule (training.py's ``resolve_ddp_bucket_size``, then
``DistributedDataParallel.__init__`` run up to its buffers, with get_model's ``disable_bucketing`` for every chunk
after the first) for model chunks (virtual pipeline stages) of a pipeline rank, with and without
--overlap-grad-reduce, with and without --ddp-bucket-size, all-reduced and sharded: per chunk the bucket size
Megatron's DDP holds (null: one bucket) and the layout that size gives (the two layout functions above).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import types
import typing

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
CASES, SEED = 24, 20261207
DISTOPT_CASES = 36
RULE_CASES = 32


def main() -> None:
    import torch
    from megatron.core.distributed.param_and_grad_buffer import _compute_default_per_buffer_param_layout

    rng = np.random.RandomState(SEED)
    cases = []
    for k in range(CASES):
        sizes = [int(n) for n in rng.randint(1, 60, rng.randint(1, 13))]
        running = np.cumsum(sizes[::-1])
        bucket = int(running[rng.randint(len(running))]) if k % 2 == 0 else int(rng.randint(1, sum(sizes) + 20))
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        layout = _compute_default_per_buffer_param_layout(params, bucket)
        cases.append({"sizes": sizes, "bucket_size": bucket,
                      "buckets": [list(b) for b in layout.bucket_indices],
                      "params": [list(layout.param_index_map[p]) for p in params]})
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump({"megatron": "d98e8a64dd", "cases": cases}, f, indent=None)
        f.write("\n")


def _transformer(rng) -> tuple[list[int], int]:
    """A GPT (LayerNorm with biases, GELU MLP, learned positions) or a Llama (RMSNorm, SwiGLU, no biases) stage's
    parameter sizes in registration order, and the index of its word embedding."""
    h, layers, vocab = int(rng.choice([32, 48, 64, 96])), int(rng.randint(1, 4)), int(rng.choice([128, 200, 256]))
    gpt = bool(rng.randint(2))
    ffn = 4 * h if gpt else int(rng.choice([2, 3])) * h
    sizes = [vocab * h] + ([16 * h] if gpt else [])
    for _ in range(layers):
        norm = [h, h] if gpt else [h]
        qkv, proj = ([3 * h * h, 3 * h], [h * h, h]) if gpt else ([3 * h * h], [h * h])
        mlp = [h * ffn, ffn, ffn * h, h] if gpt else [h * 2 * ffn, ffn * h]
        sizes += norm + qkv + proj + norm + mlp
    return sizes + ([h, h] if gpt else [h]), 0


def _distopt_case(sizes, shared, bucket, dp) -> dict:
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    for i in shared:
        params[i].shared_embedding = True
    config = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=False)
    layout = DistributedOptimizer._compute_per_buffer_param_layout(params, bucket, dp, config)
    where = {id(p): i for i, p in enumerate(params)}
    ranks = []
    for r in range(dp):
        group = types.SimpleNamespace(rank=lambda r=r: r, size=lambda: dp)
        buckets = [types.SimpleNamespace(grad_data=torch.empty(hi - lo), offset=lo) for lo, hi in layout.bucket_indices]
        buffer = types.SimpleNamespace(data_parallel_group=group, num_optimizer_shards=dp, buckets=buckets,
                                       param_index_map=layout.param_index_map)
        owned = []
        for k in range(len(buckets)):
            got = DistributedOptimizer._build_model_gbuf_range(buffer, k)["param_map"]
            owned.append(sorted([where[id(p)], m["param"].start, m["param"].end, m["gbuf_world_in_bucket"].start]
                                for p, m in got.items()))
        ranks.append(owned)
    return {"sizes": sizes, "shared": list(shared), "bucket_size": bucket, "dp": dp,
            "buckets": [[lo, hi, u] for (lo, hi), u in zip(layout.bucket_indices, layout.per_bucket_numel_unpadded)],
            "params": [list(layout.param_index_map[p]) for p in params], "ranks": ranks}


def distopt() -> None:
    """``distopt.json``: random sizes (small, around 64 and past it), then transformer stages."""
    rng = np.random.RandomState(SEED + 1)
    cases = []
    for k in range(DISTOPT_CASES):
        if k < DISTOPT_CASES // 2:
            sizes = [int(n) for n in rng.choice([1, 63, 64, 65, 128, 200, 300], rng.randint(1, 10))]
            sizes = [n if rng.randint(3) else int(rng.randint(1, 700)) for n in sizes]
            emb = int(rng.choice([0, len(sizes) - 1]))
        else:
            sizes, emb = _transformer(rng)
        shared = [emb] if len(sizes) > 1 and rng.randint(3) == 0 else []
        running = np.cumsum(sizes[::-1])
        bucket = [None, int(running[rng.randint(len(running))]), int(rng.randint(1, sum(sizes) + 200))][k % 3]
        cases.append(_distopt_case(sizes, shared, bucket, int(rng.choice([1, 2, 3, 4, 5, 8, 16]))))
    with open(os.path.join(HERE, "distopt.json"), "w") as f:
        json.dump({"megatron": "d98e8a64dd", "cases": cases}, f, indent=None)
        f.write("\n")


class _Stop(Exception):
    """Raised where Megatron's DDP constructor starts building buffers: its bucket size is decided by then."""


def _ddp_bucket_size(ddp_config, dp: int, pp_rank: int, disable: bool):
    """The ``bucket_size`` megatron-core's ``DistributedDataParallel.__init__`` keeps for a chunk (process groups
    stubbed: ``dp`` replicas, pipeline rank ``pp_rank``), stopped before its buffers are built."""
    import torch
    from megatron.core.distributed import distributed_data_parallel as ddp
    from megatron.core.process_groups_config import ProcessGroupCollection

    def group(rank, size):
        return types.SimpleNamespace(rank=lambda: rank, size=lambda: size)

    groups = {k: group(0, dp) for k in ("dp_group", "dp_cp_group", "intra_dp_cp_group", "expt_dp_group",
                                         "intra_expt_dp_group")}
    groups.update(tp_group=group(0, 1), pp_group=group(pp_rank, pp_rank + 1), ep_group=group(0, 1))

    def stop(*_a, **_k):
        raise _Stop

    saved = (ProcessGroupCollection.__dict__["setup_process_groups_for_ddp"], ddp.group_params_for_buffers)
    ProcessGroupCollection.setup_process_groups_for_ddp = staticmethod(lambda *_a: groups)
    ddp.group_params_for_buffers = stop
    self = ddp.DistributedDataParallel.__new__(ddp.DistributedDataParallel)
    try:
        ddp.DistributedDataParallel.__init__(self, types.SimpleNamespace(), ddp_config, torch.nn.Linear(1, 1),
                                             disable_bucketing=disable)
    except _Stop:
        pass
    finally:
        ProcessGroupCollection.setup_process_groups_for_ddp, ddp.group_params_for_buffers = saved
    return self.bucket_size


def rule() -> None:
    """``rule.json``: Megatron's per-chunk bucket size and layout (see the module docstring)."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import _compute_default_per_buffer_param_layout
    from megatron.training.training import resolve_ddp_bucket_size

    logging.getLogger("megatron").setLevel(logging.WARNING)
    if not dist.is_initialized():  # get_pg_size reads a group's size only once torch.distributed is up
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rng = np.random.RandomState(SEED + 2)
    cases = []
    for k in range(RULE_CASES):
        dp, pp_rank, vp = int(rng.choice([1, 2, 4])), int(rng.choice([0, 0, 0, 1, 3])), int(rng.choice([1, 2, 3]))
        overlap, sharded = bool(k % 2), bool(k // 2 % 2)
        chunks = [[int(n) for n in rng.randint(1, 300, rng.randint(2, 9))] for _ in range(vp)]
        flag = int(rng.randint(1, 400)) if k % 8 < 6 else None  # --ddp-bucket-size (None: Megatron's default)
        config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, bucket_size=flag,
                                               use_distributed_optimizer=sharded)
        group = types.SimpleNamespace(rank=lambda: 0, size=lambda dp=dp: dp)
        config.bucket_size = resolve_ddp_bucket_size(config, group, overlap, sum(map(sum, chunks)))
        out = []
        for c, sizes in enumerate(chunks):  # get_model: disable_bucketing for every chunk after the first
            bucket = _ddp_bucket_size(dataclasses.replace(config), dp, pp_rank, disable=c > 0)
            if sharded:
                lay = _distopt_case(sizes, [], bucket, dp)
                out.append({"bucket_size": bucket, "buckets": lay["buckets"], "params": lay["params"]})
            else:
                params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
                lay = _compute_default_per_buffer_param_layout(params, bucket)
                out.append({"bucket_size": bucket, "buckets": [list(b) for b in lay.bucket_indices],
                            "params": [list(lay.param_index_map[p]) for p in params]})
        cases.append({"dp": dp, "pp_rank": pp_rank, "overlap_grad_reduce": overlap, "ddp_bucket_size": flag,
                      "use_distributed_optimizer": sharded, "chunks": chunks, "megatron": out})
    with open(os.path.join(HERE, "rule.json"), "w") as f:
        json.dump({"megatron": "d98e8a64dd", "cases": cases}, f, indent=None)
        f.write("\n")


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("MEGATRON_LM", "/tmp/megatron"))
    if sys.argv[1:] != ["rule"]:
        main()
        distopt()
    rule()
