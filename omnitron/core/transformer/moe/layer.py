"""The Mixture-of-Experts block: a drop-in replacement for the dense MLP of a Transformer layer.

Layout: ep rank ``r`` holds experts ``[r * E/ep, (r+1) * E/ep)``, each the dense model's MLP (GeLU
or SwiGLU) at ``--moe-ffn-hidden-size``, named by its GLOBAL index (``mlp.experts.5.linear_fc1.weight``),
so names and initial values do not depend on the layout. Expert parameters carry ``expert = True``
(``allreduce = False``): their gradients are averaged over ``groups.edp`` (the ranks holding the
same experts), not over data parallelism. With expert tensor parallelism (etp = tp) each expert
is split over tp like the dense MLP (``tensor_model_parallel`` shards, see :mod:`.experts`); with
etp = 1 it is whole on its ep rank.

Tensor parallelism: every tp rank dispatches a disjoint shard of the micro-batch's tokens. Under
sequence parallelism that shard is what the layer receives (``[s/tp, b, h]``); without it the
tokens are replicated over tp, so the router runs on all of them (identical on every tp rank, no
reduction needed) and each tp rank then dispatches its slice of the tokens (sequence-major; padded with
tokens routed nowhere where tp does not divide them, as a one-position decoding step in sharded inference)
and all-gathers the outputs (backward: keep the own slice, the all-gather of the input gradient).

Sharded inference at ep > 1 (:mod:`omnitron.core.inference.sharded`): the ep ranks are data-parallel replicas
that hold the same tokens, so each of them takes its slice of its tp slice too (:attr:`MoELayer.ep_replicated`,
set by the loader) and the outputs are all-gathered over ep: every token goes to its experts once, and every
replica gets the same output bits.

Context parallelism: each cp rank routes and dispatches its own slice of the sequence (the ep group
may span cp ranks: the expert layout re-partitions tp x cp x dp); the router's statistics are summed
over cp (and tp under SP), so the aux loss is the whole micro-batch's on every cp rank.

Optional: a shared expert (a dense tensor-parallel MLP every token goes through, added to the
routed output) and an expert capacity (:mod:`.capacity`), decided over the whole micro-batch.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.random import recomputing
from omnitron.core.transformer.mlp import MLP
from omnitron.core.transformer.moe.capacity import routing_mask
from omnitron.core.transformer.moe.dispatch import combine_steps, dispatch_steps
from omnitron.core.transformer.moe.experts import run_experts
from omnitron.core.transformer.moe.overlap import Steps, drive
from omnitron.core.transformer.moe.router import TopKRouter, attach_aux_loss


def mark_expert(p: nn.Parameter, sharded: bool) -> nn.Parameter:
    """An expert parameter, gradients reduced over edp. ``sharded``: an etp (= tp) shard keeps its
    tensor-parallel attributes; otherwise it is whole on its ep rank (replicated over etp)."""
    if not (sharded and getattr(p, "tensor_model_parallel", False)):
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = False, -1, 1
    p.expert, p.allreduce = True, False
    return p


class MoELayer(nn.Module):
    """``[s, b, h] -> ([s, b, h], None)`` (``[s/tp, b, h]`` under sequence parallelism), like :class:`MLP`.

    ``aux_loss_scale`` (a float, or the 0-dim tensor :func:`~.metrics.set_aux_loss_scale` fills in place) weights
    the router losses' gradient (the step sets it to loss scale /
    micro-batches, the weight of each micro-batch's LM loss); ``aux_loss_total`` accumulates the
    detached loss values for logging (see :mod:`omnitron.core.transformer.moe.metrics`).
    """

    def __init__(self, c, *, groups, sequence_parallel: bool, backend, out_std: float) -> None:
        super().__init__()
        from omnitron.core.transformer.shapes import ffn_size

        self.sp, self.tp, self.ep, self.etp, self.num_experts = (sequence_parallel, groups.tp, groups.ep, groups.etp,
                                                                 c.num_experts)
        self.topk, self.grouped = c.moe_router_topk, c.moe_grouped_gemm
        self.capacity = (c.moe_expert_capacity_factor, c.moe_token_drop_policy, c.moe_pad_expert_input_to_capacity)
        # the ranks whose tokens make up one micro-batch: its cp slices, and its tp shards under SP
        stats = groups.tp_cp if sequence_parallel else groups.cp
        self.router = TopKRouter(c, partial_grad=sequence_parallel, stats_group=stats)
        self.cp_size = groups.cp.size
        expert_cfg = dataclasses.replace(c, ffn_hidden_size=c.moe_ffn_hidden_size or ffn_size(c))
        local = c.num_experts // groups.ep.size
        first = M.local_rank(groups.ep) * local
        self.experts = nn.ModuleDict({
            str(first + i): MLP(expert_cfg, group=groups.etp, sequence_parallel=False, backend=backend,
                                out_std=out_std, skip_out_bias=False)
            for i in range(local)})
        for p in self.experts.parameters():
            mark_expert(p, sharded=groups.etp.size > 1)
        self.shared_experts = None
        if c.moe_shared_expert_intermediate_size:
            shared_cfg = dataclasses.replace(c, ffn_hidden_size=c.moe_shared_expert_intermediate_size)
            self.shared_experts = MLP(shared_cfg, group=groups.tp, sequence_parallel=sequence_parallel,
                                      backend=backend, out_std=out_std, skip_out_bias=False)
        self.aux_loss_scale = 1.0
        self.aux_loss_total: torch.Tensor | None = None
        self.ep_replicated = False
        """Whether the ep ranks hold the same tokens (sharded inference, see the module docstring): each then
        dispatches its slice of them. Training's ep ranks hold different micro-batches: False."""
        self.layer_number: int | None = None
        """The global decoder layer it is the MLP of (0-based; set by the layer; None in a multi-token prediction
        depth): the row of its router's picks in ``--moe-expert-load-out``'s histogram."""

    def _route(self, tokens: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gates [T, E], mask [T, E])``: routing probability of each (token, expert) pair (0 where not
        picked) and the pairs processed (capacity decided over the whole micro-batch: under sequence
        parallelism the tp shards' gates are gathered for it)."""
        probs, experts, aux = self.router(tokens, batch_size)  # [T, k] each
        if aux is not None:
            # NOTE: each cp rank's LM loss share is cp times its slice's (context_parallel_batch) and the router's
            # gradient is averaged over dp x cp: its aux loss (the whole micro-batch's value) gets the same factor
            probs = attach_aux_loss(probs, aux, self.aux_loss_scale * self.cp_size)
            if not recomputing():  # full recomputation reruns the forward in backward: log each loss once
                total = self.aux_loss_total
                self.aux_loss_total = aux.detach() if total is None else total + aux.detach()
        gates = probs.new_zeros(probs.shape[0], self.num_experts).scatter(1, experts, probs)
        picked = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, experts, True)
        factor, policy, pad = self.capacity
        if factor is None:
            return gates, picked
        whole = self.sp and self.tp.size > 1
        g, p = gates.detach(), picked
        if whole:  # NOTE: gloo gathers no bools
            g, p = M.gather_first(g, self.tp), M.gather_first(p.to(torch.uint8), self.tp).bool()
        mask = routing_mask(g, p, self.topk, factor, policy, pad)
        mask = M.split_first(mask, self.tp) if whole else mask
        if self.router.tokens_per_expert is not None and self.router.counting:  # the bias's statistics: pairs kept
            self.router.count_routed(mask.sum(dim=0, dtype=torch.float32))
        return gates, mask

    def forward(self, hidden: torch.Tensor):
        if torch.compiler.is_compiling():  # --torch-compile: no generator (dynamo would run it all eagerly)
            x, gates, mask, splits = self._tokens(hidden)
            if _experts_eager is None:
                raise RuntimeError("MoE layer compiled outside omnitron.core.compile.compile_layers; compile it "
                                   "through --torch-compile")
            y = _experts_eager(self, x.reshape(-1, x.shape[-1]), gates, mask).view(x.shape)
            return self._output(y, hidden, splits)
        return drive(self.forward_steps(hidden))

    def forward_steps(self, hidden: torch.Tensor) -> Steps:
        """:meth:`forward` as steps: it yields with the dispatch, then with the combine, in flight."""
        x, gates, mask, splits = self._tokens(hidden)
        y = (yield from self.experts_steps(x.reshape(-1, x.shape[-1]), gates, mask)).view(x.shape)
        return self._output(y, hidden, splits)

    def _tokens(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """(this rank's tokens ``[s', b, h]`` or ``[n, h]``, their gates and processed pairs ``[s'*b or n, E]``,
        the splits they went through: ``(group, rows before it)`` for each group whose ranks hold the same tokens
        and take a slice each, see :meth:`_slice`: tp without sequence parallelism, then ep where
        :attr:`ep_replicated`)."""
        s, b, h = hidden.shape
        gates, mask = self._route(hidden.reshape(s * b, h), b)  # [s*b, E] each
        groups = [g for g, same in ((self.tp, not self.sp), (self.ep, self.ep_replicated)) if same and g.size > 1]
        if not groups:
            return hidden, gates, mask, []
        x, splits = hidden.reshape(s * b, h), []
        for g in groups:
            splits.append((g, x.shape[0]))
            x, gates, mask = self._slice(x, g), self._slice(gates, g), self._slice(mask, g)
        return x, gates, mask, splits

    @staticmethod
    def _slice(t: torch.Tensor, group) -> torch.Tensor:
        """This rank's contiguous ``ceil(T / n)`` rows of ``t [T, ...]``, the same on every rank of ``group`` (size
        ``n``; sequence-major, so at ``s % tp == 0`` a tp rank's sequence slice), padded at the end to ``n`` equal
        slices: a decoding step holds one position. Padding rows are zero (gates) / False (mask): routed nowhere,
        their output dropped by :meth:`_output`. Backward: the all-gather of the slices' gradients."""
        n = -(-t.shape[0] // group.size)
        pad = n * group.size - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return M.scatter_to_sp(t, group) if t.dtype.is_floating_point else M.split_first(t, group)

    def _output(self, y: torch.Tensor, hidden: torch.Tensor, splits: list):
        """The layer's output from the experts' ``y``: gathered back over each split's group, last first (padding
        dropped), plus the shared expert."""
        if splits:
            for group, rows in reversed(splits):
                y = M.gather_from_sp(y, group, grad_is_partial=False)[:rows]
            y = y.view(hidden.shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden)[0]
        return y, None

    def experts_steps(self, x: torch.Tensor, gates: torch.Tensor, mask: torch.Tensor) -> Steps[torch.Tensor]:
        """Tokens ``x [T, h]`` through their experts and back, weighted by ``gates``: dispatch (all-to-all over ep),
        the local experts, combine; yields with each exchange in flight."""
        rows, plan = yield from dispatch_steps(x, mask, self.ep)
        y = run_experts(rows, plan.local_counts, list(self.experts.values()), self.etp, grouped=self.grouped)
        return (yield from combine_steps(y, gates, plan, self.ep))

    # ---- full (layout-independent) state -----------------------------------------------------
    def fuse_full_state(self, prefix: str, out: dict[str, torch.Tensor]) -> None:
        """Add every other ep rank's experts to ``out`` under their global names (all-gather over ep),
        so a gathered state holds all ``E`` experts on every rank. Collective over ep. (etp shards are
        tp shards: the caller has already merged them over tp.)"""
        if self.ep.size == 1:
            return
        local = self.num_experts // self.ep.size
        mine = sorted(self.experts.keys(), key=int)
        suffixes = [n for n, _ in self.experts[mine[0]].named_parameters()]
        for i, key in enumerate(mine):
            for suffix in suffixes:
                t = out[f"{prefix}experts.{key}.{suffix}"]
                pieces = M.gather_first(t.unsqueeze(0).contiguous(), self.ep)  # [ep, ...]
                for r in range(self.ep.size):
                    out[f"{prefix}experts.{r * local + i}.{suffix}"] = pieces[r]


def _run_experts(moe: MoELayer, x: torch.Tensor, gates: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:meth:`MoELayer.experts_steps` run eagerly inside a compiled layer (``--torch-compile``): the exchange's
    sizes come from the routing (data-dependent row counts, sent as Python ints), so a traced exchange would
    break the graph at each host read and recompile at each new routing (61-62 graphs per rank at ep2 before,
    2026-12-03); disabled, the layer is two graphs, before and after it, whatever the routing."""
    return drive(moe.experts_steps(x, gates, mask))


_experts_eager = None
""":func:`_run_experts` wrapped in ``torch.compiler.disable`` by :func:`prepare_for_compile` (wrapping at import
would import dynamo, 0.5 s, into every process that builds a model)."""


def prepare_for_compile() -> None:
    """Called by :func:`omnitron.core.compile.compile_layers` before anything is traced."""
    global _experts_eager
    if _experts_eager is None:
        _experts_eager = torch.compiler.disable(_run_experts)
