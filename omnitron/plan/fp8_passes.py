"""What one FP8 linear's forward and backward create for one micro-batch (the per-linear moments
:func:`omnitron.plan.fp8_memory.replay_fp8` adds to the replayed transient probe), counted from
:mod:`omnitron.core.precision.fp8.linear` and ``backends/fp8.py``: bytes of every tensor a pass allocates, in the
order it allocates and frees them, for ``t`` tokens and a weight ``[out, in]``.

Per-tensor recipes (:func:`per_tensor_forward`, :func:`per_tensor_backward`): the operand's FP8 form and its
transpose (:func:`per_tensor_cast`), then the GEMMs' outputs; emulated (no FP8 GEMM on the device), each GEMM's
fp32 copies of its operands and its fp32 product. The cast differs by recipe. **Tensorwise** (current scaling)
reduces the amax first, derives a new scale and returns a new ``scale_inv`` with the FP8 tensors (4 bytes more,
saved with them). **Delayed** as training runs it (``enable_fp8(..., per_step=True)`` after the first optimizer
step, the reducer primed; :func:`~omnitron.core.precision.fp8.linear.FP8Linear._quantize_per_step`) casts with the
role's scale in force (``fp8_cast_transpose_amax``), returns the role's own ``scale_inv`` (held by its
``DelayedScaling``: the weight term's, nothing new) and max-accumulates the local amax into the role's step amax
(two 4-byte scalars: the amax and ``torch.maximum``'s result, copied in place). On the reference kernel (this CPU)
the amax is taken after the cast, beside the FP8 tensor and its transpose; on the Triton kernel (GPU backends) the
cast writes one fp32 amax per 64x64 tile (:data:`CAST_TILE`) and reduces them. A delayed run's first step (no
history yet) quantizes as tensorwise does; priced here is every later step.

Block-wise (:func:`blockwise_forward`, :func:`blockwise_backward`): the quantizations are torch code with an fp32
copy on every device; the GEMMs native only where the device profile says so (:func:`native_gemm`).
"""
from __future__ import annotations

import math

SCALE = 4
"""Bytes of one scale (float32)."""
CAST_TILE = 64
"""Rows and columns of the tile the Triton cast-transpose (``omnitron/kernels/triton_kernels/fp8.py``) writes one
amax partial for under delayed scaling."""
F32 = 4
"""Bytes of a float32 element: the emulated GEMMs' dequantized operands and products, the reference casts' copies."""


def own_scale(fp8) -> int:
    """Bytes of the scale a per-tensor quantization of recipe ``fp8`` returns new: tensorwise's, 4; delayed's is its
    role's ``scale_inv``, held by the role's ``DelayedScaling`` (the ``fp8`` term's state), 0."""
    return 0 if fp8.fp8_recipe == "delayed" else SCALE


def native_gemm(fp8, device=None) -> bool:
    """Whether recipe ``fp8``'s GEMMs run natively (no fp32 copies) on ``device`` (a
    :class:`~omnitron.plan.profile.DeviceProfile`), as the engine's provider decides (``backends/fp8.py``):
    per-tensor GEMMs where the device has an FP8 peak (``torch._scaled_mm`` runs there); block-wise ones only where
    the profile says ``[fp8] block_gemm = "native"`` (``F.scaled_mm`` refused every block-wise layout on the H200,
    torch 2.11). Without a profile: this process's backend (``fp8_gemm``; block-wise emulated)."""
    if device is None:
        if fp8.fp8_recipe == "blockwise":
            return False
        from omnitron.backends import get_backend

        return get_backend().capabilities().fp8_gemm == "scaled_mm"
    if fp8.fp8_recipe == "blockwise":
        return device.fp8_block_gemm == "native"
    return "fp8" in device.peak


def _emulated_mm(m: int, k: int, n: int) -> int:
    """Most bytes the emulated per-tensor GEMM ``(a.float() * sa) @ (b.float() * sb)`` of ``a [m, k]``, ``b [k, n]``
    holds beside its FP8 operands: an operand's fp32 copy beside its scaled copy (the copy freed once scaled), then
    the fp32 product beside both scaled operands (freed before the cast to the output dtype)."""
    return F32 * max(2 * m * k, m * k + 2 * k * n, m * k + k * n + m * n)


def per_tensor_cast(m: int, n: int, native: bool, delayed: bool = False) -> tuple[int, int]:
    """(most bytes quantizing ``[m, n]`` (``FP8Linear.quantize``) holds, the bytes it returns new: the FP8 tensor, its
    transpose and, tensorwise, the scale's inverse). Tensorwise, native (the device's fused cast-transpose kernel):
    the FP8 tensor, its transpose and the scale; the reference (CPU): the amax, the scale, an fp32 copy of the source
    and the FP8 tensor cast from it (the copy freed before the transpose is made). Delayed (module docstring): the
    reference's fp32 copy and FP8 tensor, then the FP8 tensor, its transpose, the amax and the step amax's update;
    native, the FP8 tensor, its transpose, one fp32 amax per :data:`CAST_TILE` tile and their max."""
    if delayed:
        tiles = math.ceil(m / CAST_TILE) * math.ceil(n / CAST_TILE)
        most = 2 * m * n + SCALE * (tiles + 1) if native else max(F32 * m * n + m * n, 2 * m * n + 2 * SCALE)
        return most, 2 * m * n
    return (2 * m * n + SCALE if native else F32 * m * n + m * n + 2 * SCALE), 2 * m * n + SCALE


