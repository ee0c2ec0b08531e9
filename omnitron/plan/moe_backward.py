"""An MoE layer's local experts in backward on one ep rank, at that rank's rows under a routing histogram.

The chunk's transient probe (:func:`omnitron.plan.moe_activations.transient_probe`) runs every expert padded to the
balanced ``T k / E`` rows. On a skewed rank the experts' backward holds other sizes: the gradient of the rows it
received (``[R, h]``), the input gradients of the experts done so far, and, while one expert runs its backward,
that expert's own gradients (``[n_i, .]``), while it frees the tensors that expert saved in the forward; which of
them meet at the peak depends on the sizes and on the order (the experts run their backward last to first; one
measured in one process, 2026-12-04: a hot expert with 4x the balanced rows raised the chunk's peak by 7.7 KB of
14.9 MB).

So the local experts' forward and backward (:func:`omnitron.core.transformer.moe.experts.run_experts`, each weight's
gradient moved into ``main_grad`` by a hook as training does) is logged once on small probes, as :mod:`.transients`
does for a chunk: every expert at ``K`` rows, at hidden ``H0`` and width ``F0``; then hidden doubled, width doubled,
and each expert's rows doubled in turn (``L + 3`` probes for ``L`` local experts, the same allocations in the same
order, checked). Every storage is linear in the experts' rows (a ``[n_i, .]`` tensor in one expert's, ``[R, .]``
in their sum, a weight gradient in none) and a monomial in hidden and width, so the probes give each storage's
bytes as ``(a_0 + sum_i a_i n_i) (h / H0)^b (f / F0)^c``, and replaying the log at any rows and widths gives the
most the backward holds above the forward's level (:func:`backward_peak`). :func:`skew_bytes` is that at a rank's
rows (:func:`omnitron.plan.moe.moe_local`, the speed model's rows: :func:`omnitron.plan.routing.expert_rows`) less
at balanced rows (0 when less): what the rank's experts' backward may add to the balanced probe's.
:func:`omnitron.plan.memory.estimate` adds what of it exceeds the room the chunk's probe left between its peak and
its experts' backward (:func:`omnitron.plan.transients.experts_windows`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

_H0, _F0, _K = 16, 16, 8
_BACKWARD = "<backward>"
"""The marker event between the experts' forward and their backward in a probe's log."""
_REPLAYS: dict[str, "_Replay"] = {}


@dataclass(frozen=True)
class _Replay:
    """The base probe's log, and per creating event its row coefficients ``(a_0, (a_1..a_L))`` at ``H0, F0``
    and its width exponents ``(b, c)``."""

    events: list
    coef: dict
    exps: dict


def _events(cfg, h: int, f: int, counts: list[int]) -> list:
    """The storages the local experts' forward and backward create and free on ``counts`` rows per expert (hidden
    ``h``, width ``f``), the backward's incoming output gradient included, with a :data:`_BACKWARD` marker between
    them: the backward frees the tensors the forward saved as it goes."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.mlp import MLP
    from omnitron.core.transformer.moe.experts import run_experts
    from omnitron.kernels.alloc_log import Timeline
    from omnitron.plan.transients import _main_grads

    g = ParallelGroups.single()
    c = replace(cfg, hidden_size=h, ffn_hidden_size=f)
    torch.manual_seed(0)
    experts = [MLP(c, group=g.tp, sequence_parallel=False, backend=get_backend(), out_std=0.02, skip_out_bias=False)
               for _ in counts]
    for m in experts:
        _main_grads(m)
    x = torch.randn(sum(counts), h, dtype=cfg.params_dtype, requires_grad=True)
    tl = Timeline()
    with tl:
        y = run_experts(x, list(counts), experts, g.etp, grouped=bool(getattr(cfg, "moe_grouped_gemm", False)))
        tl._sweep()  # the forward's unsaved tensors (each expert's output before the concatenation) are gone
        tl.events.append((_BACKWARD, 0))
        y.backward(torch.ones_like(y))
    return tl.events


def _replay(cfg, local: int) -> _Replay:
    from omnitron.plan.measure import probing

    key = f"{cfg!r}/{local}"
    if key not in _REPLAYS:
        with probing():
            _REPLAYS[key] = _probe(cfg, local)
    return _REPLAYS[key]


def _probe(cfg, local: int) -> _Replay:
    base = [_K] * local
    log = _events(cfg, _H0, _F0, base)
    wide = [_events(cfg, 2 * _H0, _F0, base), _events(cfg, _H0, 2 * _F0, base)]
    rows = [_events(cfg, _H0, _F0, base[:i] + [2 * _K] + base[i + 1:]) for i in range(local)]
    for run in wide + rows:
        if [op for op, _ in run] != [op for op, _ in log]:
            raise RuntimeError(f"plan: the MoE experts' backward probes differ ({len(log)} against {len(run)} "
                               "events); their backward under a routing histogram cannot be scaled")
    coef, exps = {}, {}
    for i, (op, n) in enumerate(log):
        if op is None or n == 0:
            continue
        a = tuple((run[i][1] - n) / _K for run in rows)
        coef[i] = (n - _K * sum(a), a)
        exps[i] = tuple(math.log2(w[i][1] / n) for w in wide)
    return _Replay(log, coef, exps)


def backward_peak(cfg, rows, hidden: int, width: int) -> float:
    """The most bytes the local experts' backward on ``rows`` rows per expert holds above what their forward left
    (its saved tensors, which it frees as it goes), at ``hidden`` and expert width ``width`` (the fc2 input's;
    fc1's is twice it with a gated unit)."""
    rep = _replay(cfg, len(rows))
    live, start, top = 0.0, None, 0.0
    sizes = []
    for i, (op, n) in enumerate(rep.events):
        if op == _BACKWARD:
            start = top = live
        if i in rep.coef:
            (a0, a), (b, c) = rep.coef[i], rep.exps[i]
            n = (a0 + sum(x * r for x, r in zip(a, rows))) * (hidden / _H0) ** b * (width / _F0) ** c
        sizes.append(float(n))
        live += -sizes[n] if op is None else (sizes[i] if op != _BACKWARD else 0.0)
        top = max(top, live) if start is not None else top
    return top - start


def skew_bytes(cfg, s: int, b: int, tp: int, sp: bool, ep: int, etp: int, share=None, rank: int | None = None) -> float:
    """What the local experts' backward on ep rank ``rank`` holds at its peak beyond balanced routing's, under the
    histogram row ``share`` (module docstring); 0 at balanced routing (``share`` None). Arguments as
    :func:`omnitron.plan.moe_activations.moe_layer_extra`."""
    from omnitron.core.models.gpt.config import ffn_size
    from omnitron.plan.moe import moe_local

    if share is None:
        return 0.0
    x = SimpleNamespace(tokens=s * b, tp=tp)
    mine, even = moe_local(cfg, x, ep, etp, sp, share, rank), moe_local(cfg, x, ep, etp, sp, None, rank)
    width = (cfg.moe_ffn_hidden_size or ffn_size(cfg)) // etp
    return max(0.0, backward_peak(cfg, mine.rows, cfg.hidden_size, width) -
               backward_peak(cfg, even.rows, cfg.hidden_size, width))
