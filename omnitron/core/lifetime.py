"""Processes that never outlive the process that started them (training ranks, data-loader and
preprocessing workers).

:func:`die_with_parent`: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ctypes)
plus a daemon thread that polls the parent pid once a second (other systems, and the instant before prctl
takes effect), so a ``kill -9`` of a launcher, of torchrun's agent or of a rank leaves nothing running on.
NOTE: Linux sends the signal when the *thread* that forked the child exits; every worker here is started
from its parent's main thread.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
POLL_S = 1.0
"""Seconds between the watch thread's checks of the parent pid (the fallback where prctl is missing)."""


def die_with_parent(parent_pid: int) -> None:
    """Kill this process (SIGKILL) as soon as ``parent_pid`` is no longer its parent."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent_pid:  # gone already, before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="omnitron-parent-watch", daemon=True).start()


def die_with(pid: int) -> None:
    """Kill this process (SIGKILL) once process ``pid`` (not this one's parent: a grandparent, such as the
    launcher of a rank forked by its fork server) no longer exists; at once if it is gone already. Polled
    every POLL_S by a daemon thread: the parent's own end may come later (the fork server finalises torch
    before it exits, seconds on a loaded machine)."""

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, owned by another user
            return False
        return False

    def watch() -> None:
        while not gone():
            time.sleep(POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    if gone():
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="omnitron-launcher-watch", daemon=True).start()


def tie_worker(parent_pid: int, worker_id: int) -> None:
    """A DataLoader ``worker_init_fn`` (as ``functools.partial(tie_worker, os.getpid())``, made in the parent):
    worker ``worker_id`` dies with ``parent_pid``, in a process group of its own. NOTE: torchrun stops a rank
    with SIGTERM to the rank's whole process group, and a terminal's Ctrl-C reaches the whole foreground
    group; workers dying of it first made the rank (which finishes its step and saves on those signals) fail
    with torch's "DataLoader worker ... killed by signal" and a long traceback. Out of the group, the workers
    are ended by the rank (its loader's shutdown, or its death). Ignoring the signals instead would not do:
    multiprocessing ends daemonic children at exit with SIGTERM and then waits for them. A scheduler that signals
    every process of the job by pid (SLURM's scancel and time limit) still reaches the workers: only their
    rank's stop signals end them (:func:`_stop_only_from`)."""
    if hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
    _stop_only_from(parent_pid)
    die_with_parent(parent_pid)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals a rank may stop on (SIGUSR1 / SIGUSR2 under --exit-signal)."""


@contextlib.contextmanager
def stop_signals_blocked():
    """STOP_SIGNALS blocked in this thread for the block (one that comes meanwhile waits, then acts): around the
    start of data-loader workers, so that each of their threads starts with them blocked (:func:`_stop_only_from`;
    a worker's native threads start before its ``worker_init_fn`` runs)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stop_only_from(parent_pid: int) -> None:
    """STOP_SIGNALS end this worker only when ``parent_pid`` sends them (the rank shutting its loader down:
    torch's, and multiprocessing's at exit) or the parent is gone; from anyone else they are dropped. NOTE: SLURM
    signals every process of the job, so a worker died of the SIGTERM that the rank takes as "finish the step and
    save", and the rank failed with "DataLoader worker ... killed by signal: Terminated" instead (no checkpoint).
    The signals are blocked (in every thread: the worker starts inside :func:`stop_signals_blocked`) and taken by
    a thread whose ``sigwaitinfo`` names the sender; torch's own handler in the worker never sees them. A dropped
    signal is harmless: the rank stops its workers, and SIGKILL ends a stuck job."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_pid == parent_pid or os.getppid() != parent_pid:
                os._exit(0)  # as torch's worker handler does on its parent's SIGTERM

    threading.Thread(target=take, name="omnitron-loader-stop", daemon=True).start()
