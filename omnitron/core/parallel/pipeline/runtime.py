"""The one interpreter that executes any :class:`Schedule` table on this rank.

``F``: receive the activation (except on virtual stage 0), run ``forward_step_fn``; on the last
stage turn the per-token loss into this micro-batch's mean via ``loss_fn`` and keep
``mean / num_microbatches`` as the backward target (``per_token_loss``: the micro-batch's loss sum, to be
divided by the step's token count once it is known: ``--calculate-per-token-loss``); otherwise send the
output on.
A sent output keeps only its autograd node (:func:`graph_root`, Megatron's deallocate-output idea): its data
goes once the send completes (``p2p.py``), unless autograd saved it for the chunk's own backward.
``B``: receive the output gradient (except on the last stage) and back-propagate. When the table
also holds a ``W`` for the same chunk and micro-batch, ``B`` computes only the input gradient and
``W`` later accumulates the weight gradients from the retained graph (see ``wgrad.py``; the
data-parallel hooks fire in W).
Before each weight-gradient pass the chunk's ``is_last_microbatch`` flag (data-parallel wrapper)
is set, so gradient all-reduces start only on the last one.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from omnitron.core.parallel.pipeline.p2p import StageP2P
from omnitron.core.parallel.pipeline.schedules import Action, Schedule
from omnitron.core.parallel.pipeline.wgrad import backward_input


class PipelineError(RuntimeError):
    """An action failed; the message holds the rank, the step and the whole step-by-rank grid."""


def default_loss_fn(output: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of per-token losses, token count), honouring ``batch["loss_mask"]`` when present."""
    loss = output.to(torch.promote_types(output.dtype, torch.float32))  # float64 stays float64
    mask = batch.get("loss_mask") if isinstance(batch, dict) else None
    if mask is None:
        return loss.sum(), torch.tensor(float(loss.numel()), device=loss.device)
    mask = mask.to(loss.dtype).reshape(loss.shape)
    return (loss * mask).sum(), mask.sum()


def _nonzero(count):
    """``count``, or 1 where it is 0 (a fully masked micro-batch: its loss sum is 0, and so its mean). Not a clamp
    to 1: under context parallelism a rank's count is the micro-batch's tokens / cp, below 1 for a micro-batch
    with fewer loss tokens than cp ranks, and must divide as it is."""
    if torch.is_tensor(count):
        return torch.where(count > 0, count, torch.ones_like(count))
    return count if count > 0 else 1


class _Batches:
    """Micro-batches drawn lazily from the iterator, kept until every chunk has forwarded them."""

    def __init__(self, iterator: Iterator | None, uses: int) -> None:
        self.iterator, self.uses = iterator, uses
        self.cache: dict[int, list] = {}
        self.drawn = 0

    def get(self, mb: int):
        if self.iterator is None:
            return None
        while self.drawn <= mb:
            self.cache[self.drawn] = [next(self.iterator), self.uses]
            self.drawn += 1
        entry = self.cache[mb]
        entry[1] -= 1
        if entry[1] == 0:
            del self.cache[mb]
        return entry[0]


def graph_root(out: torch.Tensor) -> torch.Tensor | GradientEdge:
    """What backward needs of a sent chunk output: its autograd edge, not its data.

    Megatron frees a sent output by replacing its ``.data`` with a 1-element tensor and back-propagates
    through the engine's internal ``run_backward``, which skips the shape check. Keeping the
    :class:`GradientEdge` and dropping the tensor frees the same bytes (the send buffer is the only other
    holder, released once the send completes) through public API (``torch.autograd.backward`` and ``grad``
    take the edge and check the gradient against the node's recorded shape), and works for an output that
    is a view too (Megatron asserts it is not). Whatever autograd saved of the output stays: its backward
    needs it. A tensor outside any graph is kept as is."""
    return get_gradient_edge(out) if out.requires_grad else out


def _weight_grad_order(table: tuple[Action, ...], split: set) -> dict[int, int]:
    """Per chunk, the table index of its last action that produces weight gradients."""
    last = {}
    for i, a in enumerate(table):
        if a.kind == "W" or (a.kind == "B" and (a.chunk, a.microbatch) not in split):
            last[a.chunk] = i
    return last


def _set_last_microbatch(chunk, flag: bool) -> None:
    if hasattr(chunk, "is_last_microbatch"):
        chunk.is_last_microbatch = flag


