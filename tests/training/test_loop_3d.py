"""The path users run, at tp2 x pp2 x dp2: ``omnitron train`` (parse_settings + train, so every step goes
through ``training/step.py``: the pipeline schedule, gradient reduction, AdamW with the distributed
optimizer, clipping by the global norm) on 8 gloo ranks against the same command on one process.

The cheapest model that still exercises every axis: 2 layers (one per pipeline stage), hidden 32 split
over 2 tensor ranks, GQA, a global batch of 8 in micro-batches of 2 (2 per data-parallel replica, so the
1F1B schedule really interleaves), 3 steps and one validation.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed

STEPS = 3

# fp32, u = 2^-24 = 6e-8. The layouts differ only in the order of sums: tp splits of n <= 128-term
# contractions and the dp average, ~sqrt(n) u = d = 7e-7 relative (random-rounding model), which the
# forward loss and the gradients inherit with condition ~1 (d on the first loss). AdamW's per-entry
# update m / sqrt(v) carries each gradient entry's relative error, but its effect on the next loss is
# weighted by that same entry: |d loss| <= lr ||dg||_1 <= lr sqrt(N) d ||g||_2 per step (N = 2.8e4
# parameters, lr 1e-2, ||g|| <= 1 after clipping): 1.2e-6 absolute on a loss of ~4.6, i.e. 2.6e-7
# relative; the clip factor (from the global norm, relative error d) adds d per step. Over 3 steps:
# d + 3 (2.6e-7 + d) = 3.6e-6. REL leaves ~3x; a layout bug (a missing reduction, a wrong shard)
# moves the losses by 1e-3 or more.
REL = 1e-5


def _argv(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--ffn-hidden-size", "64", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(STEPS), "--eval-interval", str(STEPS), "--eval-iters", "1",
            "--optimizer", "adam", "--lr", "1e-2", "--clip-grad", "1.0", "--weight-decay", "0.01",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--no-tensorboard",
            "--data-cache-path", root + "/cache", "--seed", "1234", *extra]


def _train(root: str, world: int, *extra: str) -> tuple[list[float], list[float]]:
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    res = train(parse_settings(_argv(root, *extra), world), get_backend())
    return [res["losses"][i] for i in sorted(res["losses"])], [v["val_loss"] for v in res["validation"]]


def test_train_tp2_pp2_dp2_matches_one_process(tmp_path):
    ref_losses, ref_val = _train(str(tmp_path / "one"), 1)
    assert len(ref_losses) == STEPS and len(set(ref_losses)) == STEPS and len(ref_val) == 2  # in the loop, at the end
    ranks = run_distributed(_train, 8, str(tmp_path / "3d"), 8, "--tensor-model-parallel-size", "2",
                            "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                            "--sequence-parallel", timeout_s=600)
    for rank, (losses, val) in enumerate(ranks):
        assert losses == pytest.approx(ref_losses, rel=REL), (rank, losses, ref_losses)
        assert val == pytest.approx(ref_val, rel=REL), (rank, val, ref_val)
