"""Hang watchdog: nothing waits forever on a frozen, dead or deadlocked peer.

Each rank runs two daemon threads from the moment its process group exists:

- a *heartbeat* thread that, every ``interval`` seconds, bumps this rank's counter in the rendezvous store
  (a client connection of its own), reads the counter of the next rank (``rank + 1`` mod world: every rank
  is watched by one other, O(world) store traffic) and polls the job's ``abort`` key;
- a *monitor* thread that does no I/O and fires when the training step (or validation) under
  :meth:`Watchdog.deadline` has run longer than the timeout, when the watched rank's counter has not
  moved for the timeout (between this rank's own reads of it), when a store call has not returned for the
  timeout (the host of the store, the launcher or torchrun's agent, frozen or gone; store calls cannot be
  relied on to time out: it is named, not the neighbours it hides), or when another rank published ``abort``.

Firing publishes ``abort`` (so every reachable rank stops within one interval), dumps every Python thread's
stack (faulthandler) and the last collectives of the flight recorder
(``omnitron.backends.collectives.flight_recorder_dump`` where the build has one), writes the launcher's
failure report and exits with :data:`EXIT_CODE`. This works on any backend, including p2p waits, which
gloo never times out; collectives additionally carry the process-group timeout, a little longer
(:func:`collective_timeout_s`), so the watchdog, which names the rank at fault, stops a hung job first.
A rank that finishes writes ``done`` as its last heartbeat, so its watcher stops watching it.
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time

from omnitron.core.training import failures

EXIT_CODE = 75
"""Exit status of a rank stopped by the watchdog (EX_TEMPFAIL: an elastic restart may succeed)."""
STORE_KIND = "store"
"""Failure-report kind of a rank that stopped because the rendezvous store stopped answering."""
TIMEOUT_ENV = "OMNITRON_DISTRIBUTED_TIMEOUT_S"
"""Seconds, overriding --distributed-timeout-minutes (tests use a few seconds; minutes are too coarse)."""


def distributed_timeout_s(minutes: float) -> float:
    """The collective / watchdog timeout in seconds: ``$OMNITRON_DISTRIBUTED_TIMEOUT_S`` if set, else the flag."""
    env = os.environ.get(TIMEOUT_ENV)
    return float(env) if env else float(minutes) * 60.0


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a twelfth of the timeout, between 0.2 s and 5 s."""
    return min(5.0, max(0.2, timeout_s / 12.0))


def collective_timeout_s(timeout_s: float) -> float:
    """The process group's timeout under a watchdog of ``timeout_s``: that limit plus what the watchdog takes to
    name the rank at fault and stop (a check every half interval, the census of silent ranks: 2.5 intervals,
    joined within 3 intervals + 2 s, then the dump). With the same value, a rank blocked in a collective on a
    frozen peer could raise the collective's own timeout first and be reported as the failure, the frozen peer
    second (seen once in a loaded test run, 2026-12-05)."""
    return timeout_s + 4 * heartbeat_interval(timeout_s) + 3.0


def dump_state(reason: str, rank: int, out=None) -> None:
    """Print ``reason``, every Python thread's stack and the flight recorder's last collectives to stderr
    (or ``out``). The dump is composed whole, then written in one piece during this rank's turn
    (:func:`_stderr_turn`), so the dumps of ranks that fire together never interleave line by line."""
    text = dump_text(reason, rank)
    fd = _fileno(out or sys.stderr)
    if fd is None:
        (out or sys.stderr).write(text)
        (out or sys.stderr).flush()
        return
    (out or sys.stderr).flush()
    with _stderr_turn():
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]


def dump_text(reason: str, rank: int) -> str:
    """The dump of :func:`dump_state` as one string (faulthandler writes to a file descriptor: a temporary file)."""
    head = (f"[omnitron watchdog] rank {rank} (pid {os.getpid()}): {reason}\n"
            f"[omnitron watchdog] rank {rank}: Python stacks of every thread:\n")
    with tempfile.TemporaryFile("w+") as f:
        try:
            faulthandler.dump_traceback(file=f, all_threads=True)
        except (ValueError, OSError, AttributeError):
            pass
        f.seek(0)
        stacks = f.read()
    from omnitron.backends import collectives

    recorder = getattr(collectives, "flight_recorder_dump", None)
    lines = recorder() if recorder is not None else None
    if lines is None:
        tail = (f"[omnitron watchdog] rank {rank}: this build has no collective flight recorder; the stacks above "
                f"show where each thread waits\n")
    else:
        tail = "".join([f"[omnitron watchdog] rank {rank}: last collectives (flight recorder, oldest first):\n",
                        *(f"  {line}\n" for line in lines)])
    return head + stacks + tail


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, ValueError, OSError):  # pytest's capture, a StringIO
        return None


