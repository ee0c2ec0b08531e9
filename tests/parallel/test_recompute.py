"""omnitron's activation checkpoint (``tensor/recompute.py``) checks what torch's non-reentrant checkpoint checks.

A saved tensor read twice in one backward pass is an error (it would rerun the layer, collectives and RNG replay
included, unseen), as in torch; a new graph task (a second ``retain_graph`` backward) reruns, as in torch; a
rerun that saves a tensor of another shape or dtype than the forward did is a one-line error naming it. torch's
own checkpoint on the same function is the reference for what is an error and for how many forwards run.
"""
import os

import pytest
import torch
import torch.utils.checkpoint

from omnitron.core.parallel.tensor import recompute


class _ReadsTwice(torch.autograd.Function):
    """``x * x`` whose backward reads ``ctx.saved_tensors`` twice (the misuse torch's checkpoint refuses)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        return grad * (x + again)


def _counted(fn):
    """``fn`` and a list whose first element counts its calls (forward and reruns)."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        return fn(*args)
    return run, calls


def _torch_checkpoint(fn, *args):
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)


def _input(n: int = 8) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_()


@pytest.mark.parametrize("checkpoint", [recompute.checkpoint, _torch_checkpoint])
def test_second_read_in_one_backward_is_an_error(checkpoint):
    fn, calls = _counted(lambda x: _ReadsTwice.apply(x.sin()).sum())
    out = checkpoint(fn, _input())
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match="(read twice|already unpacked once)"):
        out.backward()
    assert calls[0] == 2, calls  # the forward and the first read's rerun; was 3: the second read reran silently


@pytest.mark.parametrize("checkpoint", [recompute.checkpoint, _torch_checkpoint])
def test_second_backward_task_reruns(checkpoint):
    x = _input()
    fn, calls = _counted(lambda v: (v.sin() * v.cos()).sum())
    out = checkpoint(fn, x)
    out.backward(retain_graph=True)
    out.backward()
    assert calls[0] == 3, calls  # one forward, one rerun per backward task
    ref = x.detach()
    # d/dx sin x cos x = cos 2x, twice: each backward's cos^2 - sin^2 and cos 2x are within a few float64 ulps
    # (|values| <= 1, ulp 2.2e-16), two summed: under 2e-15; 1e-14 leaves room, far below any wrong gradient
    assert torch.allclose(x.grad, 2 * torch.cos(2 * ref), rtol=0, atol=1e-14)


def _saves_differently(change: str):
    """A function whose rerun saves its tensor differently from the forward: a shorter slice, float32, or one
    tensor more."""
    calls = [0]

    def fn(x):
        calls[0] += 1
        rerun = calls[0] > 1
        if change == "shape":
            return (x[: 8 - rerun] ** 2).sum()  # pow saves its input: 8 elements, then 7
        if change == "count":
            return ((x ** 2).sin() if rerun else x ** 2).sum()  # sin saves its input too
        return (x.to(torch.float32 if rerun else x.dtype) ** 2).sum()
    return fn


@pytest.mark.parametrize("change, message", [
    ("shape", r"tensor 0 with shape \[7\] float64 on cpu where the forward saved shape \[8\] float64 on cpu"),
    ("dtype", r"tensor 0 with shape \[8\] float32 on cpu where the forward saved shape \[8\] float64 on cpu"),
    ("count", r"saved more than the 1 tensors the forward saved")])
def test_rerun_saving_other_tensors_is_an_error(change, message):
    out = recompute.checkpoint(_saves_differently(change), _input())
    with pytest.raises(torch.utils.checkpoint.CheckpointError, match=message) as err:
        out.backward()
    assert "\n" not in str(err.value)
    if change != "count":  # torch's checkpoint stops its rerun at the last tensor it needs: one more goes unseen
        with pytest.raises(torch.utils.checkpoint.CheckpointError):  # it refuses the others as well
            _torch_checkpoint(_saves_differently(change), _input()).backward()
