"""--overlap-moe-expert-parallel-comm: micro-batches' forwards run in pairs with each one's MoE dispatch and
combine all-to-all in flight while the other computes. At ep2 the losses equal the plain run's bit for bit
(per micro-batch the same operations on the same data; backwards and gradient accumulation in the same order;
dropout off: its masks would be drawn in the interleaved order), on cpu and on sim (where reading an
all-to-all's output before its wait raises). Also the refused layouts, and the paired table."""
from __future__ import annotations

import os

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.paired import pair_forwards
from omnitron.core.parallel.pipeline.schedules import build_schedule
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

ITERS = 3


def _args(root: str, micro_batches: int, extra=()) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
            "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", str(4 * micro_batches),
            "--log-interval", str(ITERS), "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"),
            "--lr", "1e-2", "--train-iters", str(ITERS), "--clip-grad", "1.0", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2",
            "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def train_moe(root: str, micro_batches: int, extra: tuple) -> dict:
    """Worker: train at ep2 (dp2) with ``extra`` flags; the losses."""
    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    res = train(parse_settings(_args(os.path.join(root, str(extra)), micro_batches, extra), dist.get_world_size()),
                get_backend())
    return {"losses": res["losses"], "schedule": res["components"].schedule.name}


def _check(backend: str, tmp_path, micro_batches: int) -> None:
    plain = run_distributed(train_moe, 2, str(tmp_path), micro_batches, (), backend=backend)
    paired = run_distributed(train_moe, 2, str(tmp_path), micro_batches, ("--overlap-moe-expert-parallel-comm",),
                             backend=backend)
    assert paired[0]["schedule"] == "none+paired" and plain[0]["schedule"] == "none"
    for p, q in zip(plain, paired):
        assert len(p["losses"]) == ITERS and q["losses"] == p["losses"], "pairing the forwards changed the losses"


@pytest.mark.multiprocess
def test_overlap_keeps_the_losses_at_ep2_on_cpu(tmp_path):
    _check("cpu", tmp_path, 3)  # one pair and an odd micro-batch alone


@requires_sim()
@pytest.mark.multiprocess
def test_overlap_keeps_the_losses_at_ep2_on_sim(tmp_path):
    _check("sim", tmp_path, 2)


def test_paired_table():
    table = pair_forwards(build_schedule("none", 1, 1, 5)).tables[0]
    assert " ".join(map(str, table)) == "0F0 0F1 0B0 0B1 0F2 0F3 0B2 0B3 0F4 0B4"


@pytest.mark.parametrize("extra, message", [
    (("--expert-model-parallel-size", "1"), "needs --num-experts and --expert-model-parallel-size >= 2"),
    (("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "1", "--num-experts", "4"),
     "needs --num-experts"),
    (("--recompute-granularity", "full", "--recompute-method", "uniform"), "drop one"),
])
def test_refused_layouts(tmp_path, extra, message):
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match=message):
        parse_settings(_args(str(tmp_path), 2, ("--overlap-moe-expert-parallel-comm", *extra)), 2)
