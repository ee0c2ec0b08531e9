"""bf16 Adam moments (--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16) through
torch_dist checkpoints: S trains 2 iterations at dp2 (bf16, distributed optimizer), saving at both. T resumes S's
iteration 1 at dp2 and trains iteration 2: its checkpoint equals S's bit for bit (weights, masters, moments). R
loads S's iteration 1 at dp1 and saves at once: the moments come back in bf16, bit for bit (resharded dp2 -> dp1).
Reference: S's own checkpoints, read back whole by ``read_full_state``."""
from __future__ import annotations

import os

import torch

from omnitron.testing.distributed import run_distributed
from test_dist_reshard import _args  # its model, data and schedule

AWARE = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
         "--exp-avg-sq-dtype", "bf16"]


def _worker(root, stage):
    import shutil

    import torch.distributed as dist

    from omnitron.core.training import checkpointing
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    if stage == "dp2":
        run(AWARE, "S")
        if dist.get_rank() == 0:  # a --load directory holding only iteration 1
            shutil.copytree(os.path.join(root, "S", "iter_0000001"), os.path.join(root, "S1", "iter_0000001"))
        dist.barrier()
        run(AWARE, "T", "--load", os.path.join(root, "S1"))
    else:
        checkpointing.save(run(AWARE, "R", "--load", os.path.join(root, "S1"), "--train-iters", "1")["components"])


def _state(root, run, it):
    from omnitron.core.checkpoint.reshard import read_full_state

    return read_full_state(os.path.join(root, run, f"iter_{it:07d}"))


def _same(a, b):
    assert a.model.keys() == b.model.keys() and a.optimizer.keys() == b.optimizer.keys()
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
    for kind in a.optimizer:
        for name, t in a.optimizer[kind].items():
            u = b.optimizer[kind][name]
            assert t.dtype == u.dtype and torch.equal(t, u), (kind, name)


def test_bf16_moments_resume_and_reshard(tmp_path):
    root = str(tmp_path)
    run_distributed(_worker, 2, root, "dp2", timeout_s=600)
    run_distributed(_worker, 1, root, "dp1", timeout_s=600)
    s1, s2 = _state(root, "S", 1), _state(root, "S", 2)
    for kind in ("exp_avg", "exp_avg_sq"):
        assert {t.dtype for t in s1.optimizer[kind].values()} == {torch.bfloat16}, kind
    assert {t.dtype for t in s1.optimizer["master"].values()} == {torch.float32}
    _same(s2, _state(root, "T", 2))
    _same(s1, _state(root, "R", 1))
