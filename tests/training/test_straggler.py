"""--log-straggler: a rank slowed by a planted sleep is named slowest in metrics.jsonl (dp2; dp4 under -m slow);
the scores and orderings against a plain computation on fresh random times; its cost, one all-gather per report
(the TensorBoard scalars: tests/training/test_observability.py)."""
from __future__ import annotations

import json
import os
import random
import time

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.straggler import straggler_fields
from omnitron.testing.distributed import run_distributed

SLEEP_S = 0.1


def _args(root, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "200",
            "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4",
            "--lr", "1e-3", "--log-interval", "2", "--no-tensorboard", "--log-dir", root,
            "--data-cache-path", os.path.join(root, "cache"), "--log-straggler", *extra]


def slowed_worker(root: str, slow: int) -> None:
    """Train data-parallel with every forward of rank ``slow`` sleeping SLEEP_S first (inside its compute spans)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import model as gpt
    from omnitron.core.training.loop import train

    if dist.get_rank() == slow:
        inner = gpt.GPTModel.forward

        def slow_forward(self, *a, **kw):
            time.sleep(SLEEP_S)
            return inner(self, *a, **kw)

        gpt.GPTModel.forward = slow_forward
    train(parse_settings(_args(root, "--straggler-minmax-count", "2"), dist.get_world_size()), get_backend())


@pytest.mark.parametrize("world,slow", [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_planted_sleep_is_named_slowest(tmp_path, world, slow):
    run_distributed(slowed_worker, world, str(tmp_path), slow)
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f if "lm_loss" in line]
    assert [r["iteration"] for r in records] == [2, 4]
    for r in records:
        assert r["straggler_slowest_ranks"][0] == slow and r["straggler_slowest_rank"] == slow
        assert len(r["straggler_slowest_ranks"]) == 2 and r["straggler_fastest_ranks"][0] != slow
        # 8 / world micro-batches per step, each forward of the slow rank sleeping inside its compute span
        extra_ms = 8 // world * SLEEP_S * 1e3
        compute = r["straggler_compute_ranks_ms"]
        assert compute[slow] >= extra_ms
        # NOTE: at dp2 the median is the mean of both ranks, so the score is at most 2; the other rank's spans
        # stretch when the shared cores are loaded (40-130 ms seen against the sleeps' 400 ms: 1.6-1.9)
        assert r["straggler_max_score"] == r["straggler_scores"][slow] > 1.2
        # everyone ends the step together: the step time does not single the slow rank out
        assert len(r["straggler_step_ranks_ms"]) == world and min(r["straggler_step_ranks_ms"]) > 0.9 * extra_ms


def test_scores_and_order_against_a_plain_computation():
    rng = random.Random(time.time_ns())
    for world in (1, 2, 5, 8):
        compute = [rng.uniform(10.0, 100.0) for _ in range(world)]
        table = {"compute": compute, "step": [rng.uniform(100, 200) for _ in range(world)],
                 "forward": [c / 3 for c in compute], "backward": [2 * c / 3 for c in compute]}
        fields, line = straggler_fields(table, 2)
        s = sorted(compute)
        median = s[world // 2] if world % 2 else (s[world // 2 - 1] + s[world // 2]) / 2
        assert fields["straggler_scores"] == pytest.approx([c / median for c in compute], rel=1e-12)
        by_time = sorted(range(world), key=lambda r: compute[r], reverse=True)
        assert fields["straggler_slowest_ranks"] == by_time[:min(2, world)]
        assert fields["straggler_fastest_ranks"] == by_time[::-1][:min(2, world)]
        assert fields["straggler_slowest_rank"] == by_time[0] and f"slowest rank {by_time[0]} " in line


def test_ties_and_idle_ranks_follow_the_stated_rules():
    """Equal compute times are named lower rank first among the slowest; ranks that computed nothing (a zero
    median) all score 1.0, not 0 or a division by zero (straggler.py's rules, by hand)."""
    rng = random.Random(time.time_ns())
    for world in (3, 4, 6):
        slow, fast = rng.uniform(50.0, 100.0), rng.uniform(1.0, 10.0)
        tied = sorted(rng.sample(range(world), 2))
        compute = [slow if r in tied else fast for r in range(world)]
        table = {"compute": compute, "step": [200.0] * world, "forward": compute, "backward": [0.0] * world}
        fields, _ = straggler_fields(table, 2)
        assert fields["straggler_slowest_ranks"] == tied and fields["straggler_slowest_rank"] == tied[0]
        idle = {k: [0.0] * world for k in table}
        assert straggler_fields(idle, 1)[0]["straggler_scores"] == [1.0] * world


def test_one_rank_report_is_the_mean_of_its_steps_since_the_last():
    """A report gives each section's mean in ms per recorded step since the previous report: compute is forward
    plus backward; a step that recorded no spans counts as zero compute (by hand, one process, fresh times)."""
    from omnitron.core.training.straggler import StragglerDetector

    rng = random.Random(time.time_ns())
    det = StragglerDetector(world_size=1, collectives=None, device="cpu", minmax_count=1, host_clock_only=False,
                            rank=0)
    for _ in range(2):  # two reports: the second sees only its own steps
        steps = [(rng.uniform(0.1, 0.2), {"forward": rng.uniform(0.01, 0.02), "backward": rng.uniform(0.02, 0.04)})
                 for _ in range(rng.randint(2, 5))] + [(rng.uniform(0.1, 0.2), None)]
        for step_s, sections in steps:
            det.record(step_s, sections)
        fields, _ = det.report()
        n, spans = len(steps), [sec for _, sec in steps if sec]
        for key, want in (("step", sum(t for t, _ in steps)), ("forward", sum(x["forward"] for x in spans)),
                          ("backward", sum(x["backward"] for x in spans)),
                          ("compute", sum(x["forward"] + x["backward"] for x in spans))):
            assert fields[f"straggler_{key}_ranks_ms"] == pytest.approx([1e3 * want / n], rel=1e-12), key


def test_log_line_step_range_and_the_host_clock_note(caplog):
    """The line gives the ranks' step times as min-max; the host-clock note is logged once, by rank 0 only."""
    import logging

    from omnitron.core.training.straggler import StragglerDetector

    rng = random.Random(time.time_ns())
    steps = [rng.uniform(100.0, 200.0) for _ in range(4)]
    table = {"compute": [1.0, 2.0, 3.0, 4.0], "step": steps, "forward": [0.0] * 4, "backward": [0.0] * 4}
    assert f"| step {min(steps):.1f}-{max(steps):.1f} ms" in straggler_fields(table, 1)[1]
    note = "compute spans time their launch on the host"
    for rank, said in ((0, True), (1, False)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="omnitron.train"):
            StragglerDetector(world_size=2, collectives=None, device="cpu", minmax_count=1, host_clock_only=True,
                              rank=rank)
        assert (note in caplog.text) is said, rank


def test_bad_count_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="--straggler-minmax-count must be >= 1"):
        parse_settings(_args(str(tmp_path), "--straggler-minmax-count", "0"), 1)


def counted_gathers(root: str, on: bool) -> int:
    """Worker: train 4 iterations at --log-interval 2 (with or without --log-straggler); the all-gathers issued."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    backend = get_backend()
    calls, inner = [0], type(backend.collectives).all_gather

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return inner(self, *args, **kwargs)

    type(backend.collectives).all_gather = counting
    args = _args(root)
    if not on:
        args.remove("--log-straggler")
    train(parse_settings(args, dist.get_world_size()), backend)
    return calls[0]


def test_one_gather_per_report_not_per_step(tmp_path):
    """The detector's cost: one all-gather per --log-interval (2 reports in 4 iterations), none on the other steps."""
    off = run_distributed(counted_gathers, 2, str(tmp_path / "off"), False)
    on = run_distributed(counted_gathers, 2, str(tmp_path / "on"), True)
    assert [b - a for a, b in zip(off, on)] == [4 // 2] * 2, (off, on)
