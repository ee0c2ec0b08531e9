"""Observability flags: phase timers in metrics.jsonl (nesting relations, min <= max over ranks), the
parameter norm and zero-gradient count against independent computations on the gathered full tensors,
the profiler window, TensorBoard filtering, and clear errors for bad values."""
from __future__ import annotations

import json
import logging
import math
import os

import pytest

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.metrics import MetricsLogger
from omnitron.core.training.timers import Timers, format_timers, timer_fields
from omnitron.testing.distributed import run_distributed
from omnitron.testing.musa_double import requires_double

# phases nested inside train-step, one after another
STEP_PHASES = ("forward_backward", "all_grads_sync", "optimizer")


def _args(root, *extra):
    # untied output layer: word-embedding rows of tokens absent from a step get exactly zero gradient
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "500",
            "--untie-embeddings-and-output-weights", "--num-workers", "0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"),
            "--lr", "1e-2", "--log-params-norm", "--log-num-zeros-in-grad", *extra]


def _records(log_dir) -> list[dict]:
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


def _full_norm_and_zeros(c) -> tuple[float, int]:
    """Independently: the norm of the gathered full parameters and the zeros of the gathered full gradients,
    plus the vocabulary padding rows (zero-gradient rows the model holds and the full tensors drop)."""
    from omnitron.core.models.gpt import gather_full_state

    model = c.modules[0]
    params = gather_full_state(model, c.groups)
    grads = gather_full_state(model, c.groups, grads=True)
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in params.values()))
    held = {n: p.numel() * (c.groups.tp.size if getattr(p, "tensor_model_parallel", False) else 1)
            for n, p in model.named_parameters()}
    padding = sum(held[n] - t.numel() for n, t in grads.items())
    assert padding == 2 * (model.embedding.word_embeddings.weight.shape[0] * c.groups.tp.size - c.model.vocab_size) * 32
    return norm, sum(int((t == 0).sum()) for t in grads.values()) + padding


def _trace_iterations(path) -> set[int]:
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {int(e["name"].split()[1]) for e in events if str(e.get("name", "")).startswith("iteration ")}


def test_one_process_timers_norms_memory_profile(tmp_path):
    from omnitron.core.training.loop import train

    log_dir = str(tmp_path / "logs")
    res = train(parse_settings(_args(str(tmp_path), "--train-iters", "4", "--log-interval", "2", "--log-dir", log_dir,
                                     "--save", str(tmp_path / "ck"), "--save-interval", "2",
                                     "--timing-log-level", "2", "--log-throughput", "--log-memory-to-tensorboard",
                                     "--profile", "--profile-step-start", "1", "--profile-step-end", "3"), 1),
                get_backend("cpu"))
    recs = _records(log_dir)
    assert [r["iteration"] for r in recs] == [2, 4]
    for r in recs:
        t = {k[len("timers_"):-len("_ms")]: v for k, v in r.items() if k.startswith("timers_") and k.endswith("_ms")
             and not k.endswith("_min_ms")}
        for name in ("train_step", *STEP_PHASES, "optimizer_copy_main_to_model_params", "batch_generator",
                     "forward_compute", "backward_compute"):
            assert t[name] >= 0 and r[f"timers_{name}_min_ms"] == t[name]  # one rank: min == max
        assert "pipeline_wait" not in t  # no pipeline stages
        assert sum(t[p] for p in STEP_PHASES) <= t["train_step"]
        assert t["forward_compute"] + t["backward_compute"] <= t["forward_backward"]
        assert (t["batch_generator"] <= t["forward_backward"]
                and t["optimizer_copy_main_to_model_params"] <= t["optimizer"])
        assert r["tokens_per_sec_per_device"] == pytest.approx(r["tokens_per_sec"])
        assert r["mem_max_allocated_bytes"] >= r["mem_allocated_bytes"] > 0
    # the save after iteration 2's log line is reported on the next one
    assert "timers_save_checkpoint_ms" not in recs[0] and recs[1]["timers_save_checkpoint_ms"] > 0
    norm, zeros = _full_norm_and_zeros(res["components"])  # the state after iteration 4, the last logged
    assert recs[-1]["params_norm"] == pytest.approx(norm, rel=1e-6)
    assert recs[-1]["num_zeros_in_grad"] == zeros > 0
    files = sorted(os.listdir(os.path.join(log_dir, "profile")))
    assert files == ["summary_rank0.json", "trace_rank0_iters2-3.json"]
    assert _trace_iterations(os.path.join(log_dir, "profile", files[1])) == {2, 3}
    with open(os.path.join(log_dir, "profile", files[0])) as f:
        summary = json.load(f)
    assert summary["iterations"] == [2, 3] and summary["window_ms"] > 0
    assert summary["device_idle_fraction"] is None  # cpu: no device events to measure


