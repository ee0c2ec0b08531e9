"""Token dispatch: gather the processed (token, expert) pairs expert-major, all-to-all over the
expert-parallel group, and the inverse all-to-all with the weighted combine. Which pairs are
processed is a ``[T, E]`` mask (:mod:`.capacity`): the router's picks (dropless), the picks within
each expert's capacity, or every expert padded to its capacity.

Experts are numbered globally and ep rank ``r`` owns the contiguous block
``[r * E/ep, (r + 1) * E/ep)``, so the expert-major rows for rank ``r`` are one contiguous slice:
the send split of rank ``r`` is the sum of its experts' counts. Every rank first sends its
per-expert counts (one small all-to-all), which gives the receive splits and how many rows each
local expert will get.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnitron.core.transformer.moe.overlap import Steps, drive, handoff, note_all_to_all


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group, pending: list | None = None) -> torch.Tensor:
    """Rows ``send[j]`` of ``x`` (in order) go to member ``j``; ``recv[i]`` rows arrive from ``i``. With
    ``pending``, issued without waiting: the handle is appended there and the output is not to be read
    before it is waited."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    work = group.collectives.all_to_all(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                                        group=group.handle, async_op=pending is not None)
    if pending is not None:
        pending.append(work)
    return out


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with splits (send, recv); backward: the reverse all-to-all (recv, send)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _reverse_all_to_all(g, ctx), None, None, None


def _reverse_all_to_all(g: torch.Tensor, ctx) -> torch.Tensor:
    """The backward of an all-to-all: the reverse exchange of ``g``, issued, then (in a combined pair,
    ``overlap.py``) in flight while the other micro-batch's forward computes, then waited."""
    pending: list = []
    out = _all_to_all(g, ctx.recv, ctx.send, ctx.group, pending)
    note_all_to_all("issue")
    handoff()
    for work in pending:
        work.wait()
    note_all_to_all("wait")
    return out


class _Received(torch.autograd.Function):
    """forward: ``received``, the result of an all-to-all of ``x`` already waited for; backward: the reverse
    all-to-all into ``x``'s gradient. (The exchange runs outside autograd so that no autograd node ever
    holds a tensor still in flight.)"""

    @staticmethod
    def forward(ctx, x, received, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return received

    @staticmethod
    def backward(ctx, g):
        return _reverse_all_to_all(g, ctx), None, None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of dim-0 rows over ``group`` (identity at group size 1)."""
    return x if group.size == 1 else _AllToAll.apply(x, send, recv, group)


def all_to_all_steps(x: torch.Tensor, send: list[int], recv: list[int], group) -> Steps[torch.Tensor]:
    """:func:`all_to_all` as steps: issue, yield (other work runs while it is in flight), wait."""
    if group.size == 1:
        return x
    pending: list = []
    received = _all_to_all(x.detach(), send, recv, group, pending)
    note_all_to_all("issue")
    yield
    for work in pending:
        work.wait()
    note_all_to_all("wait")
    return _Received.apply(x, received, send, recv, group)


@dataclass
class DispatchPlan:
    """Everything :func:`combine` needs to undo :func:`dispatch`."""

    token: torch.Tensor
    """[A] token of each processed assignment, expert-major (then token order)."""
    expert: torch.Tensor
    """[A] global expert of each processed assignment."""
    send: list[int]
    """Rows sent to each ep rank."""
    recv: list[int]
    """Rows received from each ep rank."""
    regroup: torch.Tensor | None
    """Received rows (source-major) in local-expert-major order; None when already so (ep=1)."""
    local_counts: list[int]
    """Rows for each local expert, in order."""


def dispatch(x: torch.Tensor, mask: torch.Tensor, group) -> tuple[torch.Tensor, DispatchPlan]:
    """``x [N, h]`` tokens, ``mask [N, E]`` the processed (token, expert) pairs -> rows for this rank's
    local experts ``[R, h]``, grouped by local expert (``plan.local_counts``), and the plan."""
    return drive(dispatch_steps(x, mask, group))


def dispatch_steps(x: torch.Tensor, mask: torch.Tensor, group) -> Steps[tuple[torch.Tensor, DispatchPlan]]:
    """:func:`dispatch` as steps (the rows' all-to-all in flight at the yield; the counts' is waited)."""
    num_experts, ep = mask.shape[1], group.size
    expert, token = mask.t().nonzero(as_tuple=True)  # [A] each, expert-major, tokens ascending
    rows = x.index_select(0, token)  # [A, h]
    counts = torch.bincount(expert, minlength=num_experts)  # [E]
    local = num_experts // ep
    if ep == 1:
        n = int(token.numel())
        return rows, DispatchPlan(token, expert, [n], [n], None, counts.tolist())
    recv_counts = torch.empty_like(counts)
    group.collectives.all_to_all(recv_counts, counts, group=group.handle)
    recv_counts = recv_counts.view(ep, local)  # [source rank, local expert]
    send = counts.view(ep, local).sum(dim=1).tolist()
    recv = recv_counts.sum(dim=1).tolist()
    received = yield from all_to_all_steps(rows, send, recv, group)  # source-major, then expert
    # key of each received row = (local expert, source): a stable sort makes it expert-major
    keys = (torch.arange(local, device=x.device)[None, :] * ep + torch.arange(ep, device=x.device)[:, None])
    row_keys = torch.repeat_interleave(keys.reshape(-1), recv_counts.reshape(-1))  # [R]
    regroup = torch.argsort(row_keys, stable=True)
    plan = DispatchPlan(token, expert, send, recv, regroup, recv_counts.sum(dim=0).tolist())
    return received.index_select(0, regroup), plan


def combine(y: torch.Tensor, gates: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Expert outputs ``y [R, h]`` (as :func:`dispatch` grouped them) back to their tokens, weighted
    by ``gates [N, E]`` (the routing probability of each pair, 0 where not picked) and summed: ``[N, h]``."""
    return drive(combine_steps(y, gates, plan, group))


def combine_steps(y: torch.Tensor, gates: torch.Tensor, plan: DispatchPlan, group) -> Steps[torch.Tensor]:
    """:func:`combine` as steps (the outputs' all-to-all in flight at the yield)."""
    if plan.regroup is not None:
        y = y.index_select(0, torch.argsort(plan.regroup))  # back to source-major
        y = yield from all_to_all_steps(y, plan.recv, plan.send, group)
    weight = gates[plan.token, plan.expert].to(y.dtype)  # [A]
    out = y.new_zeros((gates.shape[0], y.shape[-1]))
    return out.index_add(0, plan.token, y * weight.unsqueeze(-1))
