"""Kernel implementations named ``"cpu_flash"``: ATen's flash-attention kernels for the CPU.

``attention_block_forward`` / ``attention_block_backward`` (the per-block kernel of ring attention)
run ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, which tile the block
and never build its ``[sq, sk]`` score matrix, and return the log-sum-exp the ring merges blocks
with. Their backward, given the final output and log-sum-exp, is exactly the ring's per-block
gradient. Calls with attention dropout (context parallelism's hash masks, :mod:`omnitron.kernels.hash_dropout`)
or a non-square causal block decline and run the (chunked) reference.
"""
from __future__ import annotations

import torch

from omnitron.kernels.registry import register

IMPL = "cpu_flash"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
MASKED = "a masked block (sliding window, attention sinks) runs the reference"
"""What a fused block kernel says to a ``mask`` (the engine gives masked blocks to the reference itself)."""


def flash_available() -> tuple[bool, str]:
    """Whether this torch has ATen's CPU flash-attention kernel (and the reason when not)."""
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return False, "this torch has no aten::_scaled_dot_product_flash_attention_for_cpu"
    return True, ""


def _why_not(q, k, v, causal: bool, drop, device_type: str = "cpu") -> str | None:
    if drop is not None:
        return "attention dropout (context parallelism's hash masks) runs the chunked reference"
    for t in (q, k, v):
        if t.device.type != device_type or t.dtype not in _DTYPES or t.dim() != 4:
            return (f"needs 4-D {device_type} tensors in {[str(d) for d in _DTYPES]}, "
                    f"got {t.dtype} on {t.device.type}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return "q, k and v must share a dtype"
    if v.shape[-1] != q.shape[-1]:
        return "v's head dim differs from q's (multi-latent attention): the fused kernels take one head dim"
    if q.shape[1] % k.shape[1]:
        return "query heads must be a multiple of key/value heads"
    if causal and q.shape[2] != k.shape[2]:
        return "a causal block must be square"
    return None


def supports_on(device_type: str):
    """The (forward, backward) ``supports`` checks of these kernels for tensors on ``device_type``."""

    def fwd(q, k, v, *, causal, scale, drop=None, mask=None):
        return MASKED if mask is not None else _why_not(q, k, v, causal, drop, device_type)

    def bwd(dout, q, k, v, out, lse, *, causal, scale, drop=None, mask=None):
        return MASKED if mask is not None else _why_not(q, k, v, causal, drop, device_type)

    return fwd, bwd


_fwd_supports, _bwd_supports = supports_on("cpu")


@register("attention_block_forward", IMPL, available=flash_available, backends=("cpu",), supports=_fwd_supports,
          traceable=True)
def block_forward(q, k, v, *, causal: bool, scale: float, drop=None, mask=None):
    """(``out [b, hq, sq, d]`` in q's dtype, ``lse [b, hq, sq]`` float32 (float64 for float64 inputs)); ``drop`` and
    ``mask`` are declined by ``supports`` (the reference's parameters, accepted so every call binds)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


@register("attention_block_backward", IMPL, available=flash_available, backends=("cpu",), supports=_bwd_supports,
          traceable=True)
def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, drop=None, mask=None):
    """(dq, dk, dv) of one block given the final ``out`` and ``lse`` of its query rows."""
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
        lse.to(torch.float32 if q.dtype != torch.float64 else torch.float64).contiguous(), 0.0, causal, scale=scale)
    return dq, dk, dv
