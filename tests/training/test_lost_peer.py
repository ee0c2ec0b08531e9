"""Under torchrun, a rank whose transport lost a peer names the peer: the ranks of the other node of a two-node job
whose rank was killed (kill -9) saw only "Connection reset by peer" and named no rank. The watchdog's census
(heartbeats that stopped) names the ranks that are gone, in the line torchrun's report shows."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from omnitron.core.training import failures
from omnitron.testing.faults import children, on_own_disk, private_mount_works, records, start, tiny_train_args
from omnitron.testing.ports import free_port


def test_a_lost_peer_is_named_under_torchrun(monkeypatch, tmp_path):
    error_file = str(tmp_path / "error.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    monkeypatch.delenv(failures.REPORT_DIR_ENV, raising=False)
    r, pid = random.randrange(1, 64), random.randrange(2, 10**6)
    gone = [(r, f"pid {pid} on node-b", None), (r + 1, "", None)]
    code = failures.handle(RuntimeError("Connection reset by peer"), 0, lambda reason: None, lambda: gone)
    assert code == 1
    import json

    line = json.load(open(error_file))["message"]["message"]
    assert line.startswith(f"omnitron train: error: rank 0 (pid {os.getpid()}) failed: lost ranks {r}, {r + 1} "
                           f"(pid {pid} on node-b; pid unknown), whose heartbeats stopped"), line
    assert line.endswith("Connection reset by peer"), line


def test_a_peer_that_failed_is_named_with_its_cause():
    """A rank that failed (its last heartbeat ``failed: <line>``) is named first, with its line, over ranks that
    merely went silent after it (killed by their agent)."""
    r = random.randrange(1, 64)
    gone = [(r - 1, "pid 5 on node-b", None), (r, "pid 6 on node-b", "FileNotFoundError: x.idx not found")]
    assert failures.lost_peers(gone) == f"rank {r} (pid 6 on node-b) failed first: FileNotFoundError: x.idx not " \
                                        "found; here: "


def test_the_census_is_not_asked_for_other_failures_or_under_the_launcher(monkeypatch):
    """A rank's own error is its own (no census); under --nproc-per-node the launcher names the rank from the exit
    codes (no 12.5 s census in every rank first)."""
    asked = []
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv(failures.REPORT_DIR_ENV, raising=False)
    failures.handle(ValueError("bad batch"), 1, lambda reason: None, lambda: asked.append(1) or [])
    assert asked == []
    monkeypatch.setenv(failures.REPORT_DIR_ENV, "/nonexistent-omnitron-reports")
    monkeypatch.setattr(failures, "write_report", lambda *a, **k: None)
    failures.handle(RuntimeError("Connection reset by peer"), 1, lambda reason: None, lambda: asked.append(1) or [])
    assert asked == []
    assert failures.lost_peers([]) == ""


@pytest.mark.slow
def test_kill_on_one_node_is_named_on_the_other(tmp_path):
    """Two torchrun agents as two nodes (one rank each, pipeline stages 0 and 1): node 1's rank is killed (-9)
    mid-training; node 0's torchrun report ends with a line naming rank 1 (fails without the census: "Connection
    reset by peer" alone). A 6 s timeout makes the census 1.25 s. About 30 s on 2 cores."""
    port = str(free_port())
    env = {"OMNITRON_DISTRIBUTED_TIMEOUT_S": "6", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    nodes = []
    for node in (0, 1):
        args = ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                "--master-port", port, "--monitor-interval", "0.2", "-m", "omnitron.train",
                *tiny_train_args(tmp_path, "--pipeline-model-parallel-size", "2", "--train-iters",
                                 "100000", "--micro-batch-size", "1", "--global-batch-size", "2")]
        nodes.append(start(args, env, launcher=("-m", "torch.distributed.run")))
    try:
        metrics = str(tmp_path / "logs" / "metrics.jsonl")
        t0 = time.monotonic()
        while not records(metrics):
            assert all(p.poll() is None for p in nodes) and time.monotonic() - t0 < 180, "no training step"
            time.sleep(0.1)
        (worker,) = children(nodes[1].pid)
        os.kill(worker, signal.SIGKILL)
        out = nodes[0].communicate(timeout=120)[0]
    finally:
        for p in nodes:
            p.kill()
            p.wait()
    assert nodes[0].returncode == 1, out[-3000:]
    last = [s.strip() for s in out.splitlines() if s.strip() and set(s.strip()) != {"="}][-1]
    assert last.startswith("traceback : omnitron train: error: rank 0 (pid "), out[-3000:]
    assert f") failed: lost rank 1 (pid {worker} on " in last, last


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not private_mount_works(),
                    reason="needs a mount namespace (unshare -m) to give one node a disk of its own")
def test_a_rank_failing_on_one_node_is_named_with_its_cause_on_the_other(tmp_path):
    """Node 1's --data-cache-path is a read-only directory of its own (a tmpfs in its mount namespace): its rank
    stops, naming the directory, when it builds its node's copy of the demo corpus; node 0's report names rank 1
    and that cause (its last heartbeat), where it said only "Connection closed by peer". About 30 s on 2 cores."""
    cache = tmp_path / "cache"
    cache.mkdir()
    port = str(free_port())
    env = {"OMNITRON_DISTRIBUTED_TIMEOUT_S": "6", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "2", "--num-workers", "0", "--no-tensorboard", "--data-cache-path", str(cache),
            "--log-dir", str(tmp_path / "logs")]  # no --data-path: the bundled corpus, built by rank 0
    nodes = []
    for node in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port,
                "--monitor-interval", "0.2", "-m", "omnitron.train", *args]
        argv = on_own_disk(str(cache), argv, read_only=True) if node == 1 else argv
        nodes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=dict(os.environ, **env)))
    try:
        outs = [p.communicate(timeout=180)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert nodes[0].returncode == 1 and nodes[1].returncode == 1, outs[0][-2000:] + outs[1][-2000:]
    lasts = [[s.strip() for s in out.splitlines() if s.strip() and set(s.strip()) != {"="}][-1] for out in outs]
    assert lasts[1].startswith("traceback : omnitron train: error: rank 1 (pid "), lasts[1]
    cause = lasts[1].split(") stopped: ", 1)[1]
    assert cause.startswith(f"--data-cache-path {cache}: the index caches cannot be written there (Read-only file "
                            f"system: {cache}"), cause
    assert lasts[0].startswith("traceback : omnitron train: error: rank 0 (pid "), lasts[0]
    assert f") failed: rank 1 (pid " in lasts[0] and f" failed first: {cause}; here: " in lasts[0], lasts[0]
