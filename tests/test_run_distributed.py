"""The multi-rank harness's own bounds (``omnitron.testing.distributed.run_distributed``): ``timeout_s`` is one
deadline for the whole run, and a worker whose device is wedged (``device_wedged``) ends its process as soon as its
result is written. Both were time the suite waited out: a hung rank was waited for once per rank, and a planted
deadlock's processes lived on for seconds after reporting."""
from __future__ import annotations

import threading
import time

import pytest

from omnitron.testing.distributed import device_wedged, run_distributed

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
