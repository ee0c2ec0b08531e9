"""The local experts on their dispatched rows, with expert tensor parallelism (etp).

With etp > 1 each expert's MLP is split over ``groups.etp`` like the dense MLP over tp (fc1 by
output rows, fc2 by input columns; etp = tp, so the shards are the tp shards). Each etp rank
dispatched a disjoint shard of the tokens, so after the expert-parallel all-to-all the ranks of
an etp group hold different rows for the same experts: they all-gather them (variable sizes),
compute their shard of every expert on all of them, and reduce-scatter the partial outputs back
to the rows' owner (Megatron's all-to-all dispatcher with etp). fc2's bias is added after the
reduce-scatter, to each rank's own rows; its gradient is then all-reduced over etp.
"""
from __future__ import annotations

import torch

from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.transformer.mlp import activate
from omnitron.core.transformer.moe.dispatch import _all_to_all


def _gather_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every member's rows of ``x`` (member ``j`` has ``sizes[j]``), concatenated in member order."""
    n = sizes[group.rank]
    return _all_to_all(x.repeat(group.size, 1), [n] * group.size, sizes, group)


def _reduce_scatter_v(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """``x`` holds every member's rows (member order); sum them over members, keep this rank's."""
    n = sizes[group.rank]
    parts = _all_to_all(x, sizes, [n] * group.size, group)  # [size * n, h]: my rows from each member
    return parts.view(group.size, n, *x.shape[1:]).sum(dim=0)


class _GatherV(torch.autograd.Function):
    """forward: variable-size all-gather of rows; backward: reduce-scatter (keep own rows' sum)."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_v(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter_v(g, ctx.sizes, ctx.group), None, None


class _ReduceScatterV(torch.autograd.Function):
    """forward: variable-size reduce-scatter of partial rows; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_v(x, sizes, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_v(g, ctx.sizes, ctx.group), None, None


def expert_mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """One expert's (shard of its) MLP on ``x [n, h]`` without fc2's bias and without communication:
    the partial sum ``[n, h]`` of this etp rank. Uses the linears' GEMM seam (FP8 when enabled)."""
    fc1, fc2, kernels = mlp.linear_fc1, mlp.linear_fc2, mlp.backend.kernels
    bias = fc1.bias if fc1.skip_bias_add else None  # the fused activation adds it
    y = fc1._gemm(x, fc1.weight, None if fc1.skip_bias_add else fc1.bias)  # [n, (2)f/etp]
    if y.shape[0] == 0:  # no tokens: nothing to activate (fused kernels take no empty input), but the GEMMs
        y = y[:, : y.shape[1] // 2] if mlp.swiglu else y  # still run: under FP8 they join the amax reductions
    else:
        y = activate(kernels, y, bias, swiglu=mlp.swiglu, exact=mlp.exact_gelu, glu=mlp.glu,
                     squared_relu=mlp.squared_relu)
    return fc2._gemm(y, fc2.weight, None)


class _ContiguousGrad(torch.autograd.Function):
    """forward: identity; backward: the gradient made contiguous (``torch._grouped_mm``'s backward refuses
    stride-0 gradients, e.g. of a ``sum``)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


_SAID: set[str] = set()


def _grouped_ok(rows: torch.Tensor, experts: list) -> bool:
    """``torch._grouped_mm``'s preconditions: fp32/bf16/fp16, no FP8 GEMM seam, 16-byte aligned widths."""
    fc1, fc2 = experts[0].linear_fc1, experts[0].linear_fc2
    widths = (fc1.weight.shape[1], fc1.weight.shape[0], fc2.weight.shape[0])
    why = ("FP8 expert GEMMs" if fc1.fp8 is not None or fc2.fp8 is not None else
           f"dtype {rows.dtype}" if rows.dtype not in (torch.float32, torch.bfloat16, torch.float16) else
           f"widths {widths} not 16-byte aligned" if any(w * rows.element_size() % 16 for w in widths) else
           "no torch._grouped_mm in this torch" if not hasattr(torch, "_grouped_mm") else None)
    if why is not None and why not in _SAID:
        import logging

        _SAID.add(why)
        logging.getLogger("omnitron.train").info("--moe-grouped-gemm: %s, so each expert runs its own GEMMs", why)
    return why is None


def _grouped_mm(x: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """``x [R, k]`` by each weight ``[n, k]`` on its rows (``offs``), in one ``torch._grouped_mm`` over the weights
    stacked ``[E, k, n]``. The stack is a copy of every weight; ``_grouped_mm`` would save it for its backward, one
    copy of the local experts' weights per MoE layer and micro-batch in flight. It is saved as the recipe instead
    and stacked again when the backward reads it (the weights do not change before then). Not where other
    saved-tensor hooks are active (activation recomputation's checkpoint): they keep nothing of the forward
    already, and hooks of ours would override theirs for the GEMM's other saved tensors."""
    w = torch.stack(weights).transpose(1, 2)
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return torch._grouped_mm(x, w, offs=offs)
    ptr, shape = w.data_ptr(), w.shape

    def pack(t: torch.Tensor):
        return _Restack(weights) if t.data_ptr() == ptr and t.shape == shape else t

    def unpack(p):
        return p.stack() if isinstance(p, _Restack) else p

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return torch._grouped_mm(x, w, offs=offs)


class _Restack:
    """A saved stack of expert weights, kept as the weights themselves (parameters: no copy)."""

    def __init__(self, weights: list[torch.Tensor]) -> None:
        self.weights = [w.detach() for w in weights]

    def stack(self) -> torch.Tensor:
        return torch.stack(self.weights).transpose(1, 2)


def grouped_expert_mlps(rows: torch.Tensor, counts: list[int], experts: list) -> torch.Tensor:
    """Every local expert's MLP (without fc2's bias) on its ``counts`` rows of ``rows [R, h]`` in two grouped
    GEMMs (``torch._grouped_mm``): what :func:`expert_mlp` computes per expert, in one launch each."""
    mlp, n = experts[0], len(experts)
    offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
    y = _ContiguousGrad.apply(_grouped_mm(rows, [m.linear_fc1.weight for m in experts], offs))  # [R, (2)f/etp]
    if mlp.linear_fc1.bias is not None:
        index = torch.repeat_interleave(torch.arange(n, device=rows.device), torch.tensor(counts, device=rows.device))
        y = y + torch.stack([m.linear_fc1.bias for m in experts]).index_select(0, index).to(y.dtype)
    if y.shape[0]:
        y = activate(mlp.backend.kernels, y, None, swiglu=mlp.swiglu, exact=mlp.exact_gelu, glu=mlp.glu,
                     squared_relu=mlp.squared_relu)
    else:
        y = y[:, : y.shape[1] // 2] if mlp.swiglu else y
    return _ContiguousGrad.apply(_grouped_mm(y.contiguous(), [m.linear_fc2.weight for m in experts], offs))


def run_experts(rows: torch.Tensor, counts: list[int], experts: list, etp, grouped: bool = False) -> torch.Tensor:
    """``rows [R, h]`` grouped by local expert (``counts``) through ``experts`` -> ``[R, h]``.

    ``etp``: the expert-tensor-parallel group (see the module docstring); identity at size 1. ``grouped``:
    --moe-grouped-gemm (:func:`grouped_expert_mlps` where its preconditions hold).
    """
    perm, all_counts, sizes = None, counts, None
    if etp.size > 1:
        local = len(counts)
        mine = torch.tensor([counts], dtype=torch.int64, device=rows.device)  # [1, local]
        per_rank = M.gather_first(mine, etp)  # [etp, local]
        sizes = per_rank.sum(dim=1).tolist()
        rows = _GatherV.apply(rows, sizes, etp)  # member-major, then expert
        keys = torch.arange(local, device=rows.device).repeat(etp.size)
        perm = torch.argsort(torch.repeat_interleave(keys, per_rank.reshape(-1)), stable=True)
        rows = rows.index_select(0, perm)  # expert-major over every member's rows
        all_counts = per_rank.sum(dim=0).tolist()
    # NOTE: every expert runs, even on zero rows: under FP8 each expert GEMM MAX-reduces its amax over
    # its amax groups, so skipping the empty ones would issue different collectives on different ranks
    if grouped and experts and _grouped_ok(rows, experts):
        y = grouped_expert_mlps(rows.contiguous(), all_counts, experts)
    else:
        outs = [expert_mlp(mlp, part) for part, mlp in zip(torch.split(rows, all_counts, dim=0), experts)]
        y = torch.cat(outs, dim=0) if outs else rows
    if perm is not None:
        y = _ReduceScatterV.apply(y.index_select(0, torch.argsort(perm)), sizes, etp)  # own rows, summed
    biases = [mlp.linear_fc2.bias for mlp in experts]
    if biases and biases[0] is not None:
        stacked = M.copy_to_tp(torch.stack(biases), etp)  # [local, h]; grads summed over etp ranks' rows
        index = torch.repeat_interleave(torch.arange(len(counts), device=y.device),
                                        torch.tensor(counts, device=y.device))
        y = y + stacked.index_select(0, index).to(y.dtype)
    return y
