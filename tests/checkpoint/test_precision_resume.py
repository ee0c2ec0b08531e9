"""Resuming with the optimizer state where the saving run and the resuming run keep their fp32 masters apart
differently: a precision change (fp32 weights are their own masters; bf16 weights have fp32 masters beside them)
and FSDP2 (its sharded fp32 parameters are the masters) against the distributed optimizer, 2 gloo ranks.

Each case trains 2 iterations uninterrupted as S, saving at both; then T loads S's iteration 1 and saves at once
(no step), and T trains iteration 2 from it. Reference: S's own checkpoints, read back by ``read_full_state`` (one
process). Asserted:

* the state T loaded holds S's fp32 masters (S's ``master`` tensors where it kept them, else its fp32 weights)
  as T's fp32 weights or masters bit for bit, S's Adam moments bit for bit, the step, the scheduler, the
  iteration and the consumed samples; a bf16 weight T holds is its master rounded (``.to(bfloat16)``, as the
  optimizer writes it);
* FSDP2 <-> distributed optimizer in bf16: iteration 2's loss, a forward from the loaded state (the same bf16
  weights, the masters rounded), as S's within test_dist_reshard's LOSS_RTOL (only the order of the sums differs,
  as there). The weights after that step are not compared: the two compute the bf16 run's gradients apart at
  bf16's rounding (2^-8 relative; uninterrupted runs' Adam moments already differ by ~1% after one step), which
  Adam's early steps pass on at O(1) to elements whose gradient is that small: no bound tighter than a wrong
  resume's error follows from it.

Before the fix a torch_dist resume across the two refused (no ``optim/master`` saved), or took the saved bf16
weights for the fp32 masters (up to 2^-9 relative in each weight: 1.1e-3 of the weights' norm, ~4% of a step's
update, in a 2-layer probe); the torch format's same-layout resume of fp32 weights into bf16 kept the masters of
the run's own initialisation (the first step copied them back into the model); its resharded resume rounded the
fp32 weights to bf16.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from test_dist_reshard import LOSS_RTOL, _args  # its model, data and schedule

BF16, ZERO, FSDP2 = ["--bf16"], ["--use-distributed-optimizer"], ["--use-torch-fsdp2"]
TORCH = ["--ckpt-format", "torch"]
CASES = {  # name: (S, T), both at world 2
    "fp32_to_bf16": ([], BF16),
    "bf16_to_fp32_zero": ([*BF16, *ZERO], ZERO),
    "fsdp2_to_zero_bf16": ([*BF16, *FSDP2], [*BF16, *ZERO]),
    "zero_to_fsdp2_bf16": ([*BF16, *ZERO], [*BF16, *FSDP2]),
    "torch_fp32_to_bf16": (TORCH, [*TORCH, *BF16]),  # same layout: the rank files' own optimizer entries
    "torch_bf16_tp2_to_fp32_dp2": ([*TORCH, *BF16, "--tensor-model-parallel-size", "2"], TORCH),  # resharded
}
SAME_FORWARD = ("fsdp2_to_zero_bf16", "zero_to_fsdp2_bf16")  # S's and T's forward agree: iteration 2's loss


def _worker(root, cases):
    import shutil

    import torch.distributed as dist

    from omnitron.core.training import checkpointing
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    out = {}
    for name, (src, dst) in cases.items():
        out["S_" + name] = run(src, "S_" + name)["losses"]
        if dist.get_rank() == 0:  # a --load directory holding only iteration 1
            shutil.copytree(os.path.join(root, "S_" + name, "iter_0000001"),
                            os.path.join(root, "S1_" + name, "iter_0000001"))
        dist.barrier()
        ck = os.path.join(root, "S1_" + name)
        checkpointing.save(run(dst, "L_" + name, "--load", ck, "--train-iters", "1")["components"])
        out["T_" + name] = run(dst, "T_" + name, "--load", ck)["losses"]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision_resume")
    return root, run_distributed(_worker, 2, str(root), CASES, timeout_s=900)[0]


def _fp32(state) -> dict[str, torch.Tensor]:
    """A full state's fp32 masters by name: its ``master`` tensors, else its (fp32) weights."""
    out = dict(state.model)
    out.update(state.optimizer.get("master", {}))
    assert all(t.dtype == torch.float32 for t in out.values())
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_keeps_the_fp32_masters(results, name):
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.reshard import read_full_state

    root, res = results
    s1 = read_full_state(str(root / ("S_" + name) / "iter_0000001"))
    loaded = read_full_state(find_latest(str(root / ("L_" + name))))
    want, got = _fp32(s1), _fp32(loaded)
    assert sorted(got) == sorted(want) and sorted(s1.optimizer["exp_avg"])
    for n, t in want.items():
        assert torch.equal(got[n], t), (name, n, float((got[n] - t).abs().max()))
        w = loaded.model[n]
        assert torch.equal(w, t.to(w.dtype)), (name, n)  # a bf16 weight: its master rounded
    for kind in ("exp_avg", "exp_avg_sq"):
        assert sorted(loaded.optimizer[kind]) == sorted(s1.optimizer[kind])
        for n, t in s1.optimizer[kind].items():
            assert torch.equal(loaded.optimizer[kind][n], t), (name, kind, n)
    assert loaded.optimizer_meta["step"] == s1.optimizer_meta["step"] == 1
    assert loaded.scheduler == s1.scheduler
    assert (loaded.meta["iteration"], loaded.meta["consumed_samples"]) == (1, 8)
    want_losses, got_losses = res["S_" + name], res["T_" + name]
    assert sorted(want_losses) == [1, 2] and sorted(got_losses) == [2], (name, want_losses, got_losses)
    if name in SAME_FORWARD:
        assert abs(got_losses[2] - want_losses[2]) <= LOSS_RTOL * abs(want_losses[2]), (name, got_losses, want_losses)
    assert read_full_state(find_latest(str(root / ("T_" + name)))).optimizer_meta["step"] == 2
