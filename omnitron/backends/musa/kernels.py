"""Kernel implementations named ``"musa"``: muDNN-backed ops that torch_musa exposes.

Each one states exactly which calls it takes (``supports`` returns the reason it declines
one); everything else runs the reference, and the registry logs the reason once. ``torch.rope``
and ``torch.swish_glu`` are torch_musa additions, absent from stock torch: their presence is
checked when the table is built, never assumed.

``softmax_cross_entropy`` calls ``torch._fused_cross_entropy_loss_2d_forward``. torch_musa's other fused
ops (as its v2.7.1 source has them, ``torch_musa_api/v2.7.1.txt``) are not registered:
``_fused_rmsnorm_forward/backward`` is what its patched ``torch.rms_norm`` calls on a MUSA tensor
(torch_patches/aten_src_ATen_native_layer_norm.cpp.patch), so ``rms_norm`` below reaches it already;
``gated_silu`` is fp32/fp16-only and its derivatives.yaml patch gives it no backward (``swish_glu`` has one,
through ``_fused_swiglu_forward``); ``_scaled_dot_product_attention_flash_musa`` is what SDPA's flash path
calls on MUSA (attention.cpp.patch), which ``attention`` below selects.

Not wrapped: torch_musa's fused AdamW optimizer keeps its own optimizer state, which does not map
onto the stateless multi-tensor ``adamw_step`` op; the engine's optimizer may use it directly.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from omnitron.kernels.registry import register

IMPL = "musa"
FLASH_HEAD_DIMS = (64, 192)
"""Head dims muDNN's flash attention takes in Moore Threads' Transformer Engine port."""
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _provided(attr: str | None = None):
    """``available`` check: torch_musa imported and, when given, ``torch.<attr>`` present."""

    def check() -> tuple[bool, str]:
        if "torch_musa" not in sys.modules:
            return False, "torch_musa is not imported"
        if attr is not None and not hasattr(torch, attr):
            return False, f"this torch_musa does not provide torch.{attr}"
        return True, ""

    return check


# ---- rms_norm: torch.rms_norm, routed to muDNN's fused kernel by torch_musa ---------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_supports(x, weight, eps=1e-5) -> str | None:
    if x.dtype not in _FLOATS:
        return f"dtype {x.dtype} is not fp32/bf16/fp16"
    if weight is None or tuple(weight.shape) != (x.shape[-1],):
        return "weight must be a [hidden] vector"
    if weight.dtype != x.dtype:
        return f"weight dtype {weight.dtype} differs from input dtype {x.dtype}"
    return None


# ---- rope: torch.rope(input, freq_cis, rotary_interleaved, batch_first) ------------------
def _rope_layout(t: torch.Tensor, freqs: torch.Tensor) -> str | None:
    """``"sbhd"`` or ``"bshd"`` when ``freqs`` is one angle row per position of ``t``, else None."""
    if t.dim() != 4 or freqs.dim() != 4:
        return None
    s_f, b_f, h_f, _ = freqs.shape
    if (b_f, h_f) == (1, 1) and s_f == t.shape[0]:
        return "sbhd"
    if (s_f, h_f) == (1, 1) and b_f == t.shape[1]:
        return "bshd"
    return None


def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Reference semantics; muDNN takes Megatron's full-width angle table ``[s, r]`` (each angle
    twice: ``[a, a]`` halves, or ``a0 a0 a1 a1 ...`` when interleaved) and rotates all channels it
    is given, so the pass-through tail is split off here."""
    layout = _rope_layout(t, freqs)
    half = freqs.shape[-1]
    ang = freqs.reshape(-1, half).float()  # [s, r/2]
    emb = torch.stack((ang, ang), dim=-1).flatten(-2) if interleaved else torch.cat((ang, ang), dim=-1)
    r = 2 * half
    out = torch.rope(t[..., :r].contiguous(), emb, rotary_interleaved=interleaved, batch_first=layout == "bshd")
    return torch.cat((out, t[..., r:]), dim=-1) if r < t.shape[-1] else out


