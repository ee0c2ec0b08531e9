"""Top-k router (softmax or DeepSeek-V3's sigmoid scores), the Switch/GShard load-balancing
loss and the router z-loss.

Pure maths on ``[T, h]`` tokens except for one optional seam: ``stats_group``, the group whose
ranks hold the other shards of the same token set (the context-parallel slices of the sequence,
and its tensor-parallel shards under sequence parallelism: ``groups.cp`` or ``groups.tp_cp``).
The load-balancing statistics are summed over it, so the loss is that of the whole micro-batch,
as one process would compute it (the z-loss's token mean likewise).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.models.gpt.config import router_bias
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.random import recomputing
from omnitron.core.parallel.tensor.sharding import set_attributes
from omnitron.core.transformer.moe.validate import balancing_losses


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int, group_topk: int):
    """DeepSeek's group-limited top-k (Megatron's ``group_limited_topk``): the E experts form ``num_groups``
    equal groups; a group's score is the sum of its ``k // group_topk`` best scores; each token keeps its
    ``group_topk`` best groups and picks its k experts among theirs. ``(values [T, k], experts [T, k])``."""
    T, E = scores.shape
    group_scores = scores.view(T, num_groups, -1).topk(k // group_topk, dim=-1)[0].sum(dim=-1)  # [T, G]
    groups = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(T, num_groups, E // num_groups).reshape(T, E)
    return torch.topk(scores.masked_fill(~keep, float("-inf")), k, dim=-1)


ROUTER_DTYPES = {"fp32": torch.float32}
"""--moe-router-dtype's values (Megatron's fp64 is refused: :mod:`.validate`)."""


def router_dtype(c) -> torch.dtype:
    """The dtype of the router's logits and probabilities (Megatron's ``Router.gating``): --moe-router-dtype's, or
    unset the model's (its tokens' dtype, ``params_dtype``)."""
    return ROUTER_DTYPES[c.moe_router_dtype] if c.moe_router_dtype else c.params_dtype


def keeps_input(c) -> bool:
    """Whether the router's GEMM saves its tokens themselves (it computes in the model's dtype: its default) rather
    than a copy in another dtype (``--moe-router-dtype fp32`` in a bf16 / fp16 model); the memory planner's term."""
    return router_dtype(c) == c.params_dtype


def score_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype scores are computed in: float32 from bf16 / fp16 / fp32 logits, as Megatron's
    ``topk_routing_with_score_function`` and ``compute_routing_scores_for_aux_loss`` (softmax with dtype float32,
    ``sigmoid(logits.float())``); float64 logits keep float64 (Megatron drops to float32 there; omnitron's float64
    runs are its exactness checks)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _topk(scores: torch.Tensor, k: int, groups: tuple[int, int] | None):
    """Top-k over all experts, or group-limited when ``groups = (num_groups, group_topk)``."""
    return group_limited_topk(scores, k, *groups) if groups else torch.topk(scores, k, dim=-1)


