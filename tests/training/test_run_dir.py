"""Training with neither ``--save`` nor ``--log-dir``: the launcher (under torchrun, rank 0) names one new
``./runs/<timestamp>`` folder for the whole job before its workers start, and a second job in the same second gets a
folder of its own."""
from __future__ import annotations

import os
import random

import pytest

from omnitron.core.training import launch, metrics
from omnitron.core.training.arguments import parse_settings

ARGS = ["--model", "gpt2_tiny", "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "2", "--train-iters", "1", "--mock-data"]


def test_jobs_in_one_second_take_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMNITRON_RUNS_DIR", raising=False)
    stamp = f"2026{random.randrange(10**9):09d}"
    monkeypatch.setattr(metrics.time, "strftime", lambda fmt: stamp)
    got = [metrics.new_run_dir() for _ in range(3)]
    assert got == [os.path.join("runs", s) for s in (stamp, f"{stamp}-2", f"{stamp}-3")]
    assert all(os.path.isdir(p) for p in got)


def test_launcher_names_the_folder_once_for_training_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMNITRON_RUNS_DIR", raising=False)
    s = parse_settings(ARGS, world_size=1)
    launch._name_run_dir(s, None)
    assert os.path.isdir(s.logging.log_dir) and os.path.dirname(s.logging.log_dir) == "runs"
    given = parse_settings(ARGS + ["--save", str(tmp_path / "ck")], world_size=1)
    launch._name_run_dir(given, None)
    assert given.logging.log_dir is None  # --save is the folder (the loop's default)
    other = parse_settings(ARGS, world_size=1)
    launch._name_run_dir(other, entry=print)  # not the training loop (generate, serve): no folder
    assert other.logging.log_dir is None and os.listdir("runs") == [os.path.basename(s.logging.log_dir)]


def test_runs_dir_environment_replaces_dot_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / f"elsewhere{random.randrange(10**6)}"
    monkeypatch.setenv("OMNITRON_RUNS_DIR", str(root))
    s = parse_settings(ARGS, world_size=1)
    launch._name_run_dir(s, None)
    assert os.path.dirname(s.logging.log_dir) == str(root) and os.path.isdir(s.logging.log_dir)
    assert os.path.dirname(metrics.default_log_dir(None)) == str(root)
    assert not os.path.exists("runs")


RANK_CLOCK = """
import os, sys, time
from omnitron.core.training import metrics
stamp = "20261206-120000" if os.environ["RANK"] == "0" else "20261206-120001"
metrics.time = type("Clock", (), {"strftime": staticmethod(lambda fmt: stamp), "time": staticmethod(time.time)})
from omnitron.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_under_torchrun_every_rank_writes_into_rank0s_folder(tmp_path):
    """torchrun, neither --save nor --log-dir, ranks whose clocks read different seconds (rank 1 one later, as
    when the ranks straddle a second): rank 0 names one new folder, locks it, and rank 1's profiler trace goes
    there too (each rank named its own folder from its clock, and none was locked). About 30 s on 2 cores."""
    import subprocess
    import sys

    script = tmp_path / "ranks.py"
    script.write_text(RANK_CLOCK)
    env = dict(os.environ, OMNITRON_RUNS_DIR=str(tmp_path / "runs"),
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script),
                           *ARGS, "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--profile",
                           "--profile-ranks", "0", "1", "--profile-step-start", "1", "--profile-step-end", "2"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(tmp_path / "runs") == ["20261206-120000"]
    folder = tmp_path / "runs" / "20261206-120000"
    assert {"metrics.jsonl", "omnitron.lock"} <= set(os.listdir(folder))
    traces = sorted(f for f in os.listdir(folder / "profile") if f.startswith("trace_"))
    assert traces == ["trace_rank0_iters2-2.json", "trace_rank1_iters2-2.json"], traces