def _tp2_worker(root):
    import torch.distributed as dist

    from omnitron.core.training.loop import train

    rank = dist.get_rank()
    log_dir = os.path.join(root, "logs")
    res = train(parse_settings(_args(root, "--tensor-model-parallel-size", "2", "--train-iters", "2",
                                     "--log-interval", "1", "--log-dir", log_dir, "--timing-log-level", "1",
                                     "--timing-log-option", "all", "--profile", "--profile-step-start", "1",
                                     "--profile-step-end", "2",
                                     "--profile-ranks", "1"), 2), get_backend())  # under test
    norm, zeros = _full_norm_and_zeros(res["components"])
    return {"rank": rank, "norm": norm, "zeros": zeros, "records": _records(log_dir) if rank == 0 else None}


def test_tp2_timers_over_ranks_and_counts_each_shard_once(tmp_path):
    out = run_distributed(_tp2_worker, 2, str(tmp_path))
    recs = out[0]["records"]
    assert [r["iteration"] for r in recs] == [1, 2]
    for r in recs:
        ranks = {k[len("timers_"):-len("_ranks_ms")]: v for k, v in r.items() if k.endswith("_ranks_ms")}
        assert set(ranks) == {"train_step", *STEP_PHASES, "optimizer_copy_main_to_model_params"}
        for name, per_rank in ranks.items():
            assert len(per_rank) == 2 and None not in per_rank
            assert r[f"timers_{name}_min_ms"] == min(per_rank) <= max(per_rank) == r[f"timers_{name}_ms"]
        for rank in (0, 1):  # nesting holds on every rank
            assert sum(ranks[p][rank] for p in STEP_PHASES) <= ranks["train_step"][rank]
    # both ranks gathered the same full tensors; the logged values count every shard once
    assert out[0]["norm"] == pytest.approx(out[1]["norm"], rel=1e-12) and out[0]["zeros"] == out[1]["zeros"]
    assert recs[-1]["params_norm"] == pytest.approx(out[0]["norm"], rel=1e-6)
    assert recs[-1]["num_zeros_in_grad"] == out[0]["zeros"] > 0
    assert sorted(os.listdir(tmp_path / "logs" / "profile")) == ["summary_rank1.json", "trace_rank1_iters2-2.json"]


def test_timers_levels_reduction_and_fields():
    timers = Timers(get_backend("cpu"), log_level=1, log_option="minmax")
    assert not timers.enabled("batch-generator") and timers("batch-generator").stop() == 0.0  # level 2: a no-op
    assert timers.names() == ["train-step", "save-checkpoint", "forward-backward", "all-grads-sync", "optimizer",
                              "optimizer-copy-main-to-model-params", "params-all-gather"]
    timers("forward-backward").add(0.3)
    timers("forward-backward").add(0.1)
    timers("save-checkpoint").add(0.5)
    timers("optimizer").start()
    with pytest.raises(RuntimeError, match="started twice"):
        timers("optimizer").start()
    timers("optimizer").stop()
    with pytest.raises(RuntimeError, match="without being started"):
        timers("optimizer").stop()
    with pytest.raises(KeyError, match="unknown timer 'forward'"):
        timers("forward")
    per_rank = timers.reduce(iterations=4)
    assert set(per_rank) == {"forward-backward", "save-checkpoint", "optimizer"}  # timers that never ran: left out
    assert per_rank["forward-backward"] == [pytest.approx(100.0)]  # 0.4 s over 4 iterations, in ms
    assert per_rank["save-checkpoint"] == [pytest.approx(500.0)]  # saves: the total, not per iteration
    assert timers.reduce(iterations=1) == {}  # reduce resets
    table = {"forward-backward": [12.0, None, 15.0]}
    assert timer_fields(table, "max") == {"timers_forward_backward_ms": 15.0}
    assert timer_fields(table, "all") == {"timers_forward_backward_ms": 15.0, "timers_forward_backward_min_ms": 12.0,
                                          "timers_forward_backward_ranks_ms": [12.0, None, 15.0]}
    assert format_timers(table, "minmax").endswith("forward-backward 12.00/15.00")
    assert format_timers(table, "all").endswith("forward-backward 12.00/-/15.00")
    with pytest.raises(ValueError, match="'avg' is not one of max, minmax, all"):
        Timers(log_option="avg")


