"""What ``--fp8-format`` changes in a step's work, for the speed model (:mod:`omnitron.plan.speed`).

FP8 runs the linear layers' GEMMs (every layer GEMM but the router's; the output layer stays wide, as
:data:`omnitron.core.precision.fp8.enable.DEFAULT_EXCLUDE` keeps it, and so do the layers
``--first-last-layers-bf16`` keeps: :func:`omnitron.plan.stage_layers.wide_layers`) and adds the casts that feed
them, priced as element-wise kernels. What is priced follows the code path of
:mod:`omnitron.core.precision.fp8.linear` as a compiled layer runs it (inductor fuses each chain of element-wise
ops into one kernel; a reduction ends a kernel); eager runs more passes (below).

**Per-tensor recipes** (``delayed``, ``tensorwise``): the GEMMs at the device's FP8 rate (``gemm_s("fp8", ...)``:
a profile's ``[efficiency.gemm_fp8]`` curve, a bench report's ``fp8-tensor`` rows). Each quantized tensor -- the
input ``[m, k]`` and the weight ``[k, n]`` forward (the weight every micro-batch: the compiled layer quantizes in
its graph; eager reuses it across micro-batches, so this over-prices eager by the weights' share, about 7 ms a step
of 503 at 1.3B on the H200), the output gradient ``[m, n]`` backward -- is two kernels, counted from
``FP8Linear.quantize``: its amax (``vector_norm(x, inf)``, a reduction: the source read once, :data:`AMAX`)
and the cast-transpose (``fp8_cast_transpose_from_amax``: the source read again, the FP8 operand and its
transpose written, 4 bytes an element from bf16, 6 from fp32, :data:`CAST`), each priced at the memory-bound rate
of its own bytes (:func:`op_bytes`: the source in the model's dtype); the cast-transpose at that rate times the
device's measured cast-transpose fraction (:meth:`omnitron.plan.device_rates.DeviceRates.cast_transpose`: a bench
report's ``fp8_cast_transpose_amax`` row over its copy bandwidth, else the profile's ``[fp8] cast_transpose``, else 1,
noted). That fraction is the Triton kernel's (0.208 on the H200, 2026-12-04), which the CUDA backend runs eager and
a compiled layer only with the opt-in ``triton_graph`` op; by default a compiled layer runs inductor's lowering of
the reference, whose rate alone is unmeasured (BENCHMARKS.md, "the FP8 cast-transpose at its measured rate").

**Block-wise** (1x128 tiles of activations and gradients, 128x128 blocks of weights): ``quantize_blocks`` is a
block amax (the source read, :data:`AMAX`) and a cast writing the FP8 tensor and one fp32 scale per 128 elements,
no transpose (3.03 bytes an element from bf16, 5.03 from fp32, :data:`CAST_BLOCK`). The weight-gradient GEMM
contracts over tokens, so the backward
quantizes the output gradient twice (row tiles for the data gradient, tiles along tokens for the weight
gradient) and the input, saved wide, again in 128x1 tiles: per GEMM the input twice, the weight once, the output
gradient twice. The GEMMs (``gemm_s("fp8-block", ...)``) run natively only where the device profile says so
(``[fp8] block_gemm = "native"``, at the per-tensor FP8 rate); otherwise emulated, as on the H200 with torch 2.11
(``F.scaled_mm`` refused every block-wise layout): each operand dequantized into fp32, an fp32 GEMM (no TF32:
the engine leaves ``allow_tf32`` off), its fp32 result cast to the output dtype
(:meth:`omnitron.plan.device_rates.DeviceRates.gemm_s`).

Eager runs the reference ops unfused: the cast as four fp32 passes (to fp32, scale, clamp, to FP8: 27 bytes an
element from bf16) plus the transpose's copy on CPU; on CUDA the per-tensor cast-transpose is one Triton kernel
(the 4 bytes above); the block-wise dequantization 13 bytes an operand element instead of 5. Not priced.

Not modelled: the delayed recipe's amax history (its per-step reduction); the scale arithmetic's own tiny kernels
(fused into the cast in a compiled layer); the fusion of a cast with its producer (GELU's backward with the output
gradient's cast, in the recorded compiled H200 step: BENCHMARKS.md, "Where the FP8 step's idle time sits").
"""
from __future__ import annotations

