"""Core attention reference: PyTorch's scaled_dot_product_attention (the portable baseline)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.kernels.registry import register


@register("attention", "reference")
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, dropout_p: float = 0.0,
              scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` for ``q [b, hq, s, d]`` and ``k, v [b, hkv, s, d]`` (hq a
    multiple of hkv: grouped-query attention; ``v``'s head may be narrower, as MLA's). Returns ``[b, hq, s, dv]``.

    On the CPU, SDPA's flash kernel needs equal head widths; a narrower ``v`` (MLA) would send it down the math path
    (full ``[s, s]`` scores, ~1.3x the time of one layer's forward + backward at DeepSeek-V3-tiny's shape). Without
    dropout ``v`` is zero-padded to ``q``'s width and the output trimmed: the same attention in exact arithmetic
    (the padded columns of the output are sums of zeros)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dv = v.shape[-1]
    if dv < q.shape[-1] and q.device.type == "cpu" and dropout_p == 0.0:
        v = F.pad(v, (0, q.shape[-1] - dv))
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)[..., :dv]
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale)