def bias_grad(out: int, ew: int) -> tuple[int, int]:
    """(most bytes an FP8 linear's bias gradient ``g.sum(0, dtype=float32).to(weight dtype)`` holds, what it keeps):
    the fp32 sum beside its cast (no cast, the sum itself, for an fp32 weight), then ``db`` (``ew`` bytes a row),
    made before the weight-gradient GEMM and held through it (``_FP8LinearFn._backward``)."""
    return F32 * out + (0 if ew == F32 else ew * out), ew * out


def per_tensor_backward(t: int, out: int, inp: int, e: int, ew: int, native: bool, delayed: bool = False,
                        bias: bool = False, deferred: bool = False) -> int:
    """Peak bytes a per-tensor FP8 linear's backward (``_FP8LinearFn._backward``) creates for ``t`` tokens, weight
    ``[out, inp]``, the input's dtype ``e`` bytes and the weight's ``ew``: the output gradient's FP8 form ``qg``
    ``[t, out]``, its transpose ``qg_t`` (1 byte an element each) and, tensorwise, its scale (:func:`per_tensor_cast`;
    ``delayed``: the delayed recipe's cast), then ``dx = qg @ w`` in the input's dtype; ``qg`` is freed once ``dx`` is
    made (``_grad_output_gemms`` hands on only ``qg_t`` and the scale, the weight-gradient GEMM's operands), then
    ``dw = qg_t @ x_t`` in the weight's dtype. Emulated (no FP8 GEMM), each GEMM's fp32 copies of its operands and its
    fp32 product (:func:`_emulated_mm`), and the reference cast's fp32 copy; native (``_scaled_mm``), none. With a
    ``bias``, its gradient is made between the two GEMMs (:func:`bias_grad`). ``deferred``: B of a split backward,
    which stops there (``qg_t``, the scale and ``db`` stashed for W; :func:`per_tensor_wgrad` prices W's GEMM)."""
    cast, q = per_tensor_cast(t, out, native, delayed)
    dx, dw = e * t * inp, ew * out * inp
    most, db = bias_grad(out, ew) if bias else (0, 0)
    kept = q - t * out + dx  # qg_t and the scale, after qg goes, and dx
    if native:
        return max(cast, q + dx, kept + most, *([] if deferred else [kept + db + dw]))
    wgrad = [] if deferred else [kept + db + _emulated_mm(out, t, inp), kept + db + F32 * out * inp + dw]
    return max(cast, q + _emulated_mm(t, out, inp), q + F32 * t * inp + dx, kept + most, *wgrad)


def per_tensor_wgrad(t: int, out: int, inp: int, ew: int, native: bool) -> int:
    """Peak bytes the weight-gradient half of a per-tensor FP8 linear's backward creates when a split backward's W
    runs it apart (its operands ``qg_t``, ``qx_t`` held already): ``dw = qg_t @ x_t`` in the weight's dtype (``ew``
    bytes); emulated, the GEMM's fp32 copies and product (:func:`_emulated_mm`)."""
    dw = ew * out * inp
    return dw if native else max(_emulated_mm(out, t, inp), F32 * out * inp + dw)


def per_tensor_forward(t: int, out: int, inp: int, e: int, native: bool, delayed: bool = False,
                       bias: bool = False) -> int:
    """Peak bytes a per-tensor FP8 linear's forward creates beside the weight's cached FP8 form: the input's FP8 form
    ``qx`` ``[t, inp]``, its transpose ``qx_t`` (saved for backward) and, tensorwise, its scale
    (:func:`per_tensor_cast`), then ``y`` ``[t, out]`` in the input's dtype (``e`` bytes); emulated, the GEMM's fp32
    copies and product and the reference cast's copy. With a ``bias``: ``y + bias``, a second ``y`` beside the
    GEMM's (:func:`bias_add`)."""
    cast, q = per_tensor_cast(t, inp, native, delayed)
    y = e * t * out
    if native:
        return max(cast, q + y + bias_add(y, bias))
    return max(cast, q + _emulated_mm(t, inp, out), q + F32 * t * out + y, q + y + bias_add(y, bias))


def bias_add(y: int, bias: bool) -> int:
    """Bytes the forward's bias add (``_FP8LinearFn.forward``: ``y = y + bias``, after the GEMM: the FP8 GEMMs take
    no bias) makes beside the GEMM's output of ``y`` bytes: its sum, as large (0 without a bias)."""
    return y if bias else 0


def _block_scales(m: int, k: int, block: tuple[int, int]) -> int:
    """Bytes of the fp32 scales of ``[m, k]`` quantized in ``block`` tiles."""
    return SCALE * math.ceil(m / block[0]) * math.ceil(k / block[1])