class _Board:
    def __init__(self):
        self.keys, self.values = set(), {}

    def add_scalar(self, key, value, step):
        self.keys.add(key)
        self.values[key] = value

    def close(self):
        pass


@pytest.mark.parametrize("to_tensorboard", [False, True])
def test_timers_reach_tensorboard_only_when_asked(tmp_path, to_tensorboard, capsys):
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=1, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0, tensorboard_timers=to_tensorboard)
    logger._tb = board = _Board()
    logger.step(1, {"lm_loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": None, "skipped": False,
                    "step_time_s": 0.5, "tokens_per_sec": 10.0,
                    "log": {"timers_optimizer_ms": 3.0, "timers_optimizer_min_ms": 2.0, "params_norm": 2.0},
                    "log_lines": ["timers (ms, max over ranks): optimizer 3.00"]})
    logger.close()
    # Megatron's Timers.write: "<name>-time", seconds per iteration (max over ranks); omnitron's own keys not at all
    assert "params-norm" in board.keys and ("optimizer-time" in board.keys) == to_tensorboard
    assert not any(k.startswith("timers_") for k in board.keys)
    if to_tensorboard:
        assert board.values["optimizer-time"] == pytest.approx(3.0e-3, rel=1e-12)
    assert json.loads(open(tmp_path / "metrics.jsonl").read())["timers_optimizer_ms"] == 3.0  # always in the file
    assert capsys.readouterr().out.splitlines()[-1] == "timers (ms, max over ranks): optimizer 3.00"


def test_straggler_scalars_reach_tensorboard_lists_stay_in_the_file(tmp_path):
    from omnitron.core.training.straggler import straggler_fields

    fields, line = straggler_fields({"compute": [1.0, 3.0], "step": [5.0, 5.0], "forward": [0.5, 1.0],
                                     "backward": [0.5, 2.0]}, 1)
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=1, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0)
    logger._tb = board = _Board()
    logger.step(1, {"lm_loss": 1.0, "lr": 0.1, "grad_norm": 1.0, "loss_scale": None, "skipped": False,
                    "step_time_s": 0.5, "tokens_per_sec": 10.0, "log": fields, "log_lines": [line]})
    logger.close()
    assert {"straggler_max_score", "straggler_slowest_rank"} <= board.keys
    rec = json.loads(open(tmp_path / "metrics.jsonl").read())
    assert rec["straggler_slowest_ranks"] == [1] and rec["straggler_scores"] == [0.5, 1.5]


@pytest.mark.parametrize("flags, world, message", [
    (["--profile-step-start", "5", "--profile-step-end", "5"], 1, "--profile-step-end (5) must be greater than "
                                                                   "--profile-step-start (5)"),
    (["--timing-log-option", "avg"], 1, "--timing-log-option 'avg' is not supported; use max, minmax or all"),
    (["--timing-log-level", "3"], 1, "--timing-log-level must be 0, 1 or 2, got 3"),
    (["--profile", "--profile-ranks", "0", "2"], 2, "--profile-ranks 2 is not a rank of this 2-process run"),
    (["--profile-ranks", "first"], 1, "--profile-ranks expects global rank numbers"),
])
def test_bad_values_are_clear_errors(tmp_path, flags, world, message):
    with pytest.raises(ConfigError) as err:
        parse_settings(_args(str(tmp_path), *flags), world)
    assert message in str(err.value)


