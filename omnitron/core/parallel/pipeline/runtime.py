"""The one interpreter that executes any :class:`Schedule` table on this rank.

``F``: receive the activation (except on virtual stage 0), run ``forward_step_fn``; on the last
stage turn the per-token loss into this micro-batch's mean via ``loss_fn`` and keep
``mean / num_microbatches`` as the backward target; otherwise send the output on.
``B``: receive the output gradient (except on the last stage) and back-propagate. When the table
also holds a ``W`` for the same chunk and micro-batch, ``B`` computes only the input gradient
(``torch.autograd.grad`` with the graph retained) and ``W`` later accumulates the weight
gradients (``torch.autograd.backward(..., inputs=params)``, which fires the data-parallel hooks).
Before each weight-gradient pass the chunk's ``is_last_microbatch`` flag (data-parallel wrapper)
is set, so gradient all-reduces start only on the last one.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import torch

from omnitron.core.parallel.pipeline.p2p import StageP2P
from omnitron.core.parallel.pipeline.schedules import Action, Schedule


class PipelineError(RuntimeError):
    """An action failed; the message holds the rank, the step and the whole step-by-rank grid."""


def default_loss_fn(output: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of per-token losses, token count), honouring ``batch["loss_mask"]`` when present."""
    loss = output.float()
    mask = batch.get("loss_mask") if isinstance(batch, dict) else None
    if mask is None:
        return loss.sum(), torch.tensor(float(loss.numel()), device=loss.device)
    mask = mask.to(loss.dtype).reshape(loss.shape)
    return (loss * mask).sum(), mask.sum()


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


def run_schedule(schedule: Schedule, rank: int, chunks: list, data_iterator: Iterator | None, *,
                 forward_step_fn: Callable, loss_fn: Callable, pp_group, collectives,
                 tensor_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 forward_only: bool = False, timeline: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``schedule.tables[rank]``; returns this rank's (sum of micro-batch mean losses, tokens).

    Both are zero except on the rank holding the last stage. ``timeline``, when given, receives
    ``(start, end, str(action))`` compute spans (``time.perf_counter`` seconds) for bubble studies.
    """
    if forward_only:  # the same order without backward work (and so without gradient messages)
        schedule = dataclasses.replace(schedule, tables={r: tuple(a for a in t if a.kind == "F")
                                                         for r, t in schedule.tables.items()})
    table = schedule.tables[rank]
    split = schedule.split_backward(rank)
    last_wgrad = _weight_grad_order(table, split)
    m, last_stage = schedule.num_microbatches, schedule.num_stages - 1
    p2p = StageP2P(schedule, rank, pp_group, collectives, tensor_shape, dtype, device)
    batches = _Batches(data_iterator, uses=schedule.vp)
    state: dict[tuple[int, int], list] = {}  # (chunk, mb) -> [input, output-or-target, output grad]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    for step, a in enumerate(table):
        try:
            k, key = schedule.stage(rank, a.chunk), (a.chunk, a.microbatch)
            if a.kind == "F":
                hidden = p2p.recv(("act", k, a.microbatch)) if k > 0 else None
                t0 = time.perf_counter()
                if hidden is not None and not forward_only:
                    hidden.requires_grad_(True)
                batch = batches.get(a.microbatch)
                out = forward_step_fn(chunks[a.chunk], batch, hidden)
                if k == last_stage:
                    total, count = loss_fn(out, batch)
                    mean = total / count
                    loss_sum += mean.detach().to(torch.float64)
                    tokens += count.detach().to(torch.float64) if torch.is_tensor(count) else float(count)
                    out = mean / m
                else:
                    p2p.send(("act", k + 1, a.microbatch), out)
                if not forward_only:
                    state[key] = [hidden, out, None]
            elif a.kind == "B":
                grad = p2p.recv(("grad", k, a.microbatch)) if k < last_stage else None
                t0 = time.perf_counter()
                entry = state[key]
                hidden, out = entry[0], entry[1]
                if key in split:
                    g_in = (torch.autograd.grad(out, hidden, grad, retain_graph=True)[0]
                            if hidden is not None else None)
                    entry[0], entry[2] = None, grad
                else:
                    _set_last_microbatch(chunks[a.chunk], step == last_wgrad.get(a.chunk))
                    torch.autograd.backward(out, grad)
                    g_in = hidden.grad if hidden is not None else None
                    del state[key]
                if k > 0:
                    p2p.send(("grad", k - 1, a.microbatch), g_in if g_in is not None else torch.zeros_like(hidden))
            else:  # W
                t0 = time.perf_counter()
                _, out, grad = state.pop(key)
                params = [p for p in chunks[a.chunk].parameters() if p.requires_grad]
                _set_last_microbatch(chunks[a.chunk], step == last_wgrad.get(a.chunk))
                torch.autograd.backward(out, grad, inputs=params)
            if timeline is not None:
                timeline.append((t0, time.perf_counter(), str(a)))
            p2p.prefetch()
        except Exception as err:
            raise PipelineError(f"pipeline rank {rank} failed at step {step} ({a}): {type(err).__name__}: {err}\n"
                                f"{schedule.format()}") from err
    p2p.finish()
    for c in chunks:
        _set_last_microbatch(c, True)
    return loss_sum, tokens
