"""The data-parallel and pipeline communication the speed model prices against the calls of a real training step
(``train_step`` on 2 ranks): the gradient buckets' all-reduce (or reduce-scatter + parameter all-gather with the
distributed optimizer) from :func:`omnitron.plan.speed.dp_collectives`, and under pp2 the stage-to-stage sends
(:func:`omnitron.plan.work.pp_message`, one per micro-batch each way) and the tied embedding's all-reduce.

Every priced call must be among the step's calls (same op, bytes and group size); what the model leaves out by
design (the loss, token count, grad-norm and stop-flag reductions) must be scalars of at most a few elements."""
from __future__ import annotations

import os
from collections import Counter

import pytest

from omnitron.testing.distributed import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SMALL = 64
"""Bytes: the unpriced step reductions are a handful of fp32 / int64 scalars."""
CASES = {
    "dp2": [],
    "dp2 distopt": ["--use-distributed-optimizer"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def _args(root: str, extra: list[str]) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
            "4", "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"), *extra]


def _recorded(root: str) -> dict:
    """{case: [(op, bytes, group size)] of one train_step}, on this rank (the second step: the first builds)."""
    import torch.distributed as dist

    from omnitron.backends.collectives import Collectives

    from tests.optim.test_distributed_optimizer import _Run
    from tests.plan.test_tp_volume import recording

    out = {}
    for name, extra in CASES.items():
        run = _Run(_args(root, extra))
        run.steps(1)
        orig = Collectives.batch_p2p

        def batch_p2p(self, ops, group=None):
            log.extend(("p2p", t.numel() * t.element_size(), 2) for kind, t, _ in ops if kind == "send")
            return orig(self, ops, group=group)

        Collectives.batch_p2p = batch_p2p
        try:
            with recording([], OPS, group_size=True) as log:
                run.steps(1)
        finally:
            Collectives.batch_p2p = orig
        out[name] = (dist.get_rank(), log, sum(1 for m in run.c.modules for _ in m.parameters()))
    return out


def _expected(root: str, extra: list[str], pp_rank: int) -> Counter:
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import work
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import dp_collectives
    from omnitron.plan.stage_layers import stage_layers

    s = parse_settings(_args(root, extra), 2)
    cfg, pc = model_config(s), s.parallel
    pp = pc.pipeline_model_parallel_size
    want = list(dp_collectives(s, cfg, pp_rank, stage_layers(s, cfg)[(pp_rank, 0)]))
    if pp > 1:
        x = work.local_shapes(cfg, 1, 1, s.training.micro_batch_size)
        want += [("p2p", work.pp_message(x, 4, False), 2)] * s.num_microbatches  # activations or their gradients
        want.append(("all_reduce", work.local_shapes(cfg, 1, 1, 1).vocab * cfg.hidden_size * 4, 2))  # tied
    return Counter(want)


def _aligned(want: Counter, have: Counter, tensors: int) -> Counter:
    """``want`` with each bucket's priced bytes replaced by the step's call of the same op and group that exceeds it
    by no more than the distributed optimizer's alignment: every parameter starts at a multiple of 64 elements (a
    gap under 64 before each of ``tensors`` tensors) and the bucket end, padded to lcm(2, 128) = 128, moves by less
    than 128 more; elements are at most 4 bytes (fp32) in these runs."""
    slack = (64 * tensors + 128) * 4
    out, pool = Counter(), Counter(have)
    for (op, n, g), k in want.items():
        for _ in range(k):
            fit = sorted(m for (o, m, h), c in pool.items() if c and o == op and h == g and n <= m <= n + slack)
            key = (op, fit[0], g) if fit and op in ("reduce_scatter", "all_gather") else (op, n, g)
            pool[key] -= 1
            out[key] += 1
    return out


def test_dp_and_pp_communication_match_a_real_step(tmp_path):
    got = run_distributed(_recorded, 2, str(tmp_path))
    for name, extra in CASES.items():
        for rank, log, tensors in (g[name] for g in got):
            pp_rank = rank if "--pipeline-model-parallel-size" in extra else 0
            want = _expected(str(tmp_path), extra, pp_rank)
            have = Counter(log)
            if "--use-distributed-optimizer" in extra:  # the plan prices elements, not the layout's alignment gaps
                want = _aligned(want, have, tensors)
            missing = want - have
            assert not missing, (name, rank, dict(missing), sorted(have))
            rest = have - want
            assert all(n <= SMALL for _, n, _ in rest.elements()), (name, rank, sorted(rest.elements()))
