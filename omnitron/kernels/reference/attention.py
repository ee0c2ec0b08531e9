"""Core attention reference: PyTorch's scaled_dot_product_attention (the portable baseline)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.kernels.registry import register


@register("attention", "reference")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, dropout_p: float = 0.0,
              scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``q [b, hq, s, d]`` and ``k, v [b, hkv, s, d]`` (hq a
    multiple of hkv: grouped-query attention). Returns ``[b, hq, s, d]``."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