@contextlib.contextmanager
def _stderr_turn(wait_s: float = 5.0):
    """Hold a lock shared by the job's ranks on this host while writing a dump (the launcher's report folder,
    else one file per user in the temporary folder); after ``wait_s`` (a holder frozen mid-write) write anyway."""
    import fcntl

    folder = os.environ.get(failures.REPORT_DIR_ENV)
    path = os.path.join(folder, "stderr.lock") if folder else \
        os.path.join(tempfile.gettempdir(), f"omnitron-stderr-{os.getuid()}.lock")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield
        return
    try:
        give_up = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > give_up:
                    break
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)


def _frozen(rank: int, info: str, seconds: str) -> str:
    return (f"rank {rank} ({info or 'pid unknown'}) sent no heartbeat for {seconds} s: it is frozen (SIGSTOP, a "
            f"debugger, swapping) or its host is unreachable")


class NullWatchdog:
    """The one-process stand-in: no deadlines, nothing to stop."""

    def deadline(self, what: str):
        return contextlib.nullcontext()

    def dump(self, reason: str) -> None:
        """Nothing to dump without peers."""

    def silent_ranks(self) -> list[tuple[int, str, str | None]]:
        """No peers, none silent."""
        return []

    def stop(self, failure: str | None = None) -> None:
        """Nothing runs."""


