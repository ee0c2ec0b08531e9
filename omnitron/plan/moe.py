"""The work of one Mixture-of-Experts layer on one rank, per micro-batch: GEMMs, element-wise ops and the bytes
its collectives move, at **balanced routing** (every expert receives ``T k / E`` of the ``T`` tokens' ``k``
picks, the ideal the load-balancing loss trains towards; stated with every prediction).

What one rank does (:class:`omnitron.core.transformer.moe.layer.MoELayer`):

1. the router's GEMM ``[T_r, h] @ [h, E]`` in float32 over the tokens it holds (``T / tp`` under SP; all ``T``
   otherwise, replicated over tp);
2. with tp > 1 each tp rank dispatches its ``1 / tp`` of the tokens (without SP it takes its sequence slice, and
   gathers the outputs back: an all-gather of ``[T, h]`` forward, of the gates' ``[T, E]`` float32 gradient and
   the tokens' ``[T, h]`` gradient backward);
3. expert parallelism: the per-expert row counts (int64 ``[E]``) and the rows themselves are exchanged over ep
   (all-to-all of ``A = processed assignments x h``, forward; the same backward), and back after the experts;
4. expert tensor parallelism (etp > 1): each etp rank gathers the rows of its etp peers (an all-gather of the
   counts and a variable all-to-all of ``etp x A`` rows), runs its ``1 / etp`` shard of each local expert on
   them, and reduce-scatters the partial outputs (another ``etp x A`` rows);
5. the local experts' MLPs (``E / ep`` of them), each on the ``ep etp / tp`` shares of its rows that its ep and
   etp peers send, then the gate weighting and the scatter-add back to the tokens;
6. the shared expert, a dense tensor-parallel MLP of ``--moe-shared-expert-intermediate-size``.

Capacity (``--moe-expert-capacity-factor F``): each expert processes ``min(T k / E, ceil(F T k / E))`` rows
of the micro-batch (exactly the capacity with ``--moe-pad-expert-input-to-capacity``), ``T`` the rank's
tokens before the tp split (:mod:`omnitron.core.transformer.moe.capacity`).

With a measured routing histogram (``share``: each expert's part of the assignments) the rows follow it, the
capacity drops what exceeds it, and the sizes are those of the ep group's busiest rank
(:mod:`omnitron.plan.routing`); balanced routing is the histogram ``1 / E`` each.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.models.gpt.config import ffn_size, router_bias
from omnitron.core.transformer.moe.validate import balancing_losses
from omnitron.plan.routing import busiest_rank, expert_rows, rows_floor


@dataclass(frozen=True)
class MoELocal:
    """Rank-local sizes of one MoE layer for one micro-batch (balanced routing)."""

    tokens: int
    """T: the tokens of the micro-batch on this rank before the tp split (``b s / cp``)."""
    router_tokens: int
    per_expert: int
    """Rows the busiest local expert processes from one micro-batch (all tp shards)."""
    assignments: int
    """A: rows this rank dispatches."""
    received: int
    """R: rows the ep group's busiest rank (or the rank asked for) receives for its local experts (= A at balanced
    routing)."""
    local_experts: int
    rows: tuple[int, ...]
    """Rows each local expert's GEMMs see after the ep exchange and the etp gather (on the busiest rank)."""
    hidden: int
    ffn: int
    fc1: int
    """The expert's fc1 / fc2 widths on this etp shard."""
    shared_ffn: int
    shared_fc1: int
    experts: int
    tp: int
    ep: int
    etp: int
    sp: bool


