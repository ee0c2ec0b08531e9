"""What a Mixture-of-Experts layer saves for backward beyond the dense layer the activation probe measures.

The activation probe (:mod:`.activations`) runs every layer dense (the MLP at ``--ffn-hidden-size``). An MoE
layer (:class:`omnitron.core.transformer.moe.layer.MoELayer`) replaces that MLP; this module prices the
replacement per rank and micro-batch, at **balanced routing** (:func:`omnitron.plan.moe.moe_local`'s sizes:
``T`` tokens of the rank before the tp split, ``T_r`` the router's (``T / tp`` under SP), ``A`` assignments the
rank dispatches (``T k / tp`` dropless; capped or padded with a capacity factor), ``R = A`` rows its local
experts receive over ep, ``R_e = etp R`` after the etp gather). ``e`` is the activation dtype's size.

Derivation from the code path (what autograd saves and why; sums over ranks of an ep group are exact for
dropless routing, since every term is linear in the rows a rank holds):

- router (:class:`~omnitron.core.transformer.moe.router.TopKRouter` and ``MoELayer._route``): its input in
  the router's dtype (``--moe-router-dtype fp32`` in a bf16 / fp16 model: a new float32 ``[T_r, h]`` storage),
  the scores, top-k indices and probabilities, the load-balancing and z-loss statistics, the ``[T_r, k]`` indices
  ``scatter`` keeps for the gates: **probed** in this process (``rho`` per token and ``rho0`` per sample: the float32
  router weight copy of fp32 routing in a bf16 model, the ``[b, E]``/``[E]`` loss statistics), because the score
  function and losses vary;
- dispatch and combine (:mod:`~omnitron.core.transformer.moe.dispatch`): ``mask.t().nonzero`` gives the
  ``[A, 2]`` int64 (token, expert) pairs, kept by ``index_select``, the gate lookup and ``index_add`` (16 B
  each assignment); the gate weights ``[A, 1]`` in the activation dtype and the expert outputs ``[A, h]``
  saved by the weighting ``mul``; the weighted rows ``[A, h]`` saved by ``index_add`` (it keeps its source):
  ``A (16 + e + 2 h e)``;
- experts (:mod:`~omnitron.core.transformer.moe.experts`): fc1's input rows ``[R_e, h]`` and the MLP's own
  tensors per row at width ``f / etp`` (the activation's input and fc2's input: **probed** on one expert,
  ``iota`` per row); the rows the dispatch gathered and the ep/etp exchanges' buffers are not saved (the
  exchanges run on detached tensors and their autograd nodes keep only the splits);
- ep > 1: ``regroup`` and its inverse permutation, int64 ``[R]`` each (``index_select`` keeps them): ``16 R``;
  etp > 1 likewise ``perm`` and its inverse over ``[R_e]``: ``16 R_e``; fc2 biases: the ``[R]`` int64 index
  of their ``index_select``: ``8 R``;
- the shared expert: a dense tensor-parallel MLP of ``--moe-shared-expert-intermediate-size`` on all ``T``
  tokens (its internals probed as the experts', at ``shared / tp``);
- the norm output the MLP input is: the dense MLP's fc1 keeps it (``T_r h e``: under SP its sequence shard,
  :mod:`omnitron.core.parallel.tensor.gather_linear`; before 2026-12-05 the all-gathered ``T h e``); the MoE layer
  keeps it only through the router (in the model's dtype, its default: the input itself) or the shared expert's fc1 (its
  shard likewise), one storage ``T_r h e``.

The layer's extra bytes are the MoE block's minus the dense MLP's (``T_r h e`` and its internals at ``F / tp``
per token, the same probe).

Backward: the MoE block's backward is probed with the transient probe's layers MoE (:func:`transient_probe`):
every expert padded to a capacity of ``T k / E`` rows, which is balanced routing with shapes that are monomials
in the probe's dimensions, as the replay needs. The probe runs the tp-local layer in one process, so it routes
all ``T`` tokens (the real rank ``T / tp``): at tp > 1 its MoE transients are an upper bound. It has no
exchange: with etp > 1 the reduce-scatter's backward is an all-gather of the output gradient (``_gather_v``),
its input repeated etp times and its output, ``[R_e, h]`` each in the activation dtype, live beside every
layer's saved tensors (:func:`moe_exchange_transient`; without it the tiny Mixtral at tp2 + SP, etp2 was
0.26 MiB, 5.4%, under its step peak on both ranks, 2026-12-04: these buffers are 0.25 MiB).

Routing imbalance: with a routing histogram's row (``share``) and an ep rank, ``A`` is what the rank dispatches
and ``R`` / ``R_e`` what that rank's experts receive, from the speed model's rows
(:func:`omnitron.plan.moe.moe_local`, :func:`omnitron.plan.routing.expert_rows`: capped or padded at the
capacity, the drops taken off); :func:`omnitron.plan.memory.estimate` prices every ep rank and reports the
busiest. Its backward transients are the probe's at balanced routing plus what the rank's local experts'
backward holds at its own rows beyond balanced rows (:mod:`.moe_backward`; left out before 2026-12-04 23:00 UTC:
a skewed ep2 step's peak was then up to 3.4% over the plan in tests/plan/test_transients.py).
Not modelled: dropped tokens at balanced routing (a capacity factor is taken as dropping nothing). FP8 experts
save their own copies (:mod:`.fp8_moe`, taken off with the FP8 linears' savings). The ep
all-to-all's buffers in backward are left out on evidence: with 2 MiB buffers (1.8% of the step) a padded
ep2 step's peak rose by the regroup indices the plan adds and not by them (BENCHMARKS.md, 2026-12-04).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from omnitron.plan.measure import SavedBytes, probing

_T1 = 64


@dataclass(frozen=True)
class MoERates:
    """Probed per-unit bytes: ``rho`` router bytes per routed token beyond its input, ``rho0`` per sample;
    ``expert`` / ``shared`` / ``dense`` the MLP's own saved bytes per row (fc1 input excluded) of one
    expert (``f / etp``), the shared expert (``shared / tp``) and the dense MLP (``F / tp``)."""

    rho: float
    rho0: float
    expert: float
    shared: float
    dense: float


def _saved(fn, x: torch.Tensor, module) -> int:
    """Saved bytes of ``fn(x)`` beyond ``x``'s own storage and ``module``'s parameters."""
    rec = SavedBytes([*module.parameters(), x])
    with rec.record():
        fn(x)
    return rec.total


_W0 = 64


def _mlp_row(cfg, width: int, expert: bool) -> float:
    """Bytes per row an MLP of ``width`` saves beyond its input: the expert path (``expert_mlp``) or the dense
    ``MLP.forward``. Its tensors are ``[rows, c w]`` (fc1's output, the activation's), so it is probed at hidden
    and widths ``64, 128`` and the line through them taken at ``width`` (a real-size MLP would be built at
    hundreds of millions of parameters)."""
    if not width:
        return 0.0
    one, two = _mlp_probe(cfg, _W0, expert), _mlp_probe(cfg, 2 * _W0, expert)
    return one + (two - one) * (width - _W0) / _W0


def _mlp_probe(cfg, width: int, expert: bool) -> float:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.mlp import MLP
    from omnitron.core.transformer.moe.experts import expert_mlp

    c = replace(cfg, hidden_size=_W0, ffn_hidden_size=width)
    torch.manual_seed(0)
    mlp = MLP(c, group=ParallelGroups.single().tp, sequence_parallel=False, backend=get_backend(), out_std=0.02,
              skip_out_bias=not expert)
    x = torch.randn(_T1, 1, _W0, dtype=cfg.params_dtype, requires_grad=True)
    if expert:
        return _saved(lambda t: expert_mlp(mlp, t.view(_T1, -1)), x, mlp) / _T1
    return _saved(mlp, x, mlp) / _T1


def _router(cfg) -> tuple[float, float]:
    """(per token, per sample) bytes the router and ``_route`` save beyond their input, at ``T = 64, 128``
    (the experts themselves are built at width 1: only the routing runs)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe.layer import MoELayer

    c = replace(cfg, moe_ffn_hidden_size=1, moe_shared_expert_intermediate_size=None,
                moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False)
    torch.manual_seed(0)
    m = MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(), out_std=0.02)
    m.train()
    torch.nn.init.normal_(m.router.weight, std=0.02)
    got = []
    for t in (_T1, 2 * _T1):
        x = torch.randn(t, cfg.hidden_size, dtype=cfg.params_dtype, requires_grad=True)
        got.append(_saved(lambda v: m._route(v, 1), x, m))
    per = (got[1] - got[0]) / _T1
    return per, got[0] - per * _T1