def top_k_routing(logits: torch.Tensor, k: int, pre_softmax: bool,
                  groups: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [T, k], experts [T, k])`` from router ``logits [T, E]``; probs in :func:`score_dtype`.

    Default (Megatron's): pick the k largest logits (in their own dtype), then softmax over those k. With
    ``pre_softmax`` the probabilities are the softmax over all E experts, taken at the k picked.
    ``groups``: group-limited selection (:func:`group_limited_topk`) over the logits or the softmax.
    """
    if pre_softmax:
        return _topk(torch.softmax(logits, dim=-1, dtype=score_dtype(logits)), k, groups)
    top, experts = _topk(logits, k, groups)
    return torch.softmax(top, dim=-1, dtype=score_dtype(logits)), experts


def sigmoid_routing(logits: torch.Tensor, k: int, groups: tuple[int, int] | None = None,
                    expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 scores: ``sigmoid(logits)``, the k largest picked, then normalised to sum 1 over
    the k picks when ``k > 1`` (Megatron's ``--moe-router-score-function sigmoid``). ``expert_bias [E]``
    (auxiliary-loss-free balancing) is added to the scores for the selection only: the probabilities
    are the unbiased scores of the picked experts. Scores in :func:`score_dtype`."""
    scores = torch.sigmoid(logits.to(score_dtype(logits)))
    if expert_bias is None:
        top, experts = _topk(scores, k, groups)
    else:
        experts = _topk(scores + expert_bias.to(scores.dtype), k, groups)[1]
        top = scores.gather(1, experts)
    return (top / (top.sum(dim=-1, keepdim=True) + 1e-20) if k > 1 else top), experts


def aux_loss_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """``[T, E]`` per-expert scores the load-balancing loss averages: the softmax, or the sigmoid normalised over
    all experts, whatever k (Megatron's ``compute_routing_scores_for_aux_loss``; DeepSeek-V3's ``s'``), in
    :func:`score_dtype`."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1, dtype=score_dtype(logits))
    scores = torch.sigmoid(logits.to(score_dtype(logits)))
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def aux_loss_picks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[T, k]``: the experts the load-balancing loss counts, the top k of the aux ``scores`` over ALL experts.
    Not the router's picks: the expert bias and the group limit steer those, and the loss measures the unbiased,
    unrestricted preference (Megatron's ``compute_routing_scores_for_aux_loss``, DeepSeek-V3's ``f_i``); without
    either the two are the same experts."""
    return torch.topk(scores.detach(), k, dim=-1)[1]


def z_loss(logits: torch.Tensor, coeff: float, stats_group=None) -> torch.Tensor:
    """Router z-loss (ST-MoE) ``coeff * mean_t logsumexp(logits_t)^2`` over the tokens of every rank
    of ``stats_group`` (forward: all-reduce of the sum and count; backward: identity). The logsumexp in the
    logits' dtype (Megatron's ``z_loss_func``), its square and mean in :func:`score_dtype` (a bf16 token count is
    not exact past 256)."""
    sq = torch.logsumexp(logits, dim=-1).to(score_dtype(logits)).square().sum()
    tokens = torch.tensor(float(logits.shape[0]), dtype=sq.dtype, device=logits.device)
    if stats_group is not None and stats_group.size > 1:
        sq, tokens = M.reduce_from_tp(sq, stats_group), M.all_reduce(tokens, stats_group)
    return coeff * sq / tokens


def expert_counts(experts: torch.Tensor, num_experts: int, dtype: torch.dtype) -> torch.Tensor:
    """``[E]``: how many of ``experts``' entries name each expert, as ``dtype`` (exact below 2^24 in float32).
    A scatter-add into ``E`` zeros, not ``torch.bincount``: bincount's output size depends on the data, so a
    compiled layer (``--torch-compile``) broke its graph there (one break per router use: 11 graphs instead of 4
    with a load-balancing loss, 2026-12-06)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=dtype, device=experts.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=dtype, device=experts.device))


def load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, num_experts: int, coeff: float,
                        stats_group=None) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``coeff * E * sum_e f_e * P_e``.

    ``scores [T, E]``: :func:`aux_loss_scores`; ``experts [T, k]``: :func:`aux_loss_picks`.
    ``f_e`` = share of the ``T * k`` assignments that went to expert e (no gradient);
    ``P_e`` = mean router probability of expert e. Both are over the tokens of every rank of
    ``stats_group`` (forward: all-reduce; backward: identity, each rank's tokens get their own
    share of the gradient).
    """
    k = experts.shape[-1]
    counts = expert_counts(experts, num_experts, scores.dtype)  # [E]
    prob_sum = scores.sum(dim=0)  # [E]
    tokens = torch.tensor(float(scores.shape[0]), dtype=scores.dtype, device=scores.device)
    if stats_group is not None and stats_group.size > 1:
        counts, tokens = M.all_reduce(counts, stats_group), M.all_reduce(tokens, stats_group)
        prob_sum = M.reduce_from_tp(prob_sum, stats_group)
    frac = counts / (tokens * k)
    mean_prob = prob_sum / tokens
    return coeff * num_experts * torch.sum(frac * mean_prob)


def sequence_load_balancing_loss(scores: torch.Tensor, experts: torch.Tensor, batch_size: int, num_experts: int,
                                 coeff: float, stats_group=None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (``seq_aux_loss``): per sequence ``sum_e f_e * P_e`` with
    ``f_e = E / (k s) * (tokens of the sequence routed to e)`` and ``P_e`` the sequence's mean normalised score,
    averaged over the micro-batch's sequences, times ``coeff``.

    ``scores [s*b, E]`` (token ``i * b + j`` is position i of sequence j, the ``[s, b, h]`` layout flattened);
    ``experts [s*b, k]``. Under ``stats_group`` (context or sequence parallelism) each rank holds a slice of
    every sequence: the counts, the score sums and the lengths are summed over it (backward: identity).
    """
    k = experts.shape[-1]
    picked = torch.zeros_like(scores).scatter_(1, experts, 1.0)  # [T, E]
    counts = picked.view(-1, batch_size, num_experts).sum(dim=0)  # [b, E], no gradient
    prob_sum = scores.view(-1, batch_size, num_experts).sum(dim=0)  # [b, E]
    length = torch.tensor(float(scores.shape[0] // batch_size), dtype=scores.dtype, device=scores.device)
    if stats_group is not None and stats_group.size > 1:
        counts, length = M.all_reduce(counts, stats_group), M.all_reduce(length, stats_group)
        prob_sum = M.reduce_from_tp(prob_sum, stats_group)
    frac = counts * num_experts / (length * k)
    return coeff * (frac * prob_sum / length).sum(dim=1).mean()


class _AttachAuxLoss(torch.autograd.Function):
    """forward: identity on ``x`` (the aux loss is not part of the output); backward: also seed the
    aux loss's own backward with ``scale`` (the weight the step gives each micro-batch's loss), a float or a
    0-dim tensor read when the backward runs."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = None if isinstance(scale, torch.Tensor) else scale
        if ctx.scale is None:
            ctx.save_for_backward(scale)
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        shape, dtype, device = ctx.aux_meta
        if ctx.scale is None:
            return g, ctx.saved_tensors[0].to(device=device, dtype=dtype).expand(shape), None
        return g, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: "float | torch.Tensor") -> torch.Tensor:
    """``x`` unchanged; backward through it also back-propagates ``scale * aux``."""
    return _AttachAuxLoss.apply(x, aux, scale)


