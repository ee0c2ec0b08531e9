"""Global gradient norm over every tensor-, pipeline- and context-parallel rank of one replica.

Each rank sums the squares of the gradients it owns, counting a replicated parameter once:
tensor-parallel shards (``param.tensor_model_parallel``) on every tp rank, replicated parameters
(norms, biases of row-parallel layers) on tp rank 0 only, and the pipeline's duplicate of a
tied embedding not at all. One all-reduce over ``groups.tp_pp_cp`` then gives the norm a single
process would compute. Data-parallel replicas hold identical (already averaged) gradients, so
they are not summed again. MoE expert gradients are summed over the expert-parallel group and
counted once per pipeline stage (:func:`expert_sum`); under expert tensor parallelism (etp = tp)
their etp shards are summed like tp shards and their etp-replicated parts count on etp rank 0.
"""
from __future__ import annotations

import math

import torch

from omnitron.backends.collectives import ReduceOp


def counts_toward_norm(param: torch.nn.Parameter, tp_rank: int, duplicates: set[int]) -> bool:
    """True when this rank's copy of ``param`` is the one counted in the global norm."""
    if id(param) in duplicates:
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def counts_expert(param: torch.nn.Parameter, etp_rank: int) -> bool:
    """True when this etp rank's copy of expert ``param`` is counted: an etp shard on every etp rank,
    an etp-replicated tensor (fc2's bias, or everything at etp = 1) on etp rank 0 only."""
    return bool(getattr(param, "tensor_model_parallel", False)) or etp_rank == 0


def global_grad_norm(params: list[torch.nn.Parameter], grads: list[torch.Tensor], groups, collectives,
                     kernels, duplicates: set[int] = frozenset(), reduce_over: tuple | None = None,
                     device: torch.device | None = None, dtype: torch.dtype = torch.float32) -> float:
    """The L2 norm of all gradients of the model replica (equal to the single-process norm).

    ``grads[i]`` is (a part of) ``params[i]``'s gradient. ``reduce_over``: the groups whose sum of
    squares makes the whole (default ``groups.tp_pp_cp``); a distributed optimizer, whose ranks own
    disjoint slices (dense ones over dp_cp, expert ones over edp), passes ``(groups.dp_cp, groups.mp)``,
    the whole world. Its expert slices are then counted where they lie: etp x ep x edp = tp x cp x dp,
    so each expert element of a stage sits on exactly one rank of the stage (etp-replicated ones on
    one per etp rank: counted on etp rank 0).
    ``device``: where a rank without gradients builds its zero (pass the backend's current device).
    Any per-parameter tensors work (the loop's ``--log-params-norm`` passes the parameters themselves).
    ``dtype``: float64 sums the squares in float64 (a float64 model's norm: the fp32 kernel would round each
    square to fp32, a 2^-24 relative error in the norm and the clip factor); every rank must pass the same.
    """
    def sum_sq(ts: list[torch.Tensor], dev) -> torch.Tensor:
        return (kernels.grad_norm_sq(ts) if ts else torch.zeros((), dtype=torch.float32, device=dev)).reshape(1).float()

    def sum_sq64(ts: list[torch.Tensor], dev) -> torch.Tensor:
        return torch.stack([t.double().square().sum() for t in ts]).sum().reshape(1) if ts else \
            torch.zeros(1, dtype=torch.float64, device=dev)

    total = global_sum(params, grads, groups, collectives, sum_sq64 if dtype == torch.float64 else sum_sq,
                       duplicates, reduce_over, device)
    if math.isinf(total):
        # NOTE: fp32 squares overflow from |g| ~ 1.8e19 although every gradient is finite: count again in
        # float64 (exact for any fp32 gradient). Every rank of the reduction holds the same total, so all
        # take this branch together; an inf gradient stays inf.
        total = global_sum(params, grads, groups, collectives, sum_sq64, duplicates, reduce_over, device)
    return math.sqrt(total)


