"""Fault-injection helpers for the fault-tolerance tests and ``benchmarks/faults.py``: a tiny training
command, the worker processes of a launcher (from /proc, Linux), waiting for progress and for processes
to be gone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time


class DictStore(dict):
    """The rendezvous-store calls the watchdog makes (``set``, ``get``, ``check``), on a dict: its heartbeat and
    census logic in one process, without a store server."""

    def set(self, k, v):
        self[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self[k]

    def check(self, keys):
        return all(k in self for k in keys)


def tiny_train_args(tmp_path, *extra: str) -> list[str]:
    """A 2-layer GPT on mock data, logging every step into ``tmp_path/ck``'s metrics."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100",
            "--num-workers", "0", "--log-interval", "1", "--no-tensorboard", "--data-cache-path",
            os.path.join(str(tmp_path), "cache"), "--log-dir", os.path.join(str(tmp_path), "logs"), *extra]


def start(args: list[str], env: dict | None = None, launcher: tuple = ("-m", "omnitron", "train")) -> subprocess.Popen:
    """``python -m omnitron train ARGS`` (or another ``launcher``) with merged stdout/stderr."""
    full = dict(os.environ, OMNITRON_KERNELS="reference", **(env or {}))
    return subprocess.Popen([sys.executable, *launcher, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=full)


def signal_when_ready(args: list[str], ready, what: str, wait_s: float, poll_s: float, before=None) -> tuple:
    """Start ``omnitron train ARGS``, poll ``ready(pid)`` every ``poll_s`` up to ``wait_s`` (the assertion names
    ``what`` otherwise), call ``before(pid)`` and send SIGTERM; ``(before's value, exit code, output)``."""
    import signal
    import time

    proc = start(args)
    try:
        deadline = time.monotonic() + wait_s
        while not ready(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, what
            time.sleep(poll_s)
        seen = before(proc.pid) if before is not None else None
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return seen, proc.returncode, out


def children(pid: int) -> list[int]:
    """The worker processes of launcher ``pid``: the ranks its fork server forked (the server is ``pid``'s
    child running multiprocessing's forkserver), or its direct Python children that are not the server (spawned
    ranks, torchrun's workers), never other helper processes."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                table[int(entry)] = (ppid, f.read())
        except (OSError, ValueError, IndexError):
            continue
    servers = {p for p, (ppid, cmd) in table.items() if ppid == pid and b"multiprocessing.forkserver" in cmd}
    # the arguments, not the interpreter: a venv under a folder named omnitron (/tmp/omnitron-oldest-torch/venv)
    # made its resource tracker a rank
    args = {p: cmd.partition(b"\0")[2] for p, (_, cmd) in table.items()}
    return sorted(p for p, (ppid, cmd) in table.items()
                  if ppid in servers
                  or (ppid == pid and p not in servers and (b"spawn_main" in args[p] or b"omnitron" in args[p])))


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until every pid is gone; raises AssertionError after ``timeout_s``."""
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        assert time.monotonic() - t0 < timeout_s, f"still alive after {timeout_s} s: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)
    return time.monotonic() - t0


def records(metrics: str) -> list[dict]:
    """The training records of a metrics.jsonl (complete lines only)."""
    if not os.path.exists(metrics):
        return []
    with open(metrics) as f:
        lines = f.read().split("\n")[:-1]
    return [r for r in (json.loads(line) for line in lines if line.strip()) if "lm_loss" in r]


def wait_for_iteration(metrics: str, iteration: int, proc: subprocess.Popen, timeout_s: float = 180.0) -> list[dict]:
    """Poll ``metrics`` until it holds ``iteration``; the records then. Fails if ``proc`` ends first."""
    t0 = time.monotonic()
    while True:
        recs = records(metrics)
        if recs and recs[-1]["iteration"] >= iteration:
            return recs
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before iteration {iteration}:\n"
                                 f"{proc.stdout.read()}")
        assert time.monotonic() - t0 < timeout_s, f"no iteration {iteration} after {timeout_s} s"
        time.sleep(0.02)


def private_mount_works() -> bool:
    """Whether this process may make a mount namespace (``unshare -m``: root, or a user namespace), in which a
    path can be given a disk of its own, as a node-local disk on another node."""
    try:
        return subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def on_own_disk(path: str, argv: list[str], read_only: bool = False) -> list[str]:
    """``argv`` run in a mount namespace where ``path`` (an existing directory) is an empty tmpfs: a "node" whose
    ``path`` is its own local directory, not the one the other processes see (``read_only``: one it cannot write)."""
    options = "-o ro " if read_only else ""
    return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs {options}tmpfs "{path}" && exec "$@"', "sh", *argv]
