"""The watchdog's decisions on one process, without a job: whom its census names, whom a step past its deadline
blames, that a peer whose last heartbeat says it failed is not reported frozen, and that a collective's timeout
leaves the watchdog the time it needs to name the rank at fault first. A store is a dict (``DictStore``)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from omnitron.core.training.watchdog import Watchdog, collective_timeout_s, heartbeat_interval
from omnitron.testing.faults import DictStore


class _Recorder(Watchdog):
    """A watchdog whose firing is recorded instead of ending the process."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.fired = []

    def fire(self, reason, suspect=None, publish=True, kind="watchdog"):
        self.fired.append((reason, suspect))


def test_census_names_the_silent_and_the_failed_not_the_finished_or_the_beating():
    """Rank 0's census over five ranks: rank 1 beats on, rank 2 finished (``done``), rank 3's counter stopped,
    rank 4's last heartbeat says it failed. Only 3 (silent, no line) and 4 (with its line) are named."""
    store = DictStore({"hb/1": b"1", "hb/2": b"done", "hb/3": b"5", "hb/4": b"failed: OSError: disk full",
                        "info/3": b"pid 33 on b", "info/4": b"pid 44 on b"})
    stop = threading.Event()

    def beat():
        n = 1
        while not stop.wait(0.01):
            n += 1
            store.set("hb/1", str(n))

    threading.Thread(target=beat, daemon=True).start()
    try:
        gone = Watchdog(0, 5, 10.0, lambda: store, interval_s=0.05)._census()
    finally:
        stop.set()
    assert sorted(gone) == [(3, "pid 33 on b", None), (4, "pid 44 on b", "OSError: disk full")], gone


def test_a_step_past_its_deadline_blames_the_rank_that_failed_over_one_gone_silent():
    """A rank that failed is the cause; the ranks silent after it were stopped by it (or their agent): the step's
    verdict names the failed one with its line, whatever order the census lists them in."""
    wd = Watchdog(0, 4, 2.0, lambda: DictStore(), interval_s=0.1)
    wd._census = lambda: [(2, "pid 5 on b", None), (3, "pid 6 on b", "ValueError: bad batch")]
    now = time.monotonic()
    wd._phase = ("iteration 9", now - 5.0)
    reason, suspect = wd._verdict(now)
    assert suspect == 3, reason
    assert re.match(r"rank 3 \(pid 6 on b\) failed: ValueError: bad batch; iteration 9 has not finished after 5 s",
                    reason), reason


def test_a_watched_peer_that_failed_is_not_reported_frozen():
    """The watched peer's last heartbeat is ``failed: <line>`` and never moves again: it finished (badly) and
    names itself, so its watcher does not fire a "frozen" verdict on it over the timeout (a peer whose counter
    merely stops is fired on within this window: test_faults.py's between-steps test)."""
    store = DictStore({"hb/1": b"failed: ValueError: bad batch", "info/1": b"pid 42 on host"})
    timeout, interval = 1.0, 0.1
    wd = _Recorder(0, 2, timeout, lambda: store, interval_s=interval).start()
    time.sleep(timeout + 15 * interval)
    wd.stop()
    assert wd.fired == []


@pytest.mark.parametrize("timeout", [1.5, 12.0, 60.0, 600.0])
def test_collective_timeout_outlasts_the_watchdogs_longest_verdict(timeout):
    """The longest a stuck step takes to be named by the watchdog, from its deadline: the monitor looks every half
    interval (up to 0.5 interval late), then the census runs in a thread joined within 3 intervals + 2 s. A
    collective's own timeout at or under that would fire first and blame itself, not the rank at fault."""
    interval = heartbeat_interval(timeout)
    assert collective_timeout_s(timeout) > timeout + 0.5 * interval + 3 * interval + 2.0


def test_a_watched_peer_is_named_frozen_once_silent_for_the_timeout_not_before():
    """The rule the module states: the watched peer (rank + 1) is fired on once its counter has not moved for the
    timeout, measured between this rank's own reads. Decided on the recorded times alone (no threads, no clock):
    at a random timeout, silence 5% over it fires naming the peer, 5% under it does not, nor does any silence of a
    peer whose last heartbeat says it finished."""
    import random

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    timeout = rng.uniform(1.0, 600.0)
    wd = Watchdog(2, 3, timeout, lambda: DictStore(), interval_s=heartbeat_interval(timeout))
    wd._peer_info, wd._peer_seen = "pid 42 on host", 1000.0
    for factor, fires in ((1.05, True), (0.95, False)):
        wd._peer_read = wd._peer_seen + factor * timeout
        verdict = wd._verdict(wd._peer_read)
        assert (verdict is not None) is fires, (seed, factor, verdict)
        if fires:
            assert verdict[1] == 0 and verdict[0].startswith("rank 0 (pid 42 on host) sent no heartbeat"), verdict
    wd._peer_done, wd._peer_read = True, wd._peer_seen + 10 * timeout
    assert wd._verdict(wd._peer_read) is None, seed
