"""Every point-to-point operation a pipeline stage posts is waited, and each send by the exchange after its own.

A dropped send wait, or a dropped ``_release``, changes no number and sim reports neither (both passed every
pipeline test on cpu and sim, 2026-12-07); the first leaves works never waited, the second keeps each sent
activation or gradient alive to the end of the step, which p2p.py's lifetime claim (a sent tensor lives one
action past its send) excludes. Checked here in one process: :class:`StageP2P` of every rank of each schedule
is driven through its table as the runtime drives it, over a stand-in communicator whose works record waits.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.parallel.pipeline import build_schedule
from omnitron.core.parallel.pipeline.p2p import StageP2P, _message, input_message

SHAPE = (2, 1, 4)


class _Work:
    def __init__(self, kind: str) -> None:
        self.kind, self.waits = kind, 0

    def wait(self) -> None:
        self.waits += 1


class _Comm:
    """A group and its collectives: ``batch_p2p`` returns one recording work per operation."""

    handle = None

    def __init__(self) -> None:
        self.batches: list[list[_Work]] = []

    def global_rank(self, peer: int) -> int:
        return peer

    def batch_p2p(self, ops, group=None) -> list[_Work]:
        self.batches.append([_Work(kind) for kind, _, _ in ops])
        return self.batches[-1]


def _drive(schedule, rank: int) -> None:
    """The runtime's order (runtime.run_schedule, pairs run one after the other): exchange, consume, produce;
    after each exchange every send of an earlier batch is waited."""
    comm = _Comm()
    p2p = StageP2P(schedule, rank, comm, comm, SHAPE, torch.float32, torch.device("cpu"))
    for step, action in enumerate(schedule.tables[rank]):
        done_before = len(comm.batches)
        p2p.exchange(step)
        late = [w for batch in comm.batches[:done_before] for w in batch if w.kind == "send" and not w.waits]
        assert not late, (schedule.name, rank, step, f"{len(late)} sends of earlier batches not waited")
        if (msg := input_message(schedule, rank, action)) is not None:
            p2p.recv(msg)
        if (out := _message(schedule, rank, action)) is not None:
            p2p.send(out, torch.zeros(SHAPE))
    p2p.finish()
    waits = [w.waits for batch in comm.batches for w in batch]
    assert waits and all(n == 1 for n in waits), (schedule.name, rank, waits)


@pytest.mark.parametrize("name,pp,vp,m", [("1f1b", 4, 1, 6), ("interleaved", 2, 2, 4), ("zb-h1", 3, 1, 5),
                                          ("dualpipe-v", 4, 2, 8), ("zb-v", 2, 2, 4)])
def test_every_p2p_work_is_waited_once_and_sends_by_the_next_exchange(name, pp, vp, m):
    schedule = build_schedule(name, pp, vp, m)
    for rank in range(pp):
        _drive(schedule, rank)
