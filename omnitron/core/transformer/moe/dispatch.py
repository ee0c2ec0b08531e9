"""Dropless token dispatch: sort assignments by expert, all-to-all over the expert-parallel group,
run each local expert on its variable-size group, then the inverse all-to-all and the weighted
combine. No capacity, no padding, no token dropped.

Experts are numbered globally and ep rank ``r`` owns the contiguous block
``[r * E/ep, (r + 1) * E/ep)``, so after sorting by expert the rows for rank ``r`` are one
contiguous slice: the send split of rank ``r`` is the sum of its experts' counts. Every rank first
sends its per-expert counts (one small all-to-all), which gives the receive splits and how many
rows each local expert will get.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnitron.backends import get_backend


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Rows ``send[j]`` of ``x`` (in order) go to member ``j``; ``recv[i]`` rows arrive from ``i``."""
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    get_backend().collectives.all_to_all(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                                         group=group.handle)
    return out


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all with splits (send, recv); backward: the reverse all-to-all (recv, send)."""

    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(x, send, recv, group)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Differentiable all-to-all of dim-0 rows over ``group`` (identity at group size 1)."""
    return x if group.size == 1 else _AllToAll.apply(x, send, recv, group)


@dataclass
class DispatchPlan:
    """Everything :func:`combine` needs to undo :func:`dispatch`."""

    order: torch.Tensor
    """[N*k] position of each expert-sorted row in the flat ``(token, slot)`` assignment list."""
    send: list[int]
    """Rows sent to each ep rank."""
    recv: list[int]
    """Rows received from each ep rank."""
    regroup: torch.Tensor | None
    """Received rows (source-major) in local-expert-major order; None when already so (ep=1)."""
    local_counts: list[int]
    """Rows for each local expert, in order."""


def dispatch(x: torch.Tensor, experts: torch.Tensor, num_experts: int, group) -> tuple[torch.Tensor, DispatchPlan]:
    """``x [N, h]`` tokens, ``experts [N, k]`` their picked experts -> rows for this rank's local
    experts ``[R, h]``, grouped by local expert (``plan.local_counts``), and the plan."""
    k, ep = experts.shape[-1], group.size
    flat = experts.reshape(-1)  # [N*k], assignment (t, j) at t*k + j
    order = torch.argsort(flat, stable=True)
    rows = x.index_select(0, order // k)  # [N*k, h], sorted by expert
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    local = num_experts // ep
    if ep == 1:
        n = int(flat.numel())
        return rows, DispatchPlan(order, [n], [n], None, counts.tolist())
    recv_counts = torch.empty_like(counts)
    get_backend().collectives.all_to_all(recv_counts, counts, group=group.handle)
    recv_counts = recv_counts.view(ep, local)  # [source rank, local expert]
    send = counts.view(ep, local).sum(dim=1).tolist()
    recv = recv_counts.sum(dim=1).tolist()
    received = all_to_all(rows, send, recv, group)  # source-major, then expert
    # key of each received row = (local expert, source): a stable sort makes it expert-major
    keys = (torch.arange(local, device=x.device)[None, :] * ep + torch.arange(ep, device=x.device)[:, None])
    row_keys = torch.repeat_interleave(keys.reshape(-1), recv_counts.reshape(-1))  # [R]
    regroup = torch.argsort(row_keys, stable=True)
    plan = DispatchPlan(order, send, recv, regroup, recv_counts.sum(dim=0).tolist())
    return received.index_select(0, regroup), plan


def combine(y: torch.Tensor, probs: torch.Tensor, plan: DispatchPlan, group) -> torch.Tensor:
    """Expert outputs ``y [R, h]`` (as :func:`dispatch` grouped them) back to their tokens,
    weighted by ``probs [N, k]`` and summed over the k picks: ``[N, h]``."""
    if plan.regroup is not None:
        y = y.index_select(0, torch.argsort(plan.regroup))  # back to source-major
        y = all_to_all(y, plan.recv, plan.send, group)
    y = y.index_select(0, torch.argsort(plan.order))  # [N*k, h] in (token, slot) order
    n, k = probs.shape
    return (y.view(n, k, -1) * probs.to(y.dtype).unsqueeze(-1)).sum(dim=1)


def run_experts(x: torch.Tensor, counts: list[int], experts: list) -> torch.Tensor:
    """Each expert module on its contiguous group of rows (experts with no rows are skipped)."""
    outs = []
    for rows, expert in zip(torch.split(x, counts, dim=0), experts):
        if rows.shape[0] == 0:
            outs.append(rows)
            continue
        y, _ = expert(rows)
        outs.append(y)
    return torch.cat(outs, dim=0) if outs else x