class TopKRouter(nn.Module):
    """``[T, h] -> (probs [T, k], experts [T, k], aux loss or None)``; the aux loss is the sum of
    the load-balancing losses (over the micro-batch, ``aux_loss``, and / or per sequence, ``seq_aux_loss``) and the
    z-loss, whichever are enabled.

    The gate ``weight [E, h]`` is replicated on every rank; the logits and the probabilities are in
    :func:`router_dtype` (the model's, or float32 with ``--moe-router-dtype fp32``), the scores in float32.
    ``partial_grad``: the tokens are a tensor-parallel shard (sequence parallelism), so the
    weight's gradient is a partial sum over tp (marked ``sequence_parallel`` for the reduction).
    ``--moe-router-num-groups`` / ``--moe-router-group-topk``: group-limited selection;
    ``--moe-router-topk-scaling-factor``: the probabilities times it. ``--moe-router-enable-expert-bias``
    (sigmoid scores): the persistent buffer ``expert_bias [E]`` steers the selection, and each training
    forward adds its tokens per expert to ``tokens_per_expert`` (:meth:`count_routed`) for :func:`update_expert_bias`
    after the step.
    """

    def __init__(self, c, *, partial_grad: bool, stats_group=None) -> None:
        super().__init__()
        self.k, self.num_experts, self.pre_softmax = c.moe_router_topk, c.num_experts, c.moe_router_pre_softmax
        self.balancing = balancing_losses(c)  # {type: coefficient}: each enabled load-balancing loss
        self.score_function, self.z_coeff = c.moe_router_score_function, c.moe_z_loss_coeff or 0.0
        self.groups = (c.moe_router_num_groups, c.moe_router_group_topk) if c.moe_router_group_topk else None
        self.scaling_factor = c.moe_router_topk_scaling_factor
        self.stats_group = stats_group
        self.dtype = router_dtype(c)
        self.weight = set_attributes(nn.Parameter(torch.empty(c.num_experts, c.hidden_size, dtype=c.params_dtype)),
                                     parallel=False, init=("normal", c.init_method_std))
        self.weight.sequence_parallel = partial_grad
        self.bias = None
        if router_bias(c):  # a bias on the logits (with --add-bias-linear, as Megatron; gpt-oss's router)
            self.bias = set_attributes(nn.Parameter(torch.empty(c.num_experts, dtype=c.params_dtype)),
                                       parallel=False, init=("zeros",))
            self.bias.sequence_parallel = partial_grad
        self.bias_update_rate = c.moe_router_bias_update_rate
        # with a capacity the layer counts what its experts process (count_routed), not the router's picks
        self.counts_after_capacity = c.moe_expert_capacity_factor is not None
        # Megatron's buffers: the bias is saved with the model, the step's counts are not (None: no expert bias)
        on = c.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(c.num_experts, dtype=torch.float32) if on else None)
        self.register_buffer("tokens_per_expert", torch.zeros(c.num_experts, dtype=torch.float32) if on else None,
                             persistent=False)
        # --moe-expert-load-out: the run's picks per expert (int64, on the device; :mod:`.expert_load` sets it)
        self.register_buffer("expert_picks", None, persistent=False)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs [T, k], experts [T, k])`` of ``logits [T, E]``: the probabilities scaled in the scores' dtype,
        then cast to the logits' (Megatron's ``topk_routing_with_score_function``)."""
        if self.score_function == "sigmoid":
            probs, experts = sigmoid_routing(logits, self.k, self.groups, self.expert_bias)
        else:
            probs, experts = top_k_routing(logits, self.k, self.pre_softmax, self.groups)
        return (probs * self.scaling_factor if self.scaling_factor else probs).to(logits.dtype), experts

    def forward(self, x: torch.Tensor, batch_size: int = 1):
        """``x [s*b, h]`` (the ``[s, b, h]`` layout flattened; ``batch_size`` b matters to ``seq_aux_loss``)."""
        dt = self.dtype
        logits = F.linear(x.to(dt), self.weight.to(dt), None if self.bias is None else self.bias.to(dt))  # [T, E]
        probs, experts = self.route(logits)
        counting = self.counting
        if counting and self.tokens_per_expert is not None and not self.counts_after_capacity:
            self.count_routed(expert_counts(experts, self.num_experts, torch.float32))
        if counting and self.expert_picks is not None:
            with torch.no_grad():  # scatter_add_: no host sync (a device bincount reads its size back)
                picks = experts.reshape(-1)
                self.expert_picks.scatter_add_(0, picks, torch.ones_like(picks))
        aux = None
        if self.training and torch.is_grad_enabled():
            aux = self._balancing_loss(logits, experts, batch_size)
            if self.z_coeff > 0.0:
                z = z_loss(logits, self.z_coeff, self.stats_group)
                aux = z if aux is None else aux + z
        return probs, experts, aux

    @property
    def counting(self) -> bool:
        """Whether this forward's routing counts toward the run's statistics: a training forward with grad, not one
        rerun by recomputation (test it before computing the counts: eval and generation compute none)."""
        return self.training and torch.is_grad_enabled() and not recomputing()

    def count_routed(self, counts: torch.Tensor) -> None:
        """Add a training forward's tokens per expert ``counts [E]`` to ``tokens_per_expert``, the statistics of the
        expert bias's update (a forward without grad, or one rerun by recomputation, adds nothing). Megatron counts
        its routing map after the capacity (``_apply_expert_bias`` after ``apply_router_token_dropping``): the
        dropped pairs left out and, with ``--moe-pad-expert-input-to-capacity``, the padding rows in. Without a
        capacity that is the router's picks, counted here; with one the MoE layer counts its processed pairs."""
        if self.tokens_per_expert is not None and self.counting:
            with torch.no_grad():
                self.tokens_per_expert += counts.to(self.tokens_per_expert.dtype)

    def _balancing_loss(self, logits: torch.Tensor, experts: torch.Tensor, batch_size: int) -> torch.Tensor | None:
        """The sum of the enabled load-balancing losses (``aux_loss``, ``seq_aux_loss``, each with its own
        coefficient, as Megatron's list form adds them), or None when none is."""
        if not self.balancing:
            return None
        scores = aux_loss_scores(logits, self.score_function)  # [T, E]
        # without a group limit or an expert bias the router's picks are that top k already
        steered = self.groups is not None or self.expert_bias is not None
        picks = aux_loss_picks(scores, self.k) if steered else experts
        total = None
        for kind, coeff in self.balancing.items():
            if kind == "seq_aux_loss":
                loss = sequence_load_balancing_loss(scores, picks, batch_size, self.num_experts, coeff,
                                                    self.stats_group)
            else:
                loss = load_balancing_loss(scores, picks, self.num_experts, coeff, self.stats_group)
            total = loss if total is None else total + loss
        return total