@requires_double()
def test_profiler_activities_come_from_the_backend():
    from torch.profiler import ProfilerActivity

    from omnitron.testing import musa_double

    assert get_backend("cpu").profiler_activities() == (ProfilerActivity.CPU,)
    assert ProfilerActivity.CPU in get_backend().profiler_activities()
    with musa_double.installed():  # torch has no MUSA activity: the out-of-tree device slot torch_musa registers as
        expected = getattr(ProfilerActivity, "MUSA", None) or ProfilerActivity.PrivateUse1
        assert musa_double.MUSADoubleBackend().profiler_activities() == (ProfilerActivity.CPU, expected)


def test_tensorboard_resume_purges_and_a_missing_package_is_said(tmp_path, monkeypatch, caplog):
    """A resumed run's writer purges events past its checkpoint (purge_step = first new iteration); without
    the tensorboard package the run says so once instead of dropping the events silently."""
    import sys
    import types

    seen = []
    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = lambda **kw: seen.append(kw) or _Board()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    for start in (0, 7):
        MetricsLogger(log_dir=str(tmp_path / str(start)), log_interval=1, train_iters=9, enabled=True,
                      tensorboard=True, progress_bar=False, start_iteration=start).close()
    assert [kw["purge_step"] for kw in seen] == [None, 8]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        MetricsLogger(log_dir=str(tmp_path / "x"), log_interval=1, train_iters=1, enabled=True, tensorboard=True,
                      progress_bar=False, start_iteration=0).close()
    assert "TensorBoard events are off: the tensorboard package is not installed" in caplog.text


def test_log_lines_go_above_the_progress_bar(tmp_path, capsys):
    """With the bar on, a log line during training is written by tqdm above the bar (not through it), and the
    logger's own handlers are back after the run."""
    import logging as _logging

    omni, train_log = _logging.getLogger("omnitron"), _logging.getLogger("omnitron.train")
    before, level = (omni.propagate, list(omni.handlers)), train_log.level
    train_log.setLevel(_logging.INFO)  # as the workers' logging setup has it
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=5, train_iters=4, enabled=True, tensorboard=False,
                           progress_bar=True, start_iteration=0)
    _logging.getLogger("omnitron.train").info("saving checkpoint at iteration 2 under X ...")
    logger.close()
    train_log.setLevel(level)
    captured = capsys.readouterr()
    assert "saving checkpoint at iteration 2 under X ..." in captured.out
    assert (omni.propagate, list(omni.handlers)) == before


def test_bf16_params_norm_is_of_the_fp32_main_parameters(tmp_path):
    """Megatron's calc_params_l2_norm takes ``param.main_param`` under --bf16 (the optimizer's fp32 copy), not the
    bf16 weights. The logged norm must be the masters' (float64 reference; the fp32 sums of ~3e4 squares are good
    to ~1e-6 relative, so 1e-5); then the masters are moved by 2^-10 relative, below what the bf16 copies can
    show (their ulp is 2^-8 relative), and the norm must follow. Failed before: the norm was the bf16 weights',
    1.7e-3 relative below the masters' after one step (the norms' weights, 1 - lr, round down to 0.98828125)."""
    from omnitron.core.training.loop import params_norm, train

    res = train(parse_settings(_args(str(tmp_path), "--bf16", "--train-iters", "1", "--log-interval", "1",
                                     "--log-dir", str(tmp_path / "logs")), 1), get_backend("cpu"))
    c = res["components"]
    recs = _records(str(tmp_path / "logs"))
    assert recs[-1]["params_norm"] == pytest.approx(_norm(c.optimizer.masters), rel=1e-5)
    bf16 = _norm(p for m in c.modules for p in m.parameters())
    for m in c.optimizer.masters:
        m.mul_(1.0 + 2.0 ** -10)
    want = _norm(c.optimizer.masters)
    assert abs(want / bf16 - 1.0) > 2.0 ** -11  # the two norms are apart
    assert params_norm(c) == pytest.approx(want, rel=1e-5)


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.detach().double().square().sum()) for t in tensors))


