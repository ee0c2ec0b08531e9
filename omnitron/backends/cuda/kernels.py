"""Kernel implementations named ``"cuda_flash"``: torch's fused CUDA attention kernels for ring attention.

``attention_block_forward`` / ``attention_block_backward`` (the per-block kernel of context parallelism)
run ``aten::_scaled_dot_product_flash_attention`` (FlashAttention-2: fp16/bf16, sm_80+, head dim <= 256)
or, for fp32 blocks, ``aten::_scaled_dot_product_efficient_attention`` (memory-efficient attention with
its log-sum-exp), and their backwards given the final output and log-sum-exp, which is exactly the ring's
per-block gradient. Neither builds the block's ``[sq, sk]`` scores. Grouped-query blocks repeat each
key/value head for its query heads (the raw ops take equal head counts) and sum the gradients back.
Calls with context parallelism's attention dropout decline (logged once by the registry): its masks are a hash
of global positions (:mod:`omnitron.kernels.hash_dropout`), which these kernels' own RNG does not draw; they run
the fused Triton block (:mod:`omnitron.kernels.triton_kernels.flash_block`, next in the backend's preference),
or the chunked reference without Triton.
"""
from __future__ import annotations

import torch

from omnitron.backends.cpu.kernels import MASKED
from omnitron.kernels.registry import register

IMPL = "cuda_flash"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_DTYPES = _FLASH_DTYPES + (torch.float32,)
_MAX_HEAD_DIM = 256


def _available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if torch.cuda.get_device_capability() < (8, 0):
        return False, "the fused attention kernels with log-sum-exp need sm_80 or newer"
    return True, ""


def _why_not(q, k, v, causal: bool, drop) -> str | None:
    if drop is not None:
        return "attention dropout (context parallelism's hash masks) runs the Triton flash block or the reference"
    for t in (q, k, v):
        if t.device.type != "cuda" or t.dtype not in _DTYPES or t.dim() != 4:
            return f"needs 4-D CUDA tensors in {[str(d) for d in _DTYPES]}, got {t.dtype} on {t.device.type}"
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return "q, k and v must share a dtype"
    if v.shape[-1] != q.shape[-1]:
        return "v's head dim differs from q's (multi-latent attention): the fused kernels take one head dim"
    if q.shape[-1] > _MAX_HEAD_DIM or q.shape[-1] % 8:
        return f"head dim {q.shape[-1]} is not a multiple of 8 up to {_MAX_HEAD_DIM}"
    if q.shape[1] % k.shape[1]:
        return "query heads must be a multiple of key/value heads"
    if causal and q.shape[2] != k.shape[2]:
        return "a causal block must be square"
    return None


def _fwd_supports(q, k, v, *, causal, scale, drop=None, mask=None):
    return MASKED if mask is not None else _why_not(q, k, v, causal, drop)


def _bwd_supports(dout, q, k, v, out, lse, *, causal, scale, drop=None, mask=None):
    return MASKED if mask is not None else _why_not(q, k, v, causal, drop)


def _expand(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Key/value heads repeated per query head, contiguous (the raw kernels' layout)."""
    rep = q.shape[1] // t.shape[1]
    return (t.repeat_interleave(rep, dim=1) if rep > 1 else t).contiguous()


def _reduce(grad: torch.Tensor, hkv: int) -> torch.Tensor:
    """Gradient of repeated key/value heads summed back onto the ``hkv`` heads."""
    b, h, s, d = grad.shape
    return grad if h == hkv else grad.view(b, hkv, h // hkv, s, d).sum(2)


@register("attention_block_forward", IMPL, available=_available, backends=("cuda",), supports=_fwd_supports,
          traceable=True)
def block_forward(q, k, v, *, causal: bool, scale: float, drop=None, mask=None):
    """(``out [b, hq, sq, d]`` in q's dtype, ``lse [b, hq, sq]`` fp32)."""
    q, k, v = q.contiguous(), _expand(q, k), _expand(q, v)
    if q.dtype in _FLASH_DTYPES:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                     scale=scale)[:2]
    return out, lse[:, :, : q.shape[2]]  # the efficient kernel pads the log-sum-exp rows to a multiple of 32


@register("attention_block_backward", IMPL, available=_available, backends=("cuda",), supports=_bwd_supports,
          traceable=True)
def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, drop=None, mask=None):
    """(dq, dk, dv) of one block given the final ``out`` and ``lse`` of its query rows."""
    hkv, sq, sk = k.shape[1], q.shape[2], k.shape[2]
    dout, q, out = dout.contiguous(), q.contiguous(), out.to(q.dtype).contiguous()
    k, v, lse = _expand(q, k), _expand(q, v), lse.float().contiguous()
    empty = torch.empty(0, dtype=torch.int64, device=q.device)
    if q.dtype in _FLASH_DTYPES:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, empty, empty, scale=scale)
    else:
        lse = torch.nn.functional.pad(lse, (0, -sq % 32))  # back to the forward's padded rows
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse, empty, empty, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, _reduce(dk, hkv), _reduce(dv, hkv)