class Watchdog(NullWatchdog):
    """This rank's heartbeat and deadline threads (see the module docstring).

    ``connect``: returns a fresh store client (the heartbeat thread's own connection, with the process
    group's key prefix); ``timeout_s``: the limit for a step, a silent peer and a silent store."""

    def __init__(self, rank: int, world: int, timeout_s: float, connect, interval_s: float | None = None) -> None:
        self.rank, self.world, self.timeout = rank, world, float(timeout_s)
        self.interval = interval_s or heartbeat_interval(self.timeout)
        self._connect, self._peer = connect, (rank + 1) % world
        self._phase: tuple[str, float] | None = None
        self._stop, self._fired = threading.Event(), threading.Lock()
        self._peer_seen = self._peer_read = time.monotonic()
        self._calling: float | None = None  # when the heartbeat's round of store calls in flight began
        self._peer_done, self._peer_info, self._abort, self._final = False, "", None, "done"
        self._threads = [threading.Thread(target=self._guard, args=(fn,), name=f"omnitron-watchdog-{fn.__name__}",
                                          daemon=True) for fn in (self._heartbeat, self._monitor)]

    def start(self) -> Watchdog:
        for t in self._threads:
            t.start()
        return self

    @contextlib.contextmanager
    def deadline(self, what: str):
        """Fire when the block (a training step, a validation) runs longer than the timeout."""
        self._phase = (what, time.monotonic())
        try:
            yield
        finally:
            self._phase = None

    def dump(self, reason: str) -> None:
        dump_state(reason, self.rank)

    def silent_ranks(self) -> list[tuple[int, str, str | None]]:
        """``(rank, "pid P on HOST", failure)`` of the ranks whose heartbeat stopped, not finished (the census: 2.5
        heartbeat intervals, 12.5 s at the default timeout), ``failure`` the line of a rank that failed (its last
        heartbeat, :meth:`stop`), else None: after a transport error, the peers that are gone and why."""
        return self._census()

    def stop(self, failure: str | None = None) -> None:
        """Write ``done`` (or ``failed: <failure>``, this rank's own fault) as the last heartbeat and end both
        threads (a clean exit is not a silent rank; a failed one is named by the peers that lose it)."""
        self._final = f"failed: {failure}" if failure else "done"
        self._phase = None
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.interval + 2.0)

    # ---- threads ---------------------------------------------------------------------------
    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a broken store connection is itself the fault
            if not self._stop.is_set():
                self.fire(f"the rendezvous store failed ({type(err).__name__}: {str(err).splitlines()[0][:160]}): "
                          f"the launcher or torchrun agent that hosts it is gone", kind=STORE_KIND)

    def _heartbeat(self) -> None:
        self._calling = time.monotonic()
        store = self._connect()
        store.set(f"info/{self.rank}", f"pid {os.getpid()} on {socket.gethostname()}")
        self._calling = None
        count, last = 0, None
        peer_key, info_key = f"hb/{self._peer}", f"info/{self._peer}"
        while not self._stop.wait(self.interval):
            count += 1
            self._calling = time.monotonic()
            store.set(f"hb/{self.rank}", str(count))
            value = store.get(peer_key) if store.check([peer_key]) else None
            read = time.monotonic()
            if value != last:
                last, self._peer_seen = value, read
            # a peer that finished, or failed (it names itself; the census names it to the ranks that lose it)
            self._peer_read, self._peer_done = read, value == b"done" or (value or b"").startswith(b"failed: ")
            if not self._peer_info and store.check([info_key]):
                self._peer_info = store.get(info_key).decode()
            if store.check(["abort"]):
                self._abort = json.loads(store.get("abort").decode())
            self._calling = None
        store.set(f"hb/{self.rank}", self._final)

    def _monitor(self) -> None:
        while not self._stop.wait(self.interval / 2):
            verdict = self._verdict(time.monotonic())
            if verdict is not None:
                self.fire(*verdict)

    def _verdict(self, now: float) -> tuple | None:
        """``fire``'s arguments when this rank must stop now, else None. NOTE: a peer's silence is measured
        between this rank's own successful reads of its heartbeat, and the store is judged by a round of calls
        that does not return: a frozen store (its host, the launcher or torchrun's agent) stops every read and
        would otherwise get a healthy neighbour blamed (and a heartbeat thread starved by the load, no one)."""
        phase, calling = self._phase, self._calling
        stuck = 0.0 if calling is None else now - calling  # seconds inside one round of store calls
        if self._abort is not None:
            a = self._abort
            return f"stopping because rank {a['rank']} gave up: {a['reason']}", a.get("suspect"), False
        if stuck > self.timeout + self.interval:
            return (f"the rendezvous store has not answered for {stuck:.0f} s: the launcher or torchrun agent "
                    f"that hosts it is frozen or gone", None, True, STORE_KIND)
        if phase is not None and now - phase[1] > self.timeout and stuck <= max(self.timeout / 2, 3 * self.interval):
            waited = f"{phase[0]} has not finished after {now - phase[1]:.0f} s"
            gone = self._census()  # a rank that failed or went silent, if there is one, is the cause: name it
            failed, stale = [g for g in gone if g[2]], [g for g in gone if g[2] is None]
            if failed:
                return f"rank {failed[0][0]} ({failed[0][1]}) failed: {failed[0][2]}; {waited}", failed[0][0]
            if stale:
                return _frozen(stale[0][0], stale[0][1], f"{2.5 * self.interval:.1f}") + f"; {waited}", stale[0][0]
            return (f"{waited} (a collective or p2p transfer that never completes; limit "
                    f"--distributed-timeout-minutes)",)
        silent = self._peer_read - self._peer_seen
        if not self._peer_done and silent > self.timeout:
            return _frozen(self._peer, self._peer_info, f"{silent:.0f}"), self._peer
        return None

    def _census(self) -> list[tuple[int, str, str | None]]:
        """``(rank, info, failure)`` of the ranks whose heartbeat did not move over 2.5 intervals (failure None) or
        whose last one says they failed (read in a helper thread: the store may be what hangs)."""
        found: list[tuple[int, str, str | None]] = []

        def run() -> None:
            store = self._connect()
            keys = [f"hb/{r}" for r in range(self.world)]
            before = [store.get(k) if store.check([k]) else None for k in keys]
            time.sleep(2.5 * self.interval)
            after = [store.get(k) if store.check([k]) else None for k in keys]
            for r in range(self.world):
                failed = after[r] is not None and after[r].startswith(b"failed: ")
                if r != self.rank and (failed or (before[r] == after[r] and after[r] != b"done")):
                    info = store.get(f"info/{r}").decode() if store.check([f"info/{r}"]) else ""
                    found.append((r, info, after[r].decode()[len("failed: "):] if failed else None))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout=3 * self.interval + 2.0)
        return list(found)

    # ---- firing ----------------------------------------------------------------------------
    def fire(self, reason: str, suspect: int | None = None, publish: bool = True, kind: str = "watchdog") -> None:
        """Publish ``abort``, dump stacks and the flight recorder, report (as ``kind``: :data:`STORE_KIND` when
        the store stopped answering), exit (once, from any thread)."""
        if not self._fired.acquire(blocking=False):
            return
        if publish:  # best effort: the store may be the thing that is frozen
            payload = json.dumps({"rank": self.rank, "reason": reason, "suspect": suspect})
            t = threading.Thread(target=lambda: self._connect().set("abort", payload), daemon=True)
            t.start()
            t.join(timeout=2.0)
        self.dump(reason)
        failures.write_report(self.rank, kind, reason, suspect=suspect)
        failures.write_elastic_report(self.rank, kind, reason)
        sys.stderr.flush()
        os._exit(EXIT_CODE)
