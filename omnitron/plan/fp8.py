"""What ``--fp8-format`` changes in a step's work, for the speed model (:mod:`omnitron.plan.speed`).

FP8 runs the linear layers' GEMMs (every layer GEMM but the router's; the output layer stays wide, as
:data:`omnitron.core.precision.fp8.enable.DEFAULT_EXCLUDE` keeps it) at the device's FP8 rate
(``gemm_s("fp8", ...)``: a profile's ``[efficiency.gemm_fp8]`` curve, a bench report's ``fp8-tensor`` rows), and
adds the casts that feed them, priced as element-wise passes (:data:`CAST`):

- forward: the input ``[m, k]`` and the weight ``[k, n]`` of each FP8 GEMM (the weight every micro-batch: what the
  compiled tensorwise layer does; eager reuses it across micro-batches, so this over-prices eager by the weights'
  share, about 7 ms a step of 503 at 1.3B on the H200, BENCHMARKS.md "Where the FP8 step's idle time sits");
- backward: the output gradient ``[m, n]``.

Each cast reads its source twice (its amax, then the cast) and writes the FP8 operand and its transpose (the
weight-gradient GEMM's): ``2 x 2 + 2 x 1`` = 6 bytes an element from bf16, three 2-byte passes.

``--first-last-layers-bf16``: the layers it keeps wide are priced as without FP8
(:func:`omnitron.plan.stage_layers.wide_layers`, :func:`omnitron.plan.speed.stage_cost`).

Not modelled: the delayed recipe's amax history (its per-step reduction), and the block-wise recipe's scales: its GEMMs are priced as per-tensor ones although they
ran emulated on the H200's torch of 2026-12-04 (0.2x bf16, BENCHMARKS.md), so a block-wise prediction is
optimistic (noted with it).
"""
from __future__ import annotations

WIDE = ("router", "logits")
"""GEMMs that stay in the model's dtype under FP8 (the router runs in float32)."""
CAST = "fp8_cast"
"""The element-wise op of one cast (:data:`omnitron.plan.device_rates.PASSES`: 3 passes of a 2-byte element)."""


def gemm_dtype(settings, name: str, dt: str) -> str:
    """The dtype GEMM ``name`` runs in: ``fp8`` under ``--fp8-format`` unless it is one of :data:`WIDE`."""
    if name == "router":
        return "fp32"
    return "fp8" if settings.fp8 is not None and name not in WIDE else dt


def casts(settings, gemms) -> tuple[list, list]:
    """(forward, backward) ``(CAST, elements)`` of the FP8 casts feeding ``gemms`` (``(name, m, n, k)``, one
    micro-batch's forward GEMMs); empty without FP8."""
    if settings.fp8 is None:
        return [], []
    fp8 = [(m, n, k) for name, m, n, k in gemms if name not in WIDE and m * n * k > 0]
    return ([(CAST, e) for m, n, k in fp8 for e in (m * k, k * n)], [(CAST, m * n) for m, n, _ in fp8])


def describe(settings) -> str | None:
    """The assumption printed with an FP8 prediction, or None without FP8."""
    fp8 = settings.fp8
    if fp8 is None:
        return None
    out = (f"FP8 ({fp8.fp8_format}, {fp8.fp8_recipe}): the layers' GEMMs at the device's FP8 rate, their casts "
           "(inputs and weights forward, output gradients backward) at 6 bytes an element; the output layer and "
           "the router wide")
    if fp8.fp8_recipe == "blockwise":
        out += "; block-wise GEMMs priced as per-tensor ones (they ran emulated on the H200, 0.2x bf16): optimistic"
    if fp8.first_last_layers_bf16:
        out += (f"; --first-last-layers-bf16: the first {fp8.num_layers_at_start_in_bf16} and last "
                f"{fp8.num_layers_at_end_in_bf16} layer(s) priced wide, without casts, on the stages holding them")
    return out
