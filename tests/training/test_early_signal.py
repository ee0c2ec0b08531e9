"""A stop signal in the launcher's first moments (imports, parsing, checks: before any rank or relay exists)
gives the line and exit code a start-up signal gives later: the job stops before its first iteration, exit 0."""
from __future__ import annotations

import os
import signal

import pytest


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` of /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _torch_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_sigterm_before_the_launcher_imports_torch_stops_cleanly(tmp_path, nproc):
    """SIGTERM sent the moment the launcher catches it, which must be before torch is loaded (the seconds of a
    job's start). Fails without the fix: the launcher caught SIGTERM only once a rank or its relay was installed,
    after torch, parsing and the checks; a SIGTERM before that killed it with -15 and no message."""
    from omnitron.testing.faults import records, signal_when_ready, tiny_train_args

    args = tiny_train_args(tmp_path, "--train-iters", "40", "--nproc-per-node", nproc, "--save", str(tmp_path / "ck"))
    torch_loaded, returncode, out = signal_when_ready(args, _catches_sigterm, "the launcher never caught SIGTERM",
                                                      wait_s=60, poll_s=0.001, before=_torch_loaded)
    early = not torch_loaded
    assert early, "the launcher's SIGTERM handler came only after torch was loaded"
    assert returncode == 0, out
    assert "SIGTERM received: stopping after this iteration" in out, out
    assert "stopping before iteration 1: a stop signal arrived during start-up" in out, out
    assert records(str(tmp_path / "logs" / "metrics.jsonl")) == [], out
    assert not os.path.exists(tmp_path / "ck" / "latest"), out
