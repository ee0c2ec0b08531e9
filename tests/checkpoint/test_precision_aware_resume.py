"""Adam moments below fp32 (--use-precision-aware-optimizer --exp-avg-dtype / --exp-avg-sq-dtype) through
torch_dist checkpoints: S trains 2 iterations at dp2 (bf16, distributed optimizer), saving at both; R loads S's
iteration 1 at dp1 and saves at once (resharded dp2 -> dp1). Reference: S's own checkpoints, read back whole by
``read_full_state``.

* bf16 moments: saved in bf16; T resumes S's iteration 1 at dp2 and trains iteration 2: its checkpoint equals S's
  bit for bit (weights, masters, moments); R's equals S's iteration 1 bit for bit.
* fp16 moments: saved unscaled in fp32 (Transformer Engine's state_dict); loading scales each owned slice afresh
  (TE's set_scaled_state), so R's moments are S's rounded through that: within the bound derived below.
"""
from __future__ import annotations

import os

import torch

from omnitron.testing.distributed import run_distributed
from test_dist_reshard import _args  # its model, data and schedule

AWARE = ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer"]


def _flags(dtype: str) -> list[str]:
    return [*AWARE, "--exp-avg-dtype", dtype, "--exp-avg-sq-dtype", dtype]


def _remainders_worker(root):
    """S: fp32 moments, masters as remainders (--use-precision-aware-optimizer under --bf16), 2 iterations at dp2;
    U: the same run without the flag (fp32 masters) resumes S's iteration 1 and trains iteration 2."""
    import shutil

    import torch.distributed as dist

    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    s = run(AWARE, "S")
    assert any(r is not None for r in s["components"].optimizer.remainders)
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(root, "S", "iter_0000001"), os.path.join(root, "S1", "iter_0000001"))
    dist.barrier()
    u = run(["--bf16", "--use-distributed-optimizer"], "U", "--load", os.path.join(root, "S1"))
    assert all(r is None for r in u["components"].optimizer.remainders)


def test_remainder_masters_save_fp32_and_load_into_fp32_masters(tmp_path):
    """The checkpoint holds fp32 masters; a run keeping fp32 masters resumes it and its iteration 2 masters and
    moments equal S's bit for bit (the remainder step is the fp32-master step exactly). The weights: S's are the
    masters rounded ties away from zero (TE's split), U's rounded to nearest even, so they may differ only where
    the master's low half is exactly 0x8000."""
    root = str(tmp_path)
    run_distributed(_remainders_worker, 2, root, timeout_s=600)
    s2, u2 = _state(root, "S", 2), _state(root, "U", 2)
    assert s2.optimizer.keys() == u2.optimizer.keys()
    for kind in s2.optimizer:
        for name, t in s2.optimizer[kind].items():
            assert t.dtype == torch.float32 and torch.equal(t, u2.optimizer[kind][name]), (kind, name)
    for name, w in s2.model.items():
        master = s2.optimizer["master"].get(name)
        if master is None:
            continue
        tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
        assert torch.equal(u2.model[name], master.bfloat16()), name
        assert torch.equal(w[~tie], u2.model[name][~tie]), name


def _worker(root, stage, dtype):
    import shutil

    import torch.distributed as dist

    from omnitron.core.training import checkpointing
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    if stage == "dp2":
        run(_flags(dtype), "S")
        if dist.get_rank() == 0:  # a --load directory holding only iteration 1
            shutil.copytree(os.path.join(root, "S", "iter_0000001"), os.path.join(root, "S1", "iter_0000001"))
        dist.barrier()
        if dtype == "bf16":
            run(_flags(dtype), "T", "--load", os.path.join(root, "S1"))
    else:
        r = run(_flags(dtype), "R", "--load", os.path.join(root, "S1"), "--train-iters", "1")
        checkpointing.save(r["components"])


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
    run_distributed(_worker, 2, root, "dp2", "bf16", timeout_s=600)
    run_distributed(_worker, 1, root, "dp1", "bf16", timeout_s=600)
    s1, s2 = _state(root, "S", 1), _state(root, "S", 2)
    for kind in ("exp_avg", "exp_avg_sq"):
        assert {t.dtype for t in s1.optimizer[kind].values()} == {torch.bfloat16}, kind
    assert {t.dtype for t in s1.optimizer["master"].values()} == {torch.float32}
    _same(s2, _state(root, "T", 2))
    _same(s1, _state(root, "R", 1))


def test_fp16_moments_reshard_within_te_rescaling(tmp_path):
    root = str(tmp_path)
    run_distributed(_worker, 2, root, "dp2", "fp16", timeout_s=600)
    run_distributed(_worker, 1, root, "dp1", "fp16", timeout_s=600)
    s1, r1 = _state(root, "S", 1), _state(root, "R", 1)
    for name in s1.model:
        assert torch.equal(s1.model[name], r1.model[name]) and torch.equal(s1.optimizer["master"][name],
                                                                           r1.optimizer["master"][name]), name
    for kind in ("exp_avg", "exp_avg_sq"):
        for name, x in s1.optimizer[kind].items():
            assert x.dtype == torch.float32, (kind, name)
            x, y = x.double(), r1.optimizer[kind][name].double()
            # R's slice is the whole parameter (dp1): scale = fp32(absmax / 32752) (1 rounding); the value times
            # fp32(1 / scale) (2 roundings: 2 U32 relative), rounded to fp16 (2^-11 relative, or half the
            # subnormal step, 2^-25 in scaled units: 2^-25 * scale), read back times scale (1 rounding)
            scale = x.abs().max() / 32752 * (1 + 2.0 ** -23)
            bound = (2.0 ** -11 + 4 * 2.0 ** -24) * x.abs() + 2.0 ** -25 * scale
            assert ((y - x).abs() <= bound).all(), (kind, name, float(((y - x).abs() / bound).max()))