def rope_supports(t, freqs, interleaved=False) -> str | None:
    if t.dtype not in _FLOATS:
        return f"dtype {t.dtype} is not fp32/bf16/fp16"
    if _rope_layout(t, freqs) is None:
        return (f"freqs {tuple(freqs.shape)} is not one angle row per position of t {tuple(t.shape)} "
                "([s,1,1,r/2] for [s,b,h,d] or [1,s,1,r/2] for [b,s,h,d])")
    if 2 * freqs.shape[-1] > t.shape[-1]:
        return f"rotary dim {2 * freqs.shape[-1]} exceeds head dim {t.shape[-1]}"
    if freqs.requires_grad:
        return "the fused RoPE gives no gradient for freqs"
    return None


# ---- swiglu: torch.swish_glu(input) = silu(x[..., :f]) * x[..., f:], no bias argument -------
def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.swish_glu(x)


def swiglu_supports(x, bias=None) -> str | None:
    if bias is not None:
        return "torch.swish_glu has no bias argument"
    if x.dtype not in _FLOATS:
        return f"dtype {x.dtype} is not fp32/bf16/fp16"
    if x.shape[-1] % 2:
        return f"last dim {x.shape[-1]} is odd"
    return None


# ---- softmax_cross_entropy: aten::_fused_cross_entropy_loss_2d_forward --------------------------
REDUCTION_NONE = 0
"""``at::Reduction::None``: the fused op returns one loss per row."""


def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """torch_musa's fused 2-D cross-entropy (its patched ``F.cross_entropy`` calls it for [rows, V] logits without
    label smoothing when ``cross_entropy_loss_2d_choice`` says so: LossNLL.cpp.patch); per-token float32 loss."""
    v = logits.shape[-1]
    loss = torch._fused_cross_entropy_loss_2d_forward(logits.reshape(-1, v), target.reshape(-1), None, REDUCTION_NONE,
                                                      -100, label_smoothing)
    return loss.reshape(target.shape).float()


def softmax_cross_entropy_supports(logits, target, label_smoothing=0.0) -> str | None:
    if logits.dtype not in _FLOATS:
        return f"dtype {logits.dtype} is not fp32/bf16/fp16"
    if label_smoothing:
        return "torch_musa takes its fused cross-entropy only without label smoothing"
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        return f"target {tuple(target.shape)} is not logits {tuple(logits.shape)} without the class dim"
    rows, v = logits.reshape(-1, logits.shape[-1]), logits.shape[-1]
    if not torch.cross_entropy_loss_2d_choice(rows, target.reshape(-1), None, REDUCTION_NONE, -100, 0.0):
        return f"cross_entropy_loss_2d_choice declines {tuple(rows.shape)} (vocabulary {v})"
    return None


# ---- attention: SDPA restricted to muDNN's flash kernel ----------------------------------
def attention(q, k, v, causal: bool = True, dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # NOTE: torch_musa honours torch's SDPA backend switches; pinning flash makes a call outside
    # its envelope fail loudly instead of quietly taking the math path.
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)


def attention_supports(q, k, v, causal=True, dropout_p=0.0, scale=None) -> str | None:
    lo, hi = FLASH_HEAD_DIMS
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"flash attention needs bf16/fp16, got {q.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return "q, k, v dtypes differ"
    if q.dim() != 4 or k.dim() != 4:
        return "expects [b, h, s, d] tensors"
    if not lo <= q.shape[-1] <= hi:
        return f"head dim {q.shape[-1]} outside the flash range {lo}-{hi}"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads is not a multiple of {k.shape[1]} key/value heads"
    if dropout_p:
        return "attention dropout inside the fused kernel is not verified on MUSA"
    return None


_registered = False


def register_musa_kernels() -> None:
    """Register the ``musa`` implementations (idempotent; called by ``MUSABackend.register_kernels``)."""
    global _registered
    if _registered:
        return
    _registered = True
    register("rms_norm", IMPL, rms_norm, available=_provided(), supports=rms_norm_supports)
    register("rope", IMPL, rope, available=_provided("rope"), supports=rope_supports)
    register("swiglu", IMPL, swiglu, available=_provided("swish_glu"), supports=swiglu_supports)
    register("attention", IMPL, attention, available=_provided(), supports=attention_supports)
    register("softmax_cross_entropy", IMPL, softmax_cross_entropy,
             available=_provided("_fused_cross_entropy_loss_2d_forward"), supports=softmax_cross_entropy_supports)
