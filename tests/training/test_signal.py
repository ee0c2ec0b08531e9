"""SIGTERM: the run finishes its step, saves a checkpoint and exits 0; --load resumes from it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    save = str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "omnitron", "train", "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--train-iters", "100000",
           "--log-interval", "1", "--save", save, "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache")]
    env = dict(os.environ, OMNITRON_KERNELS="reference")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = os.path.join(save, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    last = [json.loads(line) for line in open(metrics)][-1]["iteration"]
    assert open(os.path.join(save, "latest")).read() == f"iter_{last:07d}", out
    assert "stopping after iteration" in out