def moe_local(cfg, x, ep: int, etp: int, sp: bool, share=None, rank: int | None = None) -> MoELocal:
    """:class:`MoELocal` from the dense shapes ``x`` (:func:`omnitron.plan.work.local_shapes`); ``share``: each
    expert's part of the assignments (a measured routing histogram's row; None: balanced); ``rank``: the ep rank
    whose experts' rows are taken (None: the busiest)."""
    E, tp = cfg.num_experts, x.tp
    T = x.tokens
    c = expert_rows(cfg, T, share)
    local = E // ep
    r = busiest_rank(c, ep) if rank is None else rank
    mine = c[r * local:(r + 1) * local]
    f = cfg.moe_ffn_hidden_size or ffn_size(cfg)
    shared = cfg.moe_shared_expert_intermediate_size or 0
    return MoELocal(tokens=T, router_tokens=T // tp if sp else T, per_expert=rows_floor(max(mine)),
                    assignments=rows_floor(sum(c) / tp), received=rows_floor(sum(mine) * ep / tp),
                    local_experts=local, rows=tuple(rows_floor(v * ep * etp / tp) for v in mine),
                    hidden=cfg.hidden_size, ffn=f // etp,
                    fc1=(2 * f if cfg.swiglu else f) // etp, shared_ffn=shared // tp,
                    shared_fc1=(2 * shared if cfg.swiglu else shared) // tp, experts=E, tp=tp, ep=ep, etp=etp, sp=sp)


def moe_gemms(m: MoELocal) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one MoE layer's forward GEMMs on one rank (the router's is float32)."""
    out = [("router", m.router_tokens, m.experts, m.hidden)]
    for rows in m.rows:
        out += [("expert_fc1", rows, m.fc1, m.hidden), ("expert_fc2", rows, m.hidden, m.ffn)]
    if m.shared_ffn:
        out += [("shared_fc1", m.tokens, m.shared_fc1, m.hidden), ("shared_fc2", m.tokens, m.hidden, m.shared_ffn)]
    return out


def moe_collectives(cfg, m: MoELocal, elem: int, stats: int) -> tuple[list, list]:
    """(forward, backward) ``(op, bytes, group size)`` of one MoE layer's collectives per micro-batch, the
    bench's byte convention (the buffer, the gathered output, the reduce-scatter input, the all-to-all buffer).
    ``stats``: the size of the group the router's loss statistics are summed over (cp, times tp under SP).

    The shared expert's tensor-parallel collectives are those of a dense MLP and are listed by the caller."""
    capacity, bias = cfg.moe_expert_capacity_factor is not None, cfg.add_bias_linear
    fwd, bwd = [], []
    if stats > 1:  # float32 sums: the load-balancing loss's counts, tokens and probabilities; the z-loss's two
        # NOTE: seq_aux_loss sums b x E counts and scores (priced here at E, as the micro-batch's loss)
        lb = len(balancing_losses(cfg))  # each enabled loss sums its own statistics
        fwd += [("all_reduce", 4 * m.experts, stats), ("all_reduce", 4, stats), ("all_reduce", 4 * m.experts, stats)
                ] * lb
        fwd += [("all_reduce", 4, stats)] * 2 if cfg.moe_z_loss_coeff else []
    T, h, E = m.tokens, m.hidden, m.experts
    if m.tp > 1 and not m.sp:  # the sequence slice out, the outputs and gradients gathered back
        fwd.append(("all_gather", T * h * elem, m.tp))
        bwd += [("all_gather", T * h * elem, m.tp), ("all_gather", T * E * 4, m.tp)]
    if m.tp > 1 and m.sp and capacity:  # capacity decided over the whole micro-batch: gates and picks gathered
        fwd += [("all_gather", T * E * 4, m.tp), ("all_gather", T * E, m.tp)]
    if m.ep > 1:  # the token counts' exchange (int64 [E]), then the rows' (handed_over)
        fwd.append(("all_to_all", E * 8, m.ep))
        fwd, bwd = fwd + handed_over(m, elem)[0], bwd + handed_over(m, elem)[1]
    if m.etp > 1:
        got = m.received * h * elem  # the etp peers gather what their ep exchange received
        fwd += [("all_gather", m.local_experts * 8 * m.etp, m.etp), ("all_to_all", m.etp * got, m.etp),
                ("all_to_all", m.etp * got, m.etp)]
        bwd += [("all_to_all", m.etp * got, m.etp), ("all_to_all", m.etp * got, m.etp)]
        if bias:  # the local experts' fc2 biases: gradients summed over etp
            bwd.append(("all_reduce", m.local_experts * h * elem, m.etp))
    return fwd, bwd


def handed_over(m: MoELocal, elem: int) -> tuple[list, list]:
    """(forward, backward) ``(op, bytes, group size)`` of the collectives of one MoE layer at which a combined pair
    of ``--overlap-moe-expert-parallel-comm`` hands over to its other pass (``all_to_all_steps`` and the reverse
    all-to-all in ``core/transformer/moe/dispatch.py``): the rows' all-to-alls over ep, the dispatch's and the
    combine's, each way. The rest of :func:`moe_collectives` is waited where it is issued: the token counts'
    all-to-all (the host reads the received counts for the rows' splits before the rows go), the router's
    statistics, the tp gathers and the etp exchanges. Empty at ep 1."""
    if m.ep == 1:
        return [], []
    rows = max(m.assignments, m.received) * m.hidden * elem  # the larger of a rank's sends and the busiest's receipts
    return [("all_to_all", rows, m.ep)] * 2, [("all_to_all", rows, m.ep)] * 2


def moe_elementwise(cfg, m: MoELocal) -> list[tuple[str, int]]:
    """(op, elements) of one MoE layer's forward element-wise work (each has a backward of its size): the
    experts' activation over their rows, and the token dispatch and combine over the ``A x h`` rows (the
    engine's own, measured as ``moe_dispatch``: the pair mask's nonzero, the gather, the counts, the gate
    weighting, the scatter-add); the shared expert's activation. The router's softmax and top-k over
    ``[T_r, E]`` are priced as one ``add``."""
    act = "silu_mul" if cfg.swiglu else "gelu"
    ops = [(act, sum(m.rows) * m.ffn)]
    ops += [("moe_dispatch", m.assignments * m.hidden), ("add", m.router_tokens * m.experts)]
    if m.ep > 1:  # the received rows regrouped expert-major, and back before the return all-to-all (two gathers)
        ops += [("add", m.received * m.hidden)] * 2
    if m.shared_ffn:
        ops.append((act, m.tokens * m.shared_ffn))
    return ops


def moe_layer_params(cfg, tp: int, ep: int, etp: int) -> tuple[float, float]:
    """(dense, expert) parameters of one MoE layer on one rank: attention, norms and the router (replicated),
    the shared expert (tp-split); the ``E / ep`` local experts at ``1 / etp`` each."""
    from omnitron.plan.work import layer_params

    h, bias = cfg.hidden_size, 1 if cfg.add_bias_linear else 0
    f, shared = ffn_size(cfg), cfg.moe_shared_expert_intermediate_size or 0

    def mlp(width: int, split: int) -> float:
        fc1 = 2 * width if cfg.swiglu else width
        return (fc1 * (h + bias) + width * h) / split + bias * h

    router = cfg.num_experts * (h + (1 if router_bias(cfg) else 0))
    dense = layer_params(cfg, tp) - mlp(f, tp) + router + (mlp(shared, tp) if shared else 0)
    return dense, cfg.num_experts // ep * mlp(cfg.moe_ffn_hidden_size or f, etp)
