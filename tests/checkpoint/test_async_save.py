"""--async-save under a kill: ``omnitron train --nproc-per-node 2`` (tp2, torch_dist, a save every
iteration) is killed while the background write of iteration 2 is in flight -- its data files are on
disk, the write is held open by a test hook (a ``sitecustomize`` on the workers' path that delays
DCP's FileSystemWriter for that iteration) -- and the training step has gone on to iteration 3.
``latest`` must still name iteration 1, which reads back; a resume from it (no hook) logs iteration 2's
loss exactly as the killed run did (same layout: RNG streams restored) and commits over the stale
``iter_0000002.tmp``."""
from __future__ import annotations

import os
import signal
import time

from omnitron.testing.faults import children, records, start, tiny_train_args, wait_for_iteration, wait_gone

HOOK = '''
import time
from torch.distributed.checkpoint import filesystem

_write = filesystem.FileSystemWriter.write_data


def _slow(self, plan, planner):
    out = _write(self, plan, planner)  # the data file is complete; hold the write open (test hook)
    if "iter_0000002" in str(self.path):
        time.sleep(600)
    return out


filesystem.FileSystemWriter.write_data = _slow
'''


def _args(tmp_path, logs: str, *extra: str) -> list[str]:
    args = tiny_train_args(tmp_path, "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--ckpt-format",
                           "torch_dist", "--async-save", "--save-interval", "1", "--save", str(tmp_path / "ck"),
                           "--seed", "3", *extra)
    return [a if a != os.path.join(str(tmp_path), "logs") else os.path.join(str(tmp_path), logs) for a in args]


def _wait_for(cond, proc, timeout_s: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() - t0 < timeout_s, "timed out"
        time.sleep(0.05)


def test_kill_during_background_write_keeps_the_previous_latest(tmp_path):
    from omnitron.core.checkpoint import find_latest, read_metadata
    from omnitron.core.checkpoint.reshard import read_full_state

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    proc = start(_args(tmp_path, "logs", "--train-iters", "100000"), env={"PYTHONPATH": path})
    ck, pending = tmp_path / "ck", tmp_path / "ck" / "iter_0000002.tmp"
    try:
        wait_for_iteration(str(tmp_path / "logs" / "metrics.jsonl"), 3, proc)
        _wait_for(lambda: all((pending / f"__{r}_0.distcp").exists() for r in range(2)), proc)
        assert (ck / "latest").read_text() == "iter_0000001"  # the step went on; iteration 2 is not committed
    finally:
        workers = children(proc.pid)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_gone(workers, 30)
    killed = {r["iteration"]: r["lm_loss"] for r in records(str(tmp_path / "logs" / "metrics.jsonl"))}
    assert (ck / "latest").read_text() == "iter_0000001"
    assert not (ck / "iter_0000002").exists() and not (pending / "metadata.json").exists()
    latest = find_latest(str(ck))
    assert latest.endswith("iter_0000001") and read_metadata(latest)["iteration"] == 1
    assert read_full_state(latest).model  # every checksum verified, every tensor read

    resumed = start(_args(tmp_path, "logs2", "--train-iters", "2", "--load", str(ck),
                          "--use-checkpoint-opt_param-scheduler"))
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from" in out and "iteration 1" in out, out
    again = {r["iteration"]: r["lm_loss"] for r in records(str(tmp_path / "logs2" / "metrics.jsonl"))}
    assert list(again) == [2] and again[2] == killed[2], (again, killed)
    assert (ck / "latest").read_text() == "iter_0000002" and not pending.exists()
    assert read_metadata(find_latest(str(ck)))["iteration"] == 2