WIDE = ("router", "logits")
"""GEMMs that stay wide under FP8 (the router in the model's dtype, or float32 with ``--moe-router-dtype fp32``)."""
AMAX = "fp8_amax"
"""The amax reduction of one quantized tensor (:data:`omnitron.plan.device_rates.PASSES`: its 2-byte source read)."""
CAST = "fp8_cast"
"""The per-tensor cast-transpose kernel: the source read, the FP8 operand and its transpose written (4 bytes)."""
CAST_BLOCK = "fp8_cast_block"
"""The block-wise cast: the source read, the FP8 tensor and a float32 scale per 128 elements written."""
WRITTEN = {AMAX: 0.0, CAST: 2.0, CAST_BLOCK: 1 + 4 / 128}
"""Bytes each quantization kernel writes per source element (FP8 codes, their transpose, block scales)."""


def op_bytes(op: str, elem: int) -> float:
    """Bytes per element of quantization kernel ``op`` (:data:`WRITTEN`'s keys) over a source of ``elem``-byte
    elements: the source read once (the model's dtype: 2 bytes under ``--bf16`` / ``--fp16``, 4 without, where
    the linears' inputs, weights and gradients are fp32) plus what it writes."""
    return elem + WRITTEN[op]


def gemm_dtype(settings, cfg, name: str, dt: str) -> str:
    """The dtype GEMM ``name`` of model ``cfg`` runs in: the router's in float32 with ``--moe-router-dtype fp32``;
    ``fp8`` (per-tensor recipes) or ``fp8-block`` (block-wise) under ``--fp8-format`` unless it is one of
    :data:`WIDE`."""
    if name == "router" and cfg.moe_router_dtype == "fp32":
        return "fp32"
    if settings.fp8 is None or name in WIDE:
        return dt
    return "fp8-block" if settings.fp8.fp8_recipe == "blockwise" else "fp8"


def casts(settings, gemms) -> tuple[list, list]:
    """(forward, backward) ``(op, elements)`` of the FP8 quantizations feeding ``gemms`` (``(name, m, n, k)``, one
    micro-batch's forward GEMMs): per quantized tensor its :data:`AMAX` and its cast; empty without FP8. A GEMM
    with no rows (a routed expert that gets none) still quantizes its weight (``expert_mlp`` runs it: its amax
    joins the reductions); its empty input and gradient read nothing and are left out."""
    if settings.fp8 is None:
        return [], []
    fp8 = [(m, n, k) for name, m, n, k in gemms if name not in WIDE and n * k > 0]
    if settings.fp8.fp8_recipe == "blockwise":
        cast, fwd = CAST_BLOCK, [e for m, n, k in fp8 for e in (m * k, k * n)]
        bwd = [e for m, n, k in fp8 for e in (m * n, m * n, m * k)]  # dgrad's and wgrad's gradient, wgrad's input
    else:
        cast, fwd, bwd = CAST, [e for m, n, k in fp8 for e in (m * k, k * n)], [m * n for m, n, _ in fp8]
    return ([(op, e) for e in fwd if e for op in (AMAX, cast)], [(op, e) for e in bwd if e for op in (AMAX, cast)])


def describe(settings) -> str | None:
    """The assumption printed with an FP8 prediction, or None without FP8."""
    fp8 = settings.fp8
    if fp8 is None:
        return None
    if fp8.fp8_recipe == "blockwise":
        out = (f"FP8 ({fp8.fp8_format}, blockwise): the layers' GEMMs block-scaled (emulated unless the device "
               "profile says native: operands dequantized to fp32, an fp32 GEMM, its result cast), each input, "
               "weight and output gradient quantized as the compiled layer does it (an amax pass, a cast writing "
               "FP8 and a scale per 128; the input and the output gradient again for the weight gradient)")
    else:
        out = (f"FP8 ({fp8.fp8_format}, {fp8.fp8_recipe}): the layers' GEMMs at the device's FP8 rate; each input, "
               "weight (every micro-batch) and output gradient quantized as the compiled layer does it: an amax "
               "pass (2 bytes an element) at the copy rate and a cast-transpose (4) at the device's measured "
               "cast-transpose rate (the Triton kernel's; the copy rate where none is measured)")
    out += "; the output layer and the router wide"
    if fp8.first_last_layers_bf16:
        out += (f"; --first-last-layers-bf16: the first {fp8.num_layers_at_start_in_bf16} and last "
                f"{fp8.num_layers_at_end_in_bf16} layer(s) priced wide, without casts, on the stages holding them")
    return out