@torch.no_grad()
def update_expert_bias(modules, groups, *, sequence_parallel: bool) -> None:
    """Auxiliary-loss-free balancing after a step (Megatron's ``get_updated_expert_bias``, called where
    Megatron finalizes the gradients): each router's token counts of the step, summed over the ranks whose
    tokens differ (dp x cp, and tp under sequence parallelism: without it the tp ranks route the same
    tokens), move its bias by ``rate * sign(mean count - count)``; the counts restart from zero."""
    routers = [m for mod in modules for m in mod.modules()
               if isinstance(m, TopKRouter) and m.expert_bias is not None]
    if not routers:
        return
    counts = torch.stack([r.tokens_per_expert for r in routers])  # [routers, E]
    counts = M.all_reduce(counts, groups.dp_cp)
    if sequence_parallel:
        counts = M.all_reduce(counts, groups.tp)
    for r, n in zip(routers, counts):
        r.expert_bias += torch.sign(n.mean() - n) * r.bias_update_rate
        r.tokens_per_expert.zero_()


def expert_bias_state(modules) -> list[dict[str, torch.Tensor]]:
    """Each module's expert biases by buffer name (for checkpoints that hold parameters only: torch_dist)."""
    return [{n: b.detach().clone() for n, b in m.named_buffers() if n.endswith("expert_bias")} for m in modules]


@torch.no_grad()
def load_expert_bias_state(modules, state: list[dict[str, torch.Tensor]]) -> None:
    """Copy saved expert biases (:func:`expert_bias_state` of any layout: a list of ``{buffer name: tensor}``) into
    the routers of ``modules`` by name. A layer's name carries its index in the whole model, so a stage of another
    pipeline split finds its own layers' biases; ValueError names a router with none saved."""
    saved = {n: t for chunk in state for n, t in chunk.items()}
    for m in modules:
        for name, b in m.named_buffers():
            if not name.endswith("router.expert_bias"):
                continue
            if name not in saved:
                raise ValueError(f"the checkpoint holds no {name}: it was saved by a model without "
                                 f"--moe-router-enable-expert-bias on that layer")
            b.copy_(saved[name])