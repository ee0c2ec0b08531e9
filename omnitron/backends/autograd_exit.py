"""Autograd's device thread lets go of the last backward before the interpreter ends.

On a device other than the host, autograd runs a backward on a thread of its own for that device
(``pt_autograd_<i>``), and that thread may drop its last reference to the finished graph task just after the
caller's ``backward()`` has returned. Since torch stashes the caller's ``contextvars`` context in the task's
thread-local state (``torch.autograd.graph._engine_run_backward``), dropping the task takes the GIL. When the
program ends right after a backward, the interpreter may be finalizing by then: taking the GIL ends the thread
with ``pthread_exit`` inside a destructor, and the process aborts with "terminate called without an active
exception" (exit status 134) after its own work is done, so a scheduler sees a failed job (pytorch/pytorch
#117762; seen on sim with torch 2.13 in 5 of 8 runs of a backward-then-exit script).

:func:`drain_at_exit` registers, once per device type, a handler that runs while the interpreter is still
whole (``atexit``): a backward of one element on the current device, queued on that device's thread behind
any earlier task, so the thread has released the earlier task before it takes this one; the backward runs,
on a thread of the handler's, in a context of its own holding a marker object, and the handler waits, GIL
released, until the marker's weak reference dies, which is when the device thread has released this last
task too (all of it at most :data:`WAIT_S`).
"""
from __future__ import annotations

import atexit
import contextvars
import logging
import threading
import time
import weakref
from typing import Callable

import torch

log = logging.getLogger("omnitron.backends")

WAIT_S = 5.0
"""The longest the exit handler waits for the device thread (one stuck in a kernel or collective is not waited
out: the process ends as it would have)."""

_MARK: contextvars.ContextVar = contextvars.ContextVar("omnitron_autograd_exit")
_registered: set[str] = set()


class _Marker:
    """Lives exactly as long as the context copy a backward's graph task holds."""


def drain_at_exit(device_type: str, current_device: Callable[[], torch.device],
                  in_use: Callable[[], bool] = lambda: True) -> None:
    """Register the exit handler for ``device_type`` (once per process). ``current_device`` gives the device to
    drain at exit; ``in_use`` says whether the device was started at all (nothing is run on one that was not)."""
    if device_type in _registered:
        return
    _registered.add(device_type)
    atexit.register(_drain, current_device, in_use)


def _drain(current_device: Callable[[], torch.device], in_use: Callable[[], bool]) -> None:
    try:
        if not in_use():
            return
        device = current_device()
    except Exception as err:  # a device that failed is not drained: the process is ending either way
        log.debug("autograd device thread not drained at exit: %s", err)
        return
    marker = _Marker()
    gone = weakref.ref(marker)
    # on a thread of its own, so a device thread stuck in a hung kernel or collective cannot hold the exit
    runner = threading.Thread(target=contextvars.Context().run, args=(_backward, marker, device), daemon=True,
                              name="omnitron-autograd-exit")
    runner.start()
    del marker  # the context copy the graph task holds keeps it alive until the device thread drops the task
    deadline = time.monotonic() + WAIT_S
    runner.join(WAIT_S)
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL the device thread needs


def _backward(marker: _Marker, device: torch.device) -> None:
    try:
        _MARK.set(marker)
        x = torch.ones((), device=device, requires_grad=True)
        (x * 2.0).backward()
    except Exception as err:
        log.debug("autograd device thread not drained at exit: %s", err)
