"""--ckpt-step (Megatron's flag): resume from a checkpoint other than the newest, as when the newest is damaged."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.checkpoint import CheckpointError
from omnitron.core.training import loop
from omnitron.core.training.arguments import parse_settings


def _args(tmp_path, *extra):
    save = str(tmp_path / "ck")
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "2", "--hidden-dropout",
            "0.1", "--lr", "1e-3", "--train-iters", "4", "--save-interval", "2", "--save", save, "--no-tensorboard",
            "--log-dir", str(tmp_path / "logs"), "--data-cache-path", str(tmp_path / "cache"), *extra]


def _train(argv):
    from omnitron.backends import get_backend

    return loop.train(parse_settings(argv, 1), get_backend("cpu"))["losses"]


def _damage(directory: str, seed: int) -> str:
    """Flip one random byte of the largest file of checkpoint ``directory``; its name."""
    name = max(os.listdir(directory), key=lambda n: os.path.getsize(os.path.join(directory, n)))
    path = os.path.join(directory, name)
    at = int(torch.randint(os.path.getsize(path), (1,), generator=torch.Generator().manual_seed(seed)))
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    return name


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_ckpt_step_resumes_past_a_damaged_newest_checkpoint(tmp_path, fmt):
    """A run saves iterations 2 and 4; a byte of iteration 4's largest file is flipped. --load stops in one line
    naming the damage and --ckpt-step; --load --ckpt-step 2 resumes from iteration 2 on the uninterrupted run's
    loss curve, bit for bit (dropout on: RNG, data order, optimizer all restored), and its save of iteration 4
    replaces the damaged copy. A step with no complete checkpoint is refused naming the complete ones. Fails
    without the flag: argparse refuses --ckpt-step as a Megatron flag omnitron lacks."""
    save = str(tmp_path / "ck")
    argv = _args(tmp_path, "--ckpt-format", fmt)
    full = _train(argv)
    damaged = _damage(os.path.join(save, "iter_0000004"), seed=int(torch.seed() % 2**31))
    with pytest.raises(CheckpointError, match="--ckpt-step") as refused:
        _train(argv + ["--load", save])
    assert damaged in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(CheckpointError, match=r"--ckpt-step 3: .* has no complete iter_0000003 \(complete: 2, 4\)"):
        _train(argv + ["--load", save, "--ckpt-step", "3"])
    resumed = _train(argv + ["--load", save, "--ckpt-step", "2"])
    assert resumed == {3: full[3], 4: full[4]}
    assert open(os.path.join(save, "latest")).read() == "iter_0000004"
    assert _train(argv + ["--load", save, "--train-iters", "4"]) == {}  # the re-saved 4 loads: nothing left to run
