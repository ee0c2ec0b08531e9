"""Stop cleanly on SIGTERM/SIGINT: finish the current step, save, exit.

The handler only sets a flag (a second signal interrupts at once); :meth:`StopFlag.agreed` ORs it over every rank (a signal may reach
only some processes), so all ranks stop after the same iteration.
"""
from __future__ import annotations

import signal

import torch

from omnitron.backends.collectives import ReduceOp


class StopFlag:
    def __init__(self, enabled: bool = True) -> None:
        self.requested = False
        self._previous = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread
                    pass

    def _handle(self, signum, frame) -> None:
        if self.requested:  # a second signal: stop now, without the checkpoint
            raise KeyboardInterrupt(f"second signal {signal.Signals(signum).name}: stopping without saving")
        self.requested = True

    def agreed(self, collectives, device=None) -> bool:
        """True on every rank when any rank was signalled (one tiny all-reduce over the world)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if collectives.is_initialized():
            collectives.all_reduce(flag, op=ReduceOp.MAX)
        return bool(flag.item() > 0)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
