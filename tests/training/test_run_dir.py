"""Training with neither ``--save`` nor ``--log-dir``: the launcher names one new ``./runs/<timestamp>`` folder for
the whole job before its workers start, and a second job in the same second gets a folder of its own."""
from __future__ import annotations

import os
import random

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