_CACHE: dict[str, MoERates] = {}


def moe_rates(cfg, tp: int, etp: int) -> MoERates:
    """:class:`MoERates` of ``cfg`` at tensor-parallel size ``tp`` and expert-tensor-parallel size ``etp``."""
    from omnitron.core.models.gpt.config import ffn_size

    key = f"{cfg!r}/{tp}/{etp}"
    if key not in _CACHE:
        f = cfg.moe_ffn_hidden_size or ffn_size(cfg)
        shared = cfg.moe_shared_expert_intermediate_size or 0
        with probing():
            rho, rho0 = _router(cfg)
            _CACHE[key] = MoERates(rho, rho0, _mlp_row(cfg, f // etp, True), _mlp_row(cfg, shared // tp, False),
                                   _mlp_row(cfg, ffn_size(cfg) // tp, False))
    return _CACHE[key]


def moe_layer_extra(cfg, s: int, b: int, tp: int, sp: bool, ep: int, etp: int, share=None,
                    rank: int | None = None) -> float:
    """Bytes one MoE layer saves beyond the dense layer of the same config, one micro-batch of ``b`` sequences
    of ``s`` tokens on this rank (``s`` already divided by cp), following the module docstring's terms.
    ``share``: a routing histogram's row (None: balanced), priced on ep rank ``rank``'s experts (None: the
    layer's busiest; :func:`omnitron.plan.moe.moe_local`)."""
    from omnitron.core.transformer.moe.router import keeps_input
    from omnitron.plan.moe import moe_local

    m = moe_local(cfg, SimpleNamespace(tokens=s * b, tp=tp), ep, etp, sp, share, rank)
    r = moe_rates(cfg, tp, etp)
    e, h, T = cfg.params_dtype.itemsize, cfg.hidden_size, m.tokens
    A, R, rows = m.assignments, m.received, sum(m.rows)  # sent; received; at the experts (R_e = etp R)
    block = r.rho * m.router_tokens + r.rho0 * b + A * (16 + e + 2 * h * e) + rows * (h * e + r.expert)
    block += 16 * R * (ep > 1) + 16 * rows * (etp > 1) + 8 * R * bool(cfg.add_bias_linear)
    shared = bool(cfg.moe_shared_expert_intermediate_size)
    block += T * r.shared
    # one storage: the norm output (the sequence shard under SP, ``T_r`` tokens), which the router keeps (in the
    # model's dtype) and the shared expert's fc1 (its input shard: gather_linear), as the dense MLP's fc1 does
    block += m.router_tokens * h * e * (keeps_input(cfg) or shared)
    return block - m.router_tokens * h * e - T * r.dense


def moe_exchange_transient(cfg, s: int, b: int, tp: int, sp: bool, ep: int, etp: int, share=None,
                           rank: int | None = None) -> float:
    """The etp all-gather's buffers in an MoE layer's backward (module docstring): ``2 R_e h e``, 0 at etp 1
    (``share``, ``rank``: as :func:`moe_layer_extra`)."""
    from omnitron.plan.moe import moe_local

    if etp == 1:
        return 0.0
    m = moe_local(cfg, SimpleNamespace(tokens=s * b, tp=tp), ep, etp, sp, share, rank)
    return 2.0 * sum(m.rows) * cfg.hidden_size * cfg.params_dtype.itemsize


_PROBE_EXPERTS = 16


def _local(cfg, tp: int, etp: int):
    """``cfg`` as the transient probe runs its tp-local MoE layer in one process: the dense MLP at ``F / tp``, the
    experts at ``f / etp``, the shared expert at ``shared / tp``, dropless; more than 16 experts become 16 (when
    they divide; top-k over all of them): the probe logs every expert's GEMMs, 256 of them took minutes for
    DeepSeek-V3, while the same rows in fewer experts move only each expert's share of the backward's
    gradients (a larger share: an upper bound) and the ``[T, E]`` router tensors, which the rates count. (64
    experts, top-8, llama-tiny widths, 2026-12-04: the chunk's transient the same to the byte, 0.7 s against 3.4.)"""
    from omnitron.core.models.gpt.config import ffn_size

    shared = cfg.moe_shared_expert_intermediate_size or 0
    E = cfg.num_experts
    few = E > _PROBE_EXPERTS and E % _PROBE_EXPERTS == 0 and cfg.moe_router_topk <= _PROBE_EXPERTS
    experts = dict(num_experts=_PROBE_EXPERTS, moe_router_num_groups=None, moe_router_group_topk=None) if few else {}
    return replace(cfg, ffn_hidden_size=ffn_size(cfg) // tp, moe_ffn_hidden_size=(cfg.moe_ffn_hidden_size
                                                                                   or ffn_size(cfg)) // etp,
                   moe_shared_expert_intermediate_size=shared // tp or None, moe_expert_capacity_factor=None,
                   moe_pad_expert_input_to_capacity=False, **experts)


def probe_num_experts(cfg, tp: int, etp: int) -> int:
    """How many experts an MoE layer of :func:`transient_probe` has (:func:`_local`: ``E``, or 16 when more divide
    by it)."""
    return _local(cfg, tp, etp).num_experts


def transient_probe(cfg, probe, k: int, tp: int, etp: int):
    """The transient probe ``probe`` (widths divided by ``k``) with every layer MoE at balanced routing: each
    expert padded to a capacity of ``T k / E`` rows (module docstring)."""
    local = _local(cfg, tp, etp)
    widths = (local.moe_ffn_hidden_size, local.moe_shared_expert_intermediate_size or 0)
    if any(w % k for w in widths):
        raise RuntimeError(f"plan: the MoE widths {widths} do not divide by the probe's {k}; the memory model "
                           "cannot scale their transients")
    return replace(probe, num_experts=local.num_experts, moe_router_num_groups=local.moe_router_num_groups,
                   moe_router_group_topk=local.moe_router_group_topk, moe_layer_freq=1,
                   moe_ffn_hidden_size=widths[0] // k,
                   moe_shared_expert_intermediate_size=widths[1] // k or None, moe_expert_capacity_factor=1.0,
                   moe_pad_expert_input_to_capacity=True)


def probe_layer_extra(cfg, s: int, b: int, tp: int, etp: int) -> float:
    """What one layer of :func:`transient_probe`, scaled to the real size, saves beyond the dense layer."""
    return moe_layer_extra(_local(cfg, tp, etp), s, b, 1, False, 1, 1)
