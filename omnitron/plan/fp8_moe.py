"""What an MoE layer's FP8 experts change in the memory plan (:mod:`omnitron.plan.fp8_memory` prices the rest).

:func:`~omnitron.core.precision.fp8.enable.enable_fp8` converts every routed expert's two linears and the shared
expert's (the router has no FP8 seam: it stays wide), so their cached FP8 weights are in the ``fp8`` term with
every other linear's (:func:`~omnitron.plan.fp8_memory.fp8_linears`: the rank's ``E / ep`` local experts at their
etp shard). Under FP8 ``--moe-grouped-gemm`` falls back to each expert's own GEMMs: ``_grouped_ok`` in
:mod:`omnitron.core.transformer.moe.experts` refuses experts with an FP8 seam, so they run :func:`expert_mlp` per
expert, in FP8, as without the flag; the plan prices them so (:func:`experts_as_run`: the probes run the layers
without the grouped GEMM, which would stack every expert's weights and mark no expert linear). A tiny Mixtral in bf16,
tensorwise (2026-12-05): the step's peak with the flag is the step's without it to the byte (13.095 MiB); the plan
gave +31.7% before, -0.19% after.

**Saved inputs** (:func:`layer_less`, per-tensor recipes). The wide experts' fc1s save views of one storage, the
``[R_e, h]`` rows the dispatch gathered, and each fc2 its own activation output ``[rows, f / etp]``; in FP8 each
linear saves its own input's 1-byte transpose and, tensorwise, a 4-byte scale, and the rows are saved by nothing
else, so one MoE layer saves ``(e - 1) R_e (h + f / etp) - 2 x 4 x E / ep`` less (``R_e``: its local experts' rows at
the plan's routing, :func:`omnitron.plan.moe.moe_local`: balanced, or a histogram's rows on an ep rank; an expert
with no rows still saves its scales). The shared expert is a dense MLP on the layer's ``T`` tokens: fc2
``(e - 1) T shared / tp - 4``; fc1 ``e T_r h - T h - 4``, its FP8 copy of the ``T`` tokens on and the wide input (the
norm output, the ``T_r = T / tp`` shard under SP, which the wide fc1 saves: since 2026-12-05, before its all-gathered
``T h e``) off where nothing else keeps it (``--moe-router-dtype fp32`` in a bf16 model: the router keeps its own
float32 copy), ``- T h - 4`` where the router keeps it (in the model's dtype, its default:
:func:`~omnitron.core.transformer.moe.router.keeps_input`).

**Transients** (:func:`probe_experts`): the transient probe runs every layer of an MoE chunk as an MoE layer of
``E'`` experts (``E``, or 16 when more divide by it: :func:`omnitron.plan.moe_activations.probe_num_experts`), each
padded to ``T k / E'`` rows, and marks each expert linear's moments (:func:`omnitron.plan.transients._mark_linears`);
the replay holds each one's saved input as FP8 at those rows as for a dense linear (the routed fc1s' wide rows are freed
when the layer's ``experts_steps`` returns) and adds its FP8 forward and backward at the rows a routed expert sees on
the rank (``T k ep etp / (tp E)`` at balanced routing: the probe has no ep).
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from omnitron.plan.fp8_passes import gemm_bias, own_scale
from omnitron.plan.transients import ROUTED

SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
"""The shared expert's linears' names in their layer."""


def experts_as_run(settings, cfg):
    """``cfg`` as the engine runs its MoE layers' experts: under ``--fp8-format`` without ``--moe-grouped-gemm``
    (FP8 experts take each expert's own GEMMs, module docstring), else unchanged. The layers
    ``--first-last-layers-bf16`` keeps wide run the grouped GEMM still; they are priced as the rest (not modelled)."""
    return replace(cfg, moe_grouped_gemm=False) if settings.fp8 is not None and cfg.moe_grouped_gemm else cfg


def layer_less(fp8, cfg, s: int, b: int, tp: int, sp: bool, ep: int, etp: int, share=None,
               rank: int | None = None) -> float:
    """Bytes one FP8 MoE layer's experts save less than the wide ones, one micro-batch of ``b`` sequences of ``s``
    tokens (over cp) on this rank (module docstring); ``share``, ``rank``: a routing histogram's row and the ep rank
    whose experts are priced, as :func:`omnitron.plan.moe_activations.moe_layer_extra`. 0 without a per-tensor
    recipe (block-wise saves its inputs wide)."""
    from omnitron.core.transformer.moe.router import keeps_input
    from omnitron.plan.moe import moe_local

    if not fp8.per_tensor:
        return 0.0
    m = moe_local(cfg, SimpleNamespace(tokens=s * b, tp=tp), ep, etp, sp, share, rank)
    e, h, own = cfg.params_dtype.itemsize, cfg.hidden_size, own_scale(fp8)
    less = (e - 1) * sum(m.rows) * (h + m.ffn) - 2 * own * m.local_experts
    if m.shared_ffn:
        fc1 = e * (not keeps_input(cfg)) * m.router_tokens * h - m.tokens * h  # the wide shard off, its FP8 copy on
        less += fc1 + (e - 1) * m.tokens * m.shared_ffn - 2 * own
    return less


def probe_experts(settings, cfg, layer) -> dict[str, tuple[int, int, float, float, float, bool]]:
    """``{name in the layer: (out, in, saved less, saved, tokens, bias)}`` of the FP8 expert linears of one MoE layer of
    the transient probe (module docstring), as :func:`omnitron.plan.fp8_memory.chunk_linears` gives a dense linear's,
    the shapes those of ``layer`` (a decoder layer of the rank's skeleton with an MoE MLP: its tp-local, etp-sharded
    weights); ``tokens``, the rows each pass is priced at: a routed expert's on the rank at balanced routing
    (:func:`omnitron.plan.moe.moe_local`: ``T k ep etp / (tp E)``, which the probe's one process, routing ``T`` tokens
    over its ``E'`` experts with no ep, does not see), the shared expert's ``T``. Saved inputs as the probe holds
    them: the ``E'`` experts' fc1 and fc2 at ``T k / E'`` rows each, the shared expert's at ``T``; the probe runs
    without SP, so a router in the model's dtype keeps the shared fc1's input (its ``saved less`` is then the FP8
    copy's bytes, negative); ``bias``: whether the GEMM gets one (:func:`~omnitron.plan.fp8_passes.gemm_bias`)."""
    from omnitron.core.precision.fp8.enable import linear_modules
    from omnitron.core.transformer.moe.router import keeps_input
    from omnitron.plan.moe import moe_local
    from omnitron.plan.moe_activations import probe_num_experts

    pc, fp8 = settings.parallel, settings.fp8
    T = cfg.seq_length // pc.context_parallel_size * settings.training.micro_batch_size
    e = cfg.params_dtype.itemsize
    tp, ep, etp = pc.tensor_model_parallel_size, pc.expert_model_parallel_size, pc.etp
    real = max(moe_local(cfg, SimpleNamespace(tokens=T, tp=tp), ep, etp, pc.sequence_parallel).rows)
    shapes = {}  # (out, in, bias: whether the GEMM gets one; a routed fc2's never: expert_mlp adds it after)
    for name, m in linear_modules(layer):
        routed = ROUTED.match(name)
        if routed:
            fc1 = routed.group(2) == "1"
            shapes.setdefault(f"fc{routed.group(2)}", (*m.weight.shape, fc1 and gemm_bias(m, name, cfg)))
        elif name in SHARED:
            shapes[name] = (*m.weight.shape, gemm_bias(m, name, cfg))
    experts = probe_num_experts(cfg, tp, etp)
    rows = T * cfg.moe_router_topk / experts
    out = {}
    for j in range(experts):
        for which in ("fc1", "fc2"):
            o, k, bias = shapes[which]
            out[f"mlp.experts.{j}.linear_{which}"] = (*_entry(fp8, e, o, k, rows, True)[:4], real, bias)
    for name in SHARED:
        if name in shapes:
            o, k, bias = shapes[name]
            out[name] = (*_entry(fp8, e, o, k, T, name != SHARED[0] or not keeps_input(cfg)), bias)
    return out


def _entry(fp8, e: int, out: int, inp: int, t: float, own_input: bool) -> tuple[int, int, float, float, float]:
    """A :func:`probe_experts` entry: a per-tensor linear saves ``in x t`` bytes and its scale, which is ``e - 1``
    bytes an element less than the wide input where that input was its own (``own_input``), else more; block-wise
    saves its input wide (0, 0)."""
    if not fp8.per_tensor:
        return out, inp, 0.0, 0.0, t
    saved = inp * t + own_scale(fp8)
    return out, inp, e * inp * t * own_input - saved, saved, t
