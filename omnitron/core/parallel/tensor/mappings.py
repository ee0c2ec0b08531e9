"""Autograd region maps for tensor and sequence parallelism.

Each map is a tiny ``autograd.Function`` whose backward is the dual of its forward, takes the
tensor-parallel :class:`~omnitron.core.parallel.groups.Group` explicitly, and returns its input
unchanged when the group has one member (no communication at tp=1). Collectives go through the
group's ``collectives`` (its backend's, given when the groups were built) so dtype gaps of the
transport are handled in one place.

"tp region" maps split/gather the LAST dim (hidden or vocab shards); "sp region" maps
split/gather dim 0 (sequence shards of ``[s, b, h]`` activations).

While ``torch.compile`` traces (``--torch-compile``), the raw collectives below are torch's functional
collectives (``torch.distributed._functional_collectives``), which dynamo records into the graph, so a
tensor-parallel layer compiles without graph breaks; those calls bypass the flight recorder and the strict
fingerprint check of :class:`~omnitron.backends.collectives.Collectives` (both are Python around each call).
"""
from __future__ import annotations

import torch


def _traced() -> bool:
    """True while dynamo traces: collectives must be functional ones to stay inside the graph."""
    return torch.compiler.is_compiling()


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def local_rank(group) -> int:
    """This process's index in ``group``; 0 for a one-member group (which may be a one-process
    layout built inside a larger world, e.g. a reference model in a test)."""
    return 0 if group.size == 1 else group.rank


# ---- raw collectives (no autograd) -------------------------------------------------------
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group`` in a NEW tensor (the input may be shared by other graph nodes)."""
    if group.size == 1:
        return x
    if _traced():
        return _funcol().all_reduce(x.contiguous(), "sum", group.handle)
    out = x.contiguous().clone()
    group.collectives.all_reduce(out, group=group.handle)
    return out


def split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of the last dim."""
    if group.size == 1:
        return x
    if x.shape[-1] % group.size:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by tensor-parallel size {group.size}")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim."""
    if group.size == 1:
        return x
    out = _gather_dim0(x.contiguous(), group)
    return torch.cat(out.chunk(group.size, dim=0), dim=-1)


def split_first(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's contiguous slice of dim 0 (the sequence)."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel size {group.size} "
                         f"(sequence parallelism splits it); change --seq-length or drop --sequence-parallel")
    n = x.shape[0] // group.size
    return x[group.rank * n:(group.rank + 1) * n].contiguous()


def gather_first(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0."""
    if group.size == 1:
        return x
    return _gather_dim0(x.contiguous(), group)


def _gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's contiguous ``x`` stacked along dim 0 (rank order)."""
    if _traced():
        return _funcol().all_gather_tensor(x, 0, group.handle)
    out = torch.empty((group.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    group.collectives.all_gather(out, x, group=group.handle)
    return out


def reduce_scatter_first(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's dim-0 slice."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 ({x.shape[0]}) is not divisible by tensor-parallel size {group.size}")
    x = x.contiguous()
    if _traced():
        return _funcol().reduce_scatter_tensor(x, "sum", 0, group.handle)
    out = torch.empty((x.shape[0] // group.size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    group.collectives.reduce_scatter(out, x, group=group.handle)
    return out


# ---- autograd pairs ----------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """forward: identity; backward: all-reduce (the input feeds every rank's shard)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """forward: all-reduce (sum partial products); backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    """forward: keep this rank's last-dim slice; backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_last(g, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather the last dim; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return split_last(g, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    """forward: keep this rank's sequence slice; backward: all-gather the sequence."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_first(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """forward: all-gather the sequence; backward: reduce-scatter (the gathered tensor feeds a
    tensor-parallel GEMM, so each rank's grad is a partial sum) or plain split."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.partial = group, grad_is_partial
        return gather_first(x, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial:
            return reduce_scatter_first(g, ctx.group), None, None
        return split_first(g, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """forward: reduce-scatter partial sums into sequence shards; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_first(g, ctx.group), None


def copy_to_tp(x, group):
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x, group):
    return x if group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp(x, group):
    return x if group.size == 1 else _GatherFromTP.apply(x, group)


def scatter_to_sp(x, group):
    return x if group.size == 1 else _ScatterToSP.apply(x, group)


def gather_from_sp(x, group, grad_is_partial: bool = True):
    return x if group.size == 1 else _GatherFromSP.apply(x, group, grad_is_partial)


def reduce_scatter_to_sp(x, group):
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group)