_MEGATRON_MEMORY = (r"^\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: (\d+\.\d{2}) \| "
                    r"max allocated: (\d+\.\d{2}) \| reserved: (\d+\.\d{2}) \| max reserved: (\d+\.\d{2})$")
"""Megatron's report_memory format string (training/utils/common_utils.py at d98e8a6), as a pattern."""


def _memory_lines(root: str, resume: bool, iters: int = 4) -> list[tuple[int, ...]]:
    """(rank, iteration, allocated, max allocated, reserved, max reserved) of each memory line this rank logged in
    a run to ``iters`` at --log-interval 3 (to 7, resumed at 4, with ``resume``)."""
    import re

    from omnitron.core.training.loop import train

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("omnitron.train")
    level, _ = logger.level, logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        flags = ["--log-interval", "3", "--lr-decay-iters", "7", "--save", os.path.join(root, "ckpt"),
                 "--save-interval", "4"]
        if resume:
            flags += ["--load", os.path.join(root, "ckpt")]
        train(parse_settings(_args(root, "--train-iters", "7" if resume else str(iters), *flags),
                             int(os.environ.get("WORLD_SIZE", "1"))), get_backend("cpu"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    found = [re.match(_MEGATRON_MEMORY, line) for line in lines if "memory (MB)" in line]
    assert all(found), lines
    return [tuple(int(g) if i < 2 else float(g) for i, g in enumerate(m.groups())) for m in found]


@pytest.mark.host_only("asserts cpu's memory figures (the resident set: allocated == reserved, under the kernel's peak); a device's allocator counts otherwise")
def test_memory_lines_are_megatrons(tmp_path):
    """Megatron's report_memory line, each rank of data-parallel rank 0 at its process's first iteration and at the
    next logged one (its report_memory_flag): a fresh run at 1 and 3, the run resumed from 4 at 5 and 6; on cpu the
    process's resident set, allocated <= max allocated <= the kernel's peak read after. On dp 2
    only rank 0 logs it. Failed before: no such line."""
    import resource

    fresh = _memory_lines(str(tmp_path), False)
    resumed = _memory_lines(str(tmp_path), True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**20
    assert [(r, it) for r, it, *_ in fresh] == [(0, 1), (0, 3)]
    assert [(r, it) for r, it, *_ in resumed] == [(0, 5), (0, 6)]
    for _, _, alloc, max_alloc, reserved, max_reserved in fresh + resumed:
        # the kernel counts resident pages in per-thread / per-cpu batches of tens of pages, so its peak, read after,
        # can trail what the run read before by a fraction of a MiB (0.2 seen): 4 MiB of slack, ~1% of the process
        assert 0 < alloc <= max_alloc <= peak_mb + 4 and alloc == reserved and max_alloc == max_reserved
    ranks = run_distributed(_memory_lines, 2, str(tmp_path / "dp2"), False)
    assert [[(r, it) for r, it, *_ in lines] for lines in ranks] == [[(0, 1), (0, 3)], []]


def test_a_last_iteration_off_the_interval_prints_no_line(tmp_path, capsys):
    """Megatron's training_log prints at a multiple of --log-interval and at the process's first iteration only
    (``iteration % log_interval == 0 or is_first_iteration``), the memory line with it: a run of 2 at --log-interval
    3 prints iteration 1's line and memory line and nothing at 2, whose record metrics.jsonl still gets (its steps
    would be reported nowhere else). Failed before: a training line and a second memory line at iteration 2."""
    from omnitron.testing.megatron_log import parse_training_line

    memory = _memory_lines(str(tmp_path), False, iters=2)
    printed = [p["iteration"] for p in map(parse_training_line, capsys.readouterr().out.splitlines()) if p]
    assert [(r, it) for r, it, *_ in memory] == [(0, 1)]
    assert printed == [1]
    assert [r["iteration"] for r in _records(str(tmp_path / "ckpt"))] == [2]