class _StageRunner:
    """Executes one rank's actions; holds the per-(chunk, micro-batch) state between them."""

    def __init__(self, schedule: Schedule, rank: int, chunks: list, batches: _Batches, p2p: StageP2P,
                 forward_step_fn: Callable, loss_fn: Callable, device: torch.device, forward_only: bool,
                 per_token_loss: bool = False) -> None:
        self.s, self.rank, self.chunks, self.batches, self.p2p = schedule, rank, chunks, batches, p2p
        self.per_token_loss = per_token_loss
        self.forward_step_fn, self.loss_fn, self.forward_only = forward_step_fn, loss_fn, forward_only
        self.split = schedule.split_backward(rank)
        self.last_wgrad = _weight_grad_order(schedule.tables[rank], self.split)
        self.last_stage = schedule.num_stages - 1
        self.state: dict[tuple[int, int], list] = {}  # (chunk, mb) -> [input, output or loss target, W plan]
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)

    def forward(self, a: Action, k: int) -> None:
        hidden = self.p2p.recv(("act", k, a.microbatch)) if k > 0 else None  # [s, b, h]
        if hidden is not None and not self.forward_only:
            hidden.requires_grad_(True)
        batch = self.batches.get(a.microbatch)
        self._finish_forward(a, k, batch, hidden, self.forward_step_fn(self.chunks[a.chunk], batch, hidden))

    def combined(self, f: Action, b: Action, step: int, combined_fn: Callable) -> None:
        """A combined pair (``combined.py``): forward ``f`` and backward ``b`` (table index ``step``) handed to
        ``combined_fn(forward, backward)``, which runs them in turns (``--overlap-moe-expert-parallel-comm``)."""
        kf, kb = self.s.stage(self.rank, f.chunk), self.s.stage(self.rank, b.chunk)
        combined_fn(lambda: self.forward(f, kf), lambda: self.backward(b, kb, step))

    def _finish_forward(self, a: Action, k: int, batch, hidden, out) -> None:
        if k == self.last_stage:
            total, count = self.loss_fn(out, batch)
            self.tokens += count.detach().to(torch.float64) if torch.is_tensor(count) else float(count)
            if self.per_token_loss:  # the sum; the step divides the gradients by the global token count
                self.loss_sum += total.detach().to(torch.float64)
                out = total
            else:  # NOTE: a fully masked micro-batch (count 0) contributes 0 with zero gradients, as Megatron's
                mean = total / _nonzero(count)
                self.loss_sum += mean.detach().to(torch.float64)
                out = mean / self.s.num_microbatches  # what backward differentiates
        else:
            self.p2p.send(("act", k + 1, a.microbatch), out)
            out = graph_root(out)  # [s, b, h] freed once sent; backward starts from its autograd node
        if not self.forward_only:
            self.state[(a.chunk, a.microbatch)] = [hidden, out, None]

    def backward(self, a: Action, k: int, step: int) -> None:
        key = (a.chunk, a.microbatch)
        grad = self.p2p.recv(("grad", k, a.microbatch)) if k < self.last_stage else None
        entry = self.state[key]
        hidden, out = entry[0], entry[1]
        if key in self.split:  # input gradient only; W later runs the weight side of the retained graph
            params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]
            g_in, entry[2] = backward_input(out, grad, hidden, params)  # stage 0 (no hidden): W does it all
            entry[0] = entry[1] = None
        else:
            _set_last_microbatch(self.chunks[a.chunk], step == self.last_wgrad.get(a.chunk))
            torch.autograd.backward(out, grad)
            g_in = hidden.grad if hidden is not None else None
            del self.state[key]
        if k > 0:
            self.p2p.send(("grad", k - 1, a.microbatch), g_in if g_in is not None else torch.zeros_like(hidden))

    def weight(self, a: Action, step: int) -> None:
        plan = self.state.pop((a.chunk, a.microbatch))[2]
        _set_last_microbatch(self.chunks[a.chunk], step == self.last_wgrad.get(a.chunk))
        plan.run()


def run_schedule(schedule: Schedule, rank: int, chunks: list, data_iterator: Iterator | None, *,
                 forward_step_fn: Callable, loss_fn: Callable, pp_group, collectives,
                 tensor_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 forward_only: bool = False, timeline: list | None = None,
                 per_token_loss: bool = False, combined_fn: Callable | None = None,
                 trace: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``schedule.tables[rank]``; returns this rank's (sum of micro-batch mean losses, tokens); with
    ``per_token_loss``, (sum of micro-batch loss sums, tokens).

    Both are zero except on the rank holding the last stage. ``timeline``, when given, receives
    ``(start, end, str(action))`` compute spans (``time.perf_counter`` seconds; receive waits
    excluded) for bubble studies. ``combined_fn(forward, backward)``: runs a combined pair's two passes in turns
    (``Schedule.combined``; without it the pair runs one pass after the other).
    ``trace``, when given, receives the order of events: ``("post" | "wait", "send" | "recv", message)`` from
    the exchanges and ``("start" | "end", "compute", action)`` around each action (the overlap test reads it).
    """
    if forward_only:  # the same order without backward work (and so without gradient messages)
        schedule = schedule.forwards_only()
    p2p = StageP2P(schedule, rank, pp_group, collectives, tensor_shape, dtype, device, trace)
    runner = _StageRunner(schedule, rank, chunks, _Batches(data_iterator, uses=schedule.vp), p2p,
                          forward_step_fn, loss_fn, device, forward_only, per_token_loss)
    table, skip = schedule.tables[rank], -1
    for step, a in enumerate(table):
        if step == skip:
            continue  # ran with the forward before it (a combined pair)
        try:
            k = schedule.stage(rank, a.chunk)
            p2p.exchange(step)  # this step's batch of sends and receives, one group (see p2p.py)
            t0 = time.perf_counter()
            if trace is not None:
                trace.append(("start", "compute", str(a)))
            if combined_fn is not None and schedule.combined and schedule.paired(rank, step):
                skip = step + 1
                runner.combined(a, table[skip], skip, combined_fn)
            elif a.kind == "F":
                runner.forward(a, k)
            elif a.kind == "B":
                runner.backward(a, k, step)
            else:
                runner.weight(a, step)
            if timeline is not None:  # compute span: exchange waits excluded; a combined pair's is "0F2&0B1"
                timeline.append((t0, time.perf_counter(), str(a) if step + 1 != skip else f"{a}&{table[skip]}"))
            if trace is not None:
                trace.append(("end", "compute", str(a)))
            if step + 1 == skip:  # after a combined pair: its batch holds nothing the pair needed (p2p.py)
                p2p.exchange(skip)
        except Exception as err:
            raise PipelineError(f"pipeline rank {rank} failed at step {step} ({a}): {type(err).__name__}: {err}\n"
                                f"{schedule.format()}") from err
    try:
        p2p.finish()
    except Exception as err:
        raise PipelineError(f"pipeline rank {rank} failed in the final exchange: {type(err).__name__}: {err}\n"
                            f"{schedule.format()}") from err
    for c in chunks:
        _set_last_microbatch(c, True)
    return runner.loss_sum, runner.tokens

