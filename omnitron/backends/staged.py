"""Host-staged collectives: any backend's device tensors carried over gloo through host copies.

``OMNITRON_COLLECTIVES=host-staged`` swaps a backend's collective layer for this one: each collective
copies its device operands to host tensors, runs the ordinary :class:`Collectives` call on them over
gloo (flight recorder, strict fingerprints and dtype gaps included), and copies results back to the
device when the call completes (at ``wait()`` for asynchronous ones). Two uses:

- several ranks on one device, which NCCL refuses ("duplicate GPU"): the lent single-GPU machine runs
  the multi-rank layouts this way (benchmarks/device_multirank.py);
- a chip whose collective library is not ready yet: everything else of the backend runs for real.

Only the transport differs; it is slow (every byte crosses the host twice) and covers the engine's own
collectives, not torch's internal ones (FSDP2, DCP's device tensors), which need the native library.
"""
from __future__ import annotations

import os
from typing import Sequence

import torch

from omnitron.backends.collectives import Collectives, ReduceOp

ENV_VAR = "OMNITRON_COLLECTIVES"
MODES = ("native", "host-staged")


def _host(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` itself when it is on the host, else a host tensor (a copy of it, or uninitialised)."""
    if t.device.type == "cpu":
        return t
    # device="cpu" named: under torch.set_default_device (the tests' and some users' habit) a bare empty()
    # would land on the device and reach gloo as device memory (on CUDA: "Read error ... Bad address")
    return t.detach().to("cpu") if copy else torch.empty(t.shape, dtype=t.dtype, device="cpu")


class _StagedHandle:
    """Waits for the host collective, then copies its results back to the device tensors."""

    def __init__(self, inner, pairs) -> None:
        self._inner, self._pairs = inner, pairs

    def wait(self) -> None:
        if self._inner is not None:
            self._inner.wait()
            self._inner = None
        for dev, host in self._pairs:
            dev.copy_(host)
        self._pairs = []

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()


class HostStagedCollectives(Collectives):
    """:class:`Collectives` over gloo for tensors on any device (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("gloo", fp8_native=False, device_type="cpu")

    @staticmethod
    def _finish(work, pairs, async_op: bool):
        pairs = [(d, h) for d, h in pairs if d is not h]
        handle = _StagedHandle(work, pairs)
        if async_op:
            return handle
        handle.wait()
        return None

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
        host = _host(tensor)
        return self._finish(super().all_reduce(host, op, group, async_op), [(tensor, host)], async_op)

    def reduce_scatter(self, output, input, op=ReduceOp.SUM, group=None, async_op: bool = False):
        out = _host(output, copy=False)
        work = super().reduce_scatter(out, _host(input), op, group, async_op)
        return self._finish(work, [(output, out)], async_op)

    def all_gather(self, output, input, group=None, async_op: bool = False):
        out = _host(output, copy=False)
        work = super().all_gather(out, _host(input), group, async_op)
        return self._finish(work, [(output, out)], async_op)

    def all_gather_list(self, outputs, input, group=None):
        outs = [_host(o, copy=False) for o in outputs]
        super().all_gather_list(outs, _host(input), group)
        self._finish(None, list(zip(outputs, outs)), False)

    def broadcast(self, tensor, src: int, group=None, async_op: bool = False):
        host = _host(tensor)
        return self._finish(super().broadcast(host, src, group, async_op), [(tensor, host)], async_op)

    def all_to_all(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                   async_op: bool = False):
        out = _host(output, copy=False)
        work = super().all_to_all(out, _host(input), output_split_sizes, input_split_sizes, group, async_op)
        return self._finish(work, [(output, out)], async_op)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]], group=None) -> list:
        staged = [(k, t, _host(t, copy=k == "send"), peer) for k, t, peer in ops]
        works = super().batch_p2p([(k, h, peer) for k, _, h, peer in staged], group)
        return [_StagedHandle(w, [(t, h)] if k == "recv" and t is not h else [])
                for w, (k, t, h, _) in zip(works, staged)]


def collective_mode() -> str:
    """``$OMNITRON_COLLECTIVES`` (default ``native``); an unknown value is a one-line error."""
    mode = os.environ.get(ENV_VAR, "native") or "native"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is not a collective mode; use one of {', '.join(MODES)}")
    return mode


def apply(backend_cls: type) -> type:
    """``backend_cls`` itself, or under ``host-staged`` a subclass whose collectives run over gloo on host copies."""
    if collective_mode() == "native" or backend_cls.dist_backend == "gloo" and backend_cls.device_type == "cpu":
        return backend_cls
    staged = HostStagedCollectives()
    return type(f"{backend_cls.__name__}HostStaged", (backend_cls,), {
        "dist_backend": "gloo",
        "collectives": property(lambda self: staged),
        "__doc__": f"{backend_cls.__doc__ or backend_cls.__name__} Collectives host-staged over gloo ({ENV_VAR}).",
    })