def _quantize_blocks(m: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """(most bytes ``FP8Provider.quantize_blocks`` of ``[m, k]`` holds: the scales, the source's fp32 copy and the FP8
    tensor cast from it; what it returns: the FP8 tensor and the scales' inverses). Tiles whole (a dimension a multiple
    of the tile's): a ragged one also pads a copy and expands the scales, not counted."""
    s = _block_scales(m, k, block)
    return s + F32 * m * k + m * k, m * k + s


def _block_mm(m: int, k: int, n: int) -> int:
    """fp32 bytes the emulated block-wise GEMM (``FP8Provider._emulated_blockwise``) of ``[m, k] @ [k, n]`` holds
    while casting its product: both dequantized operands (locals, held to its return) and the product."""
    return F32 * (m * k + k * n + m * n)


def blockwise_backward(t: int, out: int, inp: int, e: int, ew: int, native: bool, bias: bool = False,
                       deferred: bool = False) -> int:
    """Peak bytes a block-wise FP8 linear's backward creates: the output gradient quantized in 1x128 tiles (``qg``)
    for ``dx``, then again along tokens (``qgt`` ``[out, t]``) while ``qg`` is still held; ``qg`` is freed when
    ``_grad_output_gemms`` returns (it hands on ``qgt`` only), then the saved wide input is quantized in 128x1 tiles
    (``qxt``) for ``dw``; emulated, each GEMM's fp32 operands and product beside its output. Native: the FP8 operands
    and the quantizations' fp32 copies only (``quantize_blocks`` is torch code on every device). With a ``bias``,
    its gradient is made once ``qg`` has gone, before ``qxt`` (:func:`bias_grad`). ``deferred``: B of a split
    backward, which stops there (``qgt`` and ``db`` stashed for W; :func:`blockwise_wgrad` prices W's half)."""
    (pg, g), (pgt, gt), (px, xq) = (_quantize_blocks(t, out, (1, 128)), _quantize_blocks(out, t, (1, 128)),
                                    _quantize_blocks(t, inp, (128, 1)))
    dx, dw = e * t * inp, ew * out * inp
    most, db = bias_grad(out, ew) if bias else (0, 0)
    mm = (lambda m, k, n: 0) if native else _block_mm
    wgrad = [] if deferred else [dx + gt + db + px, dx + gt + db + xq + mm(out, t, inp) + dw]
    return max(pg, g + mm(t, out, inp) + dx, g + dx + pgt, dx + gt + most, *wgrad)


def blockwise_wgrad(t: int, out: int, inp: int, ew: int, native: bool) -> int:
    """Peak bytes the weight-gradient half of a block-wise FP8 linear's backward creates when a split backward's W
    runs it apart (B quantized ``qgt``): the saved wide input quantized in 128x1 tiles (``qxt``), then ``dw``;
    emulated, the GEMM's fp32 operands and product."""
    px, xq = _quantize_blocks(t, inp, (128, 1))
    return max(px, xq + (0 if native else _block_mm(out, t, inp)) + ew * out * inp)


def blockwise_forward(t: int, out: int, inp: int, e: int, native: bool, bias: bool = False) -> int:
    """Peak bytes a block-wise FP8 linear's forward creates beside the cached weight: the input quantized in 1x128
    tiles (not saved: the forward saves the input wide), then ``y``; emulated, the GEMM's fp32 operands and product
    (freed on its return); with a ``bias``, ``y + bias`` beside ``y`` (:func:`bias_add`)."""
    p, q = _quantize_blocks(t, inp, (1, 128))
    y = e * t * out
    return max(p, q + (0 if native else _block_mm(t, inp, out)) + y, q + y + bias_add(y, bias))


def gemm_bias(m, name: str = "", cfg=None) -> bool:
    """Whether linear module ``m`` (``name`` in its layer) hands its bias to its GEMM (the FP8 executor then adds it
    after the GEMM and makes its gradient): not where ``skip_bias_add`` returns it to a fused op (bias-dropout-add,
    bias-activation), nor where a row-parallel linear over more than one rank adds it after the reduction
    (``tensor/layers.py``). An MLP's fc1 (``name`` ending ``linear_fc1``, ``cfg`` its model's config) skips it as
    this process's backend builds it (:func:`~omnitron.core.transformer.mlp.fused_activation` on its kernel table),
    not as ``m`` does: the plan's skeletons are built on the host's table (its C++ SwiGLU fuses the bias, sim's and
    the GPUs' reference SwiGLU does not; the GPUs' Triton GeLU does, the host's reference does not)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor.layers import RowParallelLinear
    from omnitron.core.transformer.mlp import fused_activation

    if getattr(m, "bias", None) is None:
        return False
    if cfg is not None and name.endswith("linear_fc1"):
        return not fused_activation(cfg, get_backend().kernels)
    if getattr(m, "skip_bias_add", False):
        return False
    return not isinstance(m, RowParallelLinear) or m.group.size == 1
