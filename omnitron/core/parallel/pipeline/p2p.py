"""Point-to-point activation/gradient exchange for one rank, planned from the schedule table.

Because the whole schedule is data, every rank knows, for each neighbour, the exact order in
which that neighbour will send it messages. Receives are therefore posted in send order on
each channel (one message of look-ahead), and a message needed out of order is found by
draining the channel into a small stash: matching never depends on tags, and every message has
the same shape, known ahead. Sends are asynchronous and waited at the end of the step.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from omnitron.core.parallel.pipeline.schedules import Schedule

Message = tuple[str, int, int]
"""(``"act"`` | ``"grad"``, destination virtual stage, micro-batch)."""


def plan_messages(schedule: Schedule) -> dict[tuple[int, int], list[Message]]:
    """Every (src_rank, dst_rank) channel's messages, in the order the source sends them."""
    last = schedule.num_stages - 1
    channels: dict[tuple[int, int], list[Message]] = {}
    for r, table in schedule.tables.items():
        for a in table:
            k = schedule.stage(r, a.chunk)
            if a.kind == "F" and k < last:
                msg: Message = ("act", k + 1, a.microbatch)
            elif a.kind == "B" and k > 0:
                msg = ("grad", k - 1, a.microbatch)
            else:
                continue
            dst = schedule.place(msg[1])[0]
            channels.setdefault((r, dst), []).append(msg)
    return channels


class StageP2P:
    """Sends and receives of pipeline rank ``rank`` over the pipeline ``group``."""

    def __init__(self, schedule: Schedule, rank: int, group, collectives, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.schedule, self.rank, self.group, self.coll = schedule, rank, group, collectives
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        plan = plan_messages(schedule)
        self.expected = {src: deque(msgs) for (src, dst), msgs in plan.items() if dst == rank}
        self.posted: dict[int, tuple[Message, torch.Tensor, list]] = {}  # src -> next message in flight
        self.stash: dict[Message, torch.Tensor] = {}
        self.sends: list[tuple[list, torch.Tensor]] = []
        self.recv_done = 0.0
        """``time.perf_counter()`` when the last blocking receive returned (for compute timelines)."""

    def _post(self, src: int) -> None:
        """Post the receive of the next message ``src`` will send, if any and none is in flight."""
        if src in self.posted or not self.expected.get(src):
            return
        msg = self.expected[src].popleft()
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        handles = self.coll.batch_p2p([("recv", buf, self.group.global_rank(src))], group=self.group.handle)
        self.posted[src] = (msg, buf, handles)

    def prefetch(self) -> None:
        """Post the next receive on every incoming channel (overlaps transfer with compute)."""
        for src in self.expected:
            self._post(src)

    def recv(self, msg: Message) -> torch.Tensor:
        """Block until ``msg`` has arrived and return it."""
        src = self.schedule.place(msg[1] - 1 if msg[0] == "act" else msg[1] + 1)[0]
        while msg not in self.stash:
            self._post(src)
            if src not in self.posted:
                raise RuntimeError(f"rank {self.rank} waits for {msg} that rank {src} never sends")
            got, buf, handles = self.posted.pop(src)
            for h in handles:
                h.wait()
            self.stash[got] = buf
            self._post(src)
        self.recv_done = time.perf_counter()
        return self.stash.pop(msg)

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Start sending ``tensor`` (shape and dtype checked against the plan) to the stage in ``msg``."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"stage output {tuple(tensor.shape)} {tensor.dtype} differs from the pipeline "
                               f"tensor shape {self.shape} {self.dtype}; check --seq-length, --micro-batch-size, "
                               f"--hidden-size and --sequence-parallel")
        dst = self.schedule.place(msg[1])[0]
        tensor = tensor.detach().contiguous()
        self.sends.append((self.coll.batch_p2p([("send", tensor, self.group.global_rank(dst))],
                                               group=self.group.handle), tensor))

    def finish(self) -> None:
        """Wait for every send; check that nothing expected was left unreceived."""
        for handles, _ in self.sends:
            for h in handles:
                h.wait()
        self.sends.clear()
        left = [m for q in self.expected.values() for m in q] + [p[0] for p in self.posted.values()]
        if left or self.stash:
            raise RuntimeError(f"rank {self.rank}: messages never consumed: {left + list(self.stash)}")
