"""The multi-rank harness's own bounds (``omnitron.testing.distributed.run_distributed``): ``timeout_s`` is one
deadline for the whole run, and a worker whose device is wedged (``device_wedged``) ends its process as soon as its
result is written. Both were time the suite waited out: a hung rank was waited for once per rank, and a planted
deadlock's processes lived on for seconds after reporting."""
from __future__ import annotations

import threading
import time

import pytest

from omnitron.testing.distributed import device_wedged, run_distributed, run_forked

pytestmark = pytest.mark.multiprocess

LINGER_S = 30.0
"""How long a worker's leftover non-daemon thread runs (a normal process end waits for it)."""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _hang() -> None:
    time.sleep(600)


def _wedged_with_a_lingering_thread() -> int:
    """Reports its rank at once but leaves a non-daemon thread running for LINGER_S, as a stuck communicator's
    teardown would hold the process; the device is marked wedged, so the worker must not wait for it."""
    threading.Thread(target=time.sleep, args=(LINGER_S,)).start()
    device_wedged()
    return _rank()


def _wedged_ended_early_by_its_own_timer() -> int:
    """Rank 0 is marked wedged and ends itself 1 s later (as a failed case's exit timer does, sim's
    ``_exit_soon``); rank 1 reports 3 s after it: rank 0's result must already be written when its timer fires."""
    import os

    device_wedged()
    if _rank() == 0:
        threading.Timer(1.0, os._exit, (0,)).start()
    else:
        time.sleep(3.0)
    return _rank()


def _child(path: str, signum: int) -> None:
    """Writes what the child sees (an env variable, torch's threads), then ends by ``signum`` (0: returns)."""
    import os

    import torch

    with open(path, "w") as f:
        f.write(f"{os.environ.get('OMNITRON_TEST_PROBE')} {torch.get_num_threads()}")
    if signum:
        os.kill(os.getpid(), signum)


def _fails() -> None:
    raise ValueError("planted in the child")


@pytest.fixture(scope="module")
def warm():
    """The fork server started (its first start imports torch: seconds on a loaded machine, not under test)."""
    assert run_distributed(_rank, 2, timeout_s=120) == [0, 1]


def test_timeout_bounds_the_whole_run(warm):
    # 4 hung ranks, timeout 2 s: one deadline ends the run after ~2 s plus the kills (well under 1 s each); a
    # join of 2 s per rank took >= 4 x 2 = 8 s. 6 s leaves 4 s for forking and killing on a loaded 2-core machine.
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_distributed(_hang, 4, timeout_s=2)
    took = time.monotonic() - start
    assert all(f"rank {r}: no result (exit code None, hung)" in str(err.value) for r in range(4)), str(err.value)
    assert took < 6.0, took


def test_a_wedged_worker_ends_once_its_result_is_written(warm):
    # each worker's leftover thread runs LINGER_S = 30 s, which a normal process end waits for; the wedged worker
    # exits right after writing its result, so the run takes its start-up and the store barrier: < 15 s even loaded
    start = time.monotonic()
    assert run_distributed(_wedged_with_a_lingering_thread, 2, timeout_s=120) == [0, 1]
    took = time.monotonic() - start
    assert took < LINGER_S / 2, took


def test_a_wedged_worker_ended_while_it_waits_for_its_peers_has_reported(warm):
    # the result is written before the store barrier: before, rank 0 died in it and read "no result (exit code 0)"
    assert run_distributed(_wedged_ended_early_by_its_own_timer, 2, timeout_s=120) == [0, 1]


def test_run_forked_reports_the_exit_the_environment_and_errors(warm, tmp_path):
    """``run_forked`` (a test's planted kill in a process forked from the fork server): the exit code, negative for
    the signal that ended the child; the caller's environment (with ``env`` over it) and torch threads there; an
    exception in the child raised here with its traceback; a child past ``timeout_s`` killed and named."""
    import signal

    import torch

    out = tmp_path / "seen"
    assert run_forked(_child, str(out), int(signal.SIGKILL), env={"OMNITRON_TEST_PROBE": "x"}) == -signal.SIGKILL
    assert out.read_text() == f"x {torch.get_num_threads()}"
    assert run_forked(_child, str(out), 0) == 0 and out.read_text().startswith("None ")
    with pytest.raises(RuntimeError, match="(?s)_fails failed in its process.*ValueError: planted in the child"):
        run_forked(_fails)
    with pytest.raises(RuntimeError, match="_hang: still running after 1 s"):
        run_forked(_hang, timeout_s=1)
