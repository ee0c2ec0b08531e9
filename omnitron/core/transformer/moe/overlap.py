"""One micro-batch's forward and another's backward in turns (``--overlap-moe-expert-parallel-comm``).

Megatron's combined 1F1B: in the steady state of the schedule a forward and an independent backward run as
one action, handing over at each expert-parallel all-to-all, so that one's dispatch or combine (or their
backward all-to-alls) is in flight while the other computes attention, router or experts.

A forward is *steps* (a generator that yields with an all-to-all issued and waits for it on resumption; its
return value is the forward's result); :func:`drive` runs them, handing over at each yield. A backward is one
``torch.autograd.backward`` call, unchanged: its all-to-alls (``dispatch.py``) issue, :func:`handoff`, then wait.
:func:`run_combined` runs the backward in a helper thread and the forward on the calling thread, one at a
time (a baton passed by two semaphores, never both running): the backward starts and runs to its first
all-to-all, then each side runs until it has issued its next all-to-all. The order of every collective is
therefore the same on every rank, as NCCL needs, and each pass executes exactly the operations it executes
alone: losses and gradients are bit for bit those of the schedule without the overlap. Outside
:func:`run_combined`, :func:`handoff` does nothing (the all-to-all is waited at once).

The backward runs in the helper thread (or on the autograd engine's device thread, which ``handoff`` handles
alike): thread-local state the forward sets (grad mode, autocast) stays with the forward; the helper thread
takes the caller's accelerator device (thread-local in CUDA-like runtimes: waits would order device 0's stream).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Generator, TypeVar

import torch

T = TypeVar("T")
Steps = Generator[None, None, T]


class _Aborted(RuntimeError):
    """Raised inside a paused backward when its forward failed (so the helper thread ends)."""


def _caller_device() -> Callable[[], None]:
    """What makes a new thread's current accelerator device the calling thread's (nothing without one)."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return lambda: None
    index = acc.current_device_index()
    return lambda: acc.set_device_index(index)


class _Backward:
    """The backward half of a combined pair: ``fn`` in a helper thread, run in turns with the forward."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn, self.set_device = fn, _caller_device()
        self.go, self.back = threading.Semaphore(0), threading.Semaphore(0)
        self.running = self.done = self.aborted = False  # running: the backward holds the baton
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="omnitron-combined-backward", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        self.go.acquire()
        try:
            if not self.aborted:
                self.set_device()
                self.fn()
        except BaseException as err:  # handed to the forward's thread by resume()
            self.error = err
        finally:
            self.done = True
            self.back.release()

    def resume(self) -> None:
        """Forward's side: let the backward run until it hands over or ends; re-raise its error."""
        if self.done:
            return
        self.running = True
        _note("run", "B")
        self.go.release()
        self.back.acquire()
        self.running = False
        _note("run", "F")
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def pause(self) -> None:
        """Backward's side (whichever thread autograd runs it on): hand the baton to the forward and wait."""
        self.back.release()
        self.go.acquire()
        if self.aborted:
            raise _Aborted("the forward of the combined pair failed")

    def abort(self) -> None:
        """End a backward left paused by a failed forward (its thread raises out of autograd)."""
        self.aborted = True
        while not self.done:
            self.go.release()
            self.back.acquire()
        self.thread.join()


_active: _Backward | None = None
"""The combined pair in progress (at most one per process)."""
_record: list | None = None
"""When a list (:func:`recording`): ``("pair", "start")`` as each pair starts, ``("run", "F" | "B")`` at each hand-over
and ``("issue" | "wait", side, n)`` around each expert-parallel all-to-all, side ``F`` or ``B`` (``n``: the side's count
since recording began)."""
_counts = {"F": 0, "B": 0}


def _note(*event) -> None:
    if _record is not None:
        _record.append(tuple(event))


def note_all_to_all(event: str) -> None:
    """Record ``issue`` / ``wait`` of an all-to-all by the side now running (:func:`recording`)."""
    if _record is not None and _active is not None:
        side = "B" if _active.running else "F"
        if event == "issue":
            _counts[side] += 1
        _record.append((event, side, _counts[side]))


@contextlib.contextmanager
def recording():
    """Collect the order of hand-overs and all-to-alls of every combined pair run inside (the overlap tests)."""
    global _record
    _record = []
    _counts.update(F=0, B=0)
    try:
        yield _record
    finally:
        _record = None


def handoff() -> None:
    """At an issued all-to-all: let the other half of the combined pair run (nothing outside a pair)."""
    pair = _active
    if pair is None:
        return
    if pair.running:
        pair.pause()
    else:
        pair.resume()


def run_combined(forward: Callable[[], T], backward: Callable[[], None]) -> T:
    """Run ``forward`` (here) and ``backward`` (helper thread) in turns, handing over at each all-to-all; the
    forward's result once both have ended."""
    global _active
    if _active is not None:
        raise RuntimeError("a combined forward/backward pair is already running")
    pair = _active = _Backward(backward)
    _note("pair", "start")
    try:
        pair.resume()  # the backward first, up to its first all-to-all (Megatron's order)
        out = forward()
        while not pair.done:
            pair.resume()
        return out
    except BaseException:
        pair.abort()
        raise
    finally:
        _active = None


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end, handing over at each yield (an all-to-all in flight); its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
        handoff()
