"""--save-retain-interval (Megatron's): which checkpoints a run keeps."""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.checkpoint import save_checkpoint
from omnitron.core.checkpoint.io import list_checkpoints


def megatron_kept(saves: list[int], retain: int) -> list[int]:
    """What Megatron's iter_finalize_fn (megatron/training/checkpointing.py) leaves: on each save, the iteration
    the tracker named before is deleted if it is > 0, not this one and not a multiple of ``retain``."""
    kept, tracker = set(), 0
    for it in saves:
        kept.add(it)
        if tracker > 0 and tracker != it and tracker % retain != 0:
            kept.discard(tracker)
        tracker = it
    return sorted(kept)


def test_save_retain_interval_keeps_what_megatron_keeps(tmp_path):
    """Random save iterations (ascending, as a run with --save-interval and signal saves between), random retain
    interval: the directories left are Megatron's. Fails without the flag: every checkpoint stays."""
    g = torch.Generator().manual_seed(int(torch.seed() % 2**31))
    saves = sorted(set((torch.randperm(40, generator=g)[:12] + 1).tolist()))
    retain = int(torch.randint(2, 7, (1,), generator=g))
    for it in saves:
        save_checkpoint(str(tmp_path), it, {"w": torch.zeros(2)}, {"model": {}, "layout": {}}, rank=0, world_size=1,
                        barrier=lambda: None, retain_interval=retain)
    assert list_checkpoints(str(tmp_path)) == megatron_kept(saves, retain), (saves, retain)


@pytest.mark.parametrize("extra", [[], ["--async-save"]], ids=["sync", "async"])
def test_training_run_retains_multiples_and_the_newest(tmp_path, extra):
    """A run saving every iteration to 6 with --save-retain-interval 4 (torch_dist, also --async-save, whose
    commit comes at the next save) keeps iterations 4 and 6."""
    from omnitron.backends import get_backend
    from omnitron.core.training import loop
    from omnitron.core.training.arguments import parse_settings

    save = str(tmp_path / "ck")
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "6",
            "--save-interval", "1", "--save-retain-interval", "4", "--save", save, "--no-tensorboard",
            "--log-dir", str(tmp_path / "logs"), "--data-cache-path", str(tmp_path / "cache"), *extra]
    loop.train(parse_settings(argv, 1), get_backend("cpu"))
    assert list_checkpoints(save) == megatron_kept(list(range(1, 7)), 4) == [4, 6]
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000004", "iter_0000006"]
