"""Point-to-point activation/gradient exchange for one rank, planned from the schedule table.

NCCL runs a rank's point-to-point operations on a communicator in the order they are posted,
unless they are batched in one group: two neighbours that each post a receive before their send
wait on each other forever (gloo matches by tag and never shows it). So the whole exchange is
planned from the schedule, which every rank knows:

* :func:`plan_exchanges` runs the tables on an ideal clock (``simulate``), orders every transfer
  by the time its producer finishes, every action by its start, and cuts each rank's share of that
  one global order into batches: batch ``i`` holds the transfers between its actions ``i - 1`` and
  ``i``. Both ends of a transfer see it at the same place of the same total order, so the earliest
  unfinished transfer always has both ends at it: no deadlock under NCCL's rules, for any schedule
  that is itself deadlock-free. A receive may come batches before its use (look-ahead that
  overlaps compute); per channel the order is the sender's order (FIFO matching, no tags). A message
  between two chunks of one rank (the turn of a V-shaped schedule) is no transfer: :meth:`StageP2P.send`
  hands it to the rank's own inbox.
* :class:`StageP2P` posts batch ``i`` as one ``batch_p2p`` group before action ``i`` (and the last
  after the last action), waits for the receive action ``i`` consumes (one posted earlier, as a pair's
  backward's, stays in flight until its own action), then waits for the sends of the earlier batches and lets
  their tensors go: a sent activation or input gradient lives one action past its send, not to the end of
  the step (at m micro-batches that was 2m boundary tensors per stage). Waiting for an earlier batch's
  sends cannot deadlock: the earliest unfinished transfer of the total order has both ends posted, as
  above, whether a rank waits on its receives or its sends (NCCL's ``wait`` only orders streams; gloo's
  returns once the peer has received).
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.pipeline.schedules import Schedule, zb_stage_cost
from omnitron.core.parallel.pipeline.simulate import simulate

Message = tuple[str, int, int]
"""(``"act"`` | ``"grad"``, destination virtual stage, micro-batch)."""
Transfer = tuple[str, int, Message]
"""(``"send"`` | ``"recv"``, peer pipeline rank, message)."""


def _message(schedule: Schedule, rank: int, action) -> Message | None:
    """The message ``action`` on ``rank`` sends, if any."""
    k = schedule.stage(rank, action.chunk)
    if action.kind == "F" and k < schedule.num_stages - 1:
        return ("act", k + 1, action.microbatch)
    if action.kind == "B" and k > 0:
        return ("grad", k - 1, action.microbatch)
    return None


def input_message(schedule: Schedule, rank: int, action) -> Message | None:
    """The message ``action`` on ``rank`` consumes, if any (a transfer or the V's turn within the rank)."""
    k = schedule.stage(rank, action.chunk)
    if action.kind == "F" and k > 0:
        return ("act", k, action.microbatch)
    if action.kind == "B" and k < schedule.num_stages - 1:
        return ("grad", k, action.microbatch)
    return None


def _early_receives(schedule: Schedule, spans: dict) -> dict[Message, tuple]:
    """For each overlapped pair (``Schedule.pairs``), the backward's input keyed at the forward's start: its
    receive is posted before the forward computes (and waited only before the backward)."""
    early = {}
    for r, firsts in schedule.pairs.items():
        for i in firsts:
            msg = input_message(schedule, r, schedule.tables[r][i + 1])
            if msg is not None and schedule.place(msg[1] + (1 if msg[0] == "grad" else -1))[0] != r:
                early[msg] = (spans[r][i][0], 0, -1, -1)  # NOTE: before every transfer of that instant
    return early


def _receive_key(key: tuple, receiver: list, early: tuple | None) -> tuple:
    """Where the receiver posts a transfer the sender posts at ``key``: before the receiver's action that is
    running when it is produced (``receiver``: its spans), so that under NCCL's in-order rule the send finds
    its receive posted and does not hold the sender's stream until that action ends; earlier for a pair's
    backward input (``early``)."""
    out = key if early is None else min(key, early)
    running = [start for start, end, _ in receiver if start < key[0] < end]
    return min(out, (running[0], 0, -1, -1)) if running else out


def plan_exchanges(schedule: Schedule) -> dict[int, list[list[Transfer]]]:
    """Per rank, ``len(table) + 1`` batches: batch ``i`` is exchanged just before action ``i``.

    A receive sits in the batch before the receiver's action that runs while the sender produces it (priced
    under NCCL's order by ``benchmarks/pipeline_nccl_order.py``: DualPipeV at p = 4, m = 16 took 110 units of an
    ideal 99 with receives at the producer's end, 100 so), and a pair's backward input in the batch before the
    pair's forward; sends stay where the sender produces them. The receiver then posts those out of the global
    order (the one departure from it), and with each every receive its sender sends before it on that channel (matching
    is first in, first out per peer: a receive posted ahead of one sent earlier would take the other's tensor). The
    NCCL-order check in the tests runs every schedule's plan, channel order included (DualPipe itself waits for both
    receives before the pair).
    """
    # NOTE: on the clock the zero-bubble tables were built for (stage 0's B computes nothing, its W the whole
    # backward; the same as F = B = W = 1 for tables without W): an order from another clock makes a rank wait
    # at an exchange for a transfer its next action does not need (ZB-V pp2 m8: 56 units instead of 49)
    spans = simulate(schedule, stage_cost=zb_stage_cost, complete=False).spans  # forward-only tables too
    events: dict[int, list] = {r: [] for r in schedule.tables}  # r -> [((key, tie-break), index or transfer)]
    early = _early_receives(schedule, spans)
    channels: dict[tuple[int, int], list] = {}  # (src, dst) -> [(send key, receive key, message)]
    for r, rank_spans in spans.items():
        for i, (start, end, action) in enumerate(rank_spans):
            events[r].append((((start, 1, r, i), ()), i))
            msg = _message(schedule, r, action)
            if msg is not None and schedule.place(msg[1])[0] != r:  # V turn: same rank, no transfer
                dst = schedule.place(msg[1])[0]
                if schedule.combined and schedule.paired(r, i):  # a combined pair's forward sends at its end
                    end = rank_spans[i + 1][1]
                key = (end, 0, r, i)  # NOTE: ties between transfers are broken the same way on every rank
                events[r].append(((key, ()), ("send", dst, msg)))
                channels.setdefault((r, dst), []).append((key, _receive_key(key, spans[dst], early.get(msg)), msg))
    for (src, dst), sent in channels.items():  # receives in the sender's order: a suffix minimum of their keys
        first = None
        for key, recv_key, msg in sorted(sent, reverse=True):
            first = recv_key if first is None else min(first, recv_key)
            events[dst].append(((first, key), ("recv", src, msg)))  # ties: in the sender's order
    plan = {}
    for r, evs in events.items():
        batches: list[list[Transfer]] = [[]]
        for _, ev in sorted(evs, key=lambda e: e[0]):
            if isinstance(ev, int):
                batches.append([])
            else:
                batches[-1].append(ev)
        plan[r] = batches
    return plan


def nccl_order_makespan(s: Schedule) -> float:
    """The step of ``s`` on the ideal clock (``zb_stage_cost``) when NCCL's in-order rule holds: a rank posts batch i
    on reaching exchange i, its stream starts it once the previous batch completed, a batch completes once every
    peer's matching batch has started (transfers take no time), action i starts once its input's batch completed.
    A fixed point of those rules (``benchmarks/pipeline_nccl_order.py`` prints it beside the ideal clock)."""
    plan, split = plan_exchanges(s), {r: s.split_backward(r) for r in s.tables}
    where = {(kind, msg): (r, j) for r, bs in plan.items() for j, b in enumerate(bs) for kind, _, msg in b}
    start = {r: [0.0] * len(plan[r]) for r in plan}  # stream start of each batch
    done = {r: [0.0] * len(plan[r]) for r in plan}  # completion of each batch
    end = {r: [0.0] * len(s.tables[r]) for r in plan}  # end of each action
    for _ in range(100000):
        changed = False
        for r, table in s.tables.items():
            for i in range(len(plan[r])):
                posted = end[r][i - 1] if i else 0.0
                st = max(posted, done[r][i - 1] if i else 0.0)
                fin = max([st] + [start[p][j] for p, j in (where[("recv" if k == "send" else "send", msg)]
                                                            for k, _, msg in plan[r][i])])
                changed |= (start[r][i], done[r][i]) != (st, fin)
                start[r][i], done[r][i] = st, fin
                if i == len(table):
                    continue
                a, need = table[i], input_message(s, r, table[i])
                begin = max(posted, done[r][where[("recv", need)][1]]) if ("recv", need) in where else posted
                unsplit = a.kind == "B" and (a.chunk, a.microbatch) not in split[r]
                e = begin + zb_stage_cost(s.stage(r, a.chunk), "BW" if unsplit else a.kind)
                changed |= end[r][i] != e
                end[r][i] = e
        if not changed:
            return max(max(v) for v in end.values())
    raise RuntimeError("no fixed point: the plan deadlocks under the in-order rule")


class StageP2P:
    """Sends and receives of pipeline rank ``rank`` over the pipeline ``group``, batch by batch."""

    def __init__(self, schedule: Schedule, rank: int, group, collectives, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device, trace: list | None = None) -> None:
        self.schedule, self.rank, self.group, self.coll = schedule, rank, group, collectives
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.batches = plan_exchanges(schedule)[rank]
        self.outbox: dict[Message, torch.Tensor] = {}  # produced, sent with the next batch
        self.inbox: dict[Message, torch.Tensor] = {}  # received, not yet consumed
        self.posted: dict[Message, tuple] = {}  # receives posted, not yet waited: msg -> (handle, tensor)
        self.sends: list[tuple[list, list, list]] = []  # (handles, tensors, messages) of sends not yet waited
        self.trace = trace  # when a list: ("post" | "wait", "send" | "recv", message) in the order they happen

    def _note(self, event: str, kind: str, msg: Message) -> None:
        if self.trace is not None:
            self.trace.append((event, kind, msg))

    def exchange(self, step: int) -> None:
        """Post batch ``step`` as one group; return once the receive action ``step`` consumes has arrived and the
        earlier batches' sends have completed (their tensors released). Other receives stay in flight."""
        ops, msgs = [], []
        for kind, peer, msg in self.batches[step]:
            if kind == "send":
                if msg not in self.outbox:
                    raise RuntimeError(f"rank {self.rank}: the plan sends {msg} before it was produced")
                tensor = self.outbox.pop(msg)
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append((kind, tensor, self.group.global_rank(peer)))
            msgs.append(msg)
            self._note("post", kind, msg)
        handles = self.coll.batch_p2p(ops, group=self.group.handle) if ops else []
        for h, (kind, tensor, _), msg in zip(handles, ops, msgs):
            if kind == "recv":
                self.posted[msg] = (h, tensor)
        table = self.schedule.tables[self.rank]
        if step < len(table):
            self._arrive(input_message(self.schedule, self.rank, table[step]))
        self._release()
        sent = [(h, t, msg) for h, (kind, t, _), msg in zip(handles, ops, msgs) if kind == "send"]
        if sent:
            self.sends.append(tuple(map(list, zip(*sent))))

    def _arrive(self, msg: Message | None) -> None:
        """Wait for the posted receive of ``msg`` (if it is one) and move its tensor to the inbox."""
        if msg in self.posted:
            handle, tensor = self.posted.pop(msg)
            handle.wait()
            self._note("wait", "recv", msg)
            self.inbox[msg] = tensor

    def _release(self) -> None:
        """Wait for every send posted by an earlier exchange and drop this rank's references to its tensors."""
        for handles, _, msgs in self.sends:
            for h, msg in zip(handles, msgs):
                h.wait()
                self._note("wait", "send", msg)
        self.sends.clear()

    def recv(self, msg: Message) -> torch.Tensor:
        """The tensor of ``msg`` (received by an earlier :meth:`exchange`)."""
        self._arrive(msg)
        if msg not in self.inbox:
            raise RuntimeError(f"rank {self.rank}: {msg} is needed but was not received by the plan")
        return self.inbox.pop(msg)

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        """Queue ``tensor`` (shape and dtype checked against the plan) for the next exchange."""
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise RuntimeError(f"stage output {tuple(tensor.shape)} {tensor.dtype} differs from the pipeline "
                               f"tensor shape {self.shape} {self.dtype}; check --seq-length, --micro-batch-size, "
                               f"--hidden-size and --sequence-parallel")
        if self.schedule.place(msg[1])[0] == self.rank:  # the V's turn (stage p-1 to p): handed over in place
            self.inbox[msg] = tensor.detach()
            return
        self.outbox[msg] = tensor.detach().contiguous()

    def finish(self) -> None:
        """Post the last batch, wait for every send; check that nothing was left unexchanged."""
        self.exchange(len(self.batches) - 1)
        self._release()
        if self.outbox or self.inbox or self.posted:
            raise RuntimeError(f"rank {self.rank}: messages never exchanged or consumed: "
                               f"{list(self.outbox) + list(self.inbox) + list(self.posted)}")