def global_count_zeros(params: list[torch.nn.Parameter], grads: list[torch.Tensor], groups, collectives,
                       duplicates: set[int] = frozenset(), reduce_over: tuple | None = None,
                       device: torch.device | None = None) -> int:
    """How many elements of the replica's gradients are exactly zero, each element counted once (the
    counting rules and arguments of :func:`global_grad_norm`; ``--log-num-zeros-in-grad``)."""
    def zeros(ts: list[torch.Tensor], dev) -> torch.Tensor:
        if not ts:
            return torch.zeros(1, dtype=torch.float64, device=dev)
        return torch.stack([(t == 0).sum() for t in ts]).sum().reshape(1).double()  # float64: exact to 2**53

    return int(global_sum(params, grads, groups, collectives, zeros, duplicates, reduce_over, device))


def global_sum(params, tensors, groups, collectives, measure, duplicates=frozenset(), reduce_over=None,
               device=None) -> float:
    """``measure`` (a list of tensors and a device -> a ``[1]`` tensor, additive over lists) summed over the
    replica with each element counted once: the rules in the module docstring and :func:`global_grad_norm`."""
    tp_rank = groups.tp.rank if groups.tp.size > 1 else 0
    expert = [bool(getattr(p, "expert", False)) for p in params]
    # NOTE: under the default reduction, context-parallel ranks hold identical (dp_cp-averaged) dense
    # gradients: count them on cp rank 0 only (a distributed optimizer's slices differ per cp rank)
    sliced = reduce_over is not None
    cp_first = sliced or groups.cp.size == 1 or groups.cp.rank == 0
    etp_rank = groups.etp.rank if groups.etp.size > 1 else 0
    mine = [g for p, g, ex in zip(params, tensors, expert)
            if (ex and sliced and counts_expert(p, etp_rank))
            or (cp_first and not ex and counts_toward_norm(p, tp_rank, duplicates))]
    device = tensors[0].device if tensors else device
    total = measure(mine, device)
    if not sliced:
        experts = [g for p, g, ex in zip(params, tensors, expert) if ex and counts_expert(p, etp_rank)]
        total += expert_sum(experts, groups, collectives, measure, device)
    for group in reduce_over or (groups.tp_pp_cp,):
        if group.handle is not None:
            collectives.all_reduce(total, op=ReduceOp.SUM, group=group.handle)
    return total.item()


def expert_sum(tensors: list[torch.Tensor], groups, collectives, measure, device) -> torch.Tensor:
    """``measure`` of this pipeline stage's MoE expert tensors (``param.expert``), as ``[1]``.

    Each ep rank holds different experts (summed over ``groups.ep``); ranks that differ only in
    edp hold the same ones (counted once). The stage's total is returned on tp/cp rank 0 only
    (zero elsewhere), so the caller's sum over ``tp_pp_cp`` counts it once per stage; with etp = tp
    every tp rank returns its etp shards' part (``tensors``: only the ones :func:`counts_expert`).
    """
    sq = measure(tensors, device)
    if groups.ep.handle is not None:
        collectives.all_reduce(sq, op=ReduceOp.SUM, group=groups.ep.handle)
    # NOTE: etp is 1 or tp (validate_moe); at etp = tp the caller's sum over tp adds the etp shards
    over = (groups.cp,) if groups.etp.size > 1 else (groups.tp, groups.cp)
    first = all(g.size == 1 or g.rank == 0 for g in over)
    return sq if first else torch.zeros_like(sq)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so their norm is at most ``max_norm`` (1.0 when disabled).

    A non-finite norm does not switch clipping off: NaN gives NaN and inf gives 0, as
    ``torch.nn.utils.clip_grad_norm_`` does, so a broken step shows in the weights instead of applying
    unclipped gradients (with --check-for-nan-in-loss-and-grad, the default, the run stops before that)."""
    if max_norm <= 0:
        return 1.0
    if math.isnan(norm):
        return math.nan
    coef = max_norm / (norm + 1e-6)
    return min(coef, 1.0)
