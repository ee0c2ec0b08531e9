"""Attention over one key/value block with its log-sum-exp, and that block's backward given the
final (all-block) output and log-sum-exp: the compute kernel of ring attention (context parallelism).

Plain PyTorch maths in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype: the ring passes its
inputs as they are, and a flash implementation takes bf16/fp16 natively.
``drop`` (optional) is an attention-dropout multiplier ``[b, hq, sq, sk]`` (0 or ``1 / (1 - p)``)
applied to the block's probabilities; ``mask`` (optional, bool ``[sq, sk]``, True = attend) replaces the
square causal mask (the sliding windows of context parallelism; only the reference takes it). A query row
with no key in the block gets ``lse = -inf`` and a zero output. Grouped-query attention is computed without repeating
keys/values: queries are viewed as ``[b, hkv, hq/hkv, s, d]``. Fast versions (a flash kernel that
returns the log-sum-exp) register under the same op names.
"""
from __future__ import annotations

import torch

from omnitron.kernels.registry import register


def _group(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, hq, s, d] -> [b, hkv, hq/hkv, s, d]`` (query heads of one key/value head together)."""
    b, hq, s, d = q.shape
    return q.reshape(b, hkv, hq // hkv, s, d)


def _upcast(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ts`` in fp32 (fp64 when the first is fp64): the reference's compute dtype."""
    cdt = torch.promote_types(ts[0].dtype, torch.float32)
    return tuple(t.to(cdt) for t in ts)


def _scores(qg: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
            mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, hkv, rep, sq, sk]`` scaled scores; ``causal`` masks key j > query i (square blocks), ``mask``
    (True = attend) every key it does not keep."""
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    elif causal:
        sq, sk = s.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


@register("attention_block_forward", "reference")
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  drop: torch.Tensor | None = None,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [b, hq, sq, d]``, ``k, v [b, hkv, sk, d]`` -> (``out [b, hq, sq, d]``, ``lse [b, hq, sq]``).

    ``out`` is normalised within the block; ``lse`` is the log of the block's softmax denominator,
    which is all the ring needs to merge blocks exactly (dropout leaves it unchanged). ``out`` has ``v``'s
    head dim (multi-latent attention's differs from ``q``'s)."""
    q, k, v = _upcast(q, k, v)
    b, hq, sq, _ = q.shape
    s = _scores(_group(q, k.shape[1]), k, causal, scale, mask)
    lse = torch.logsumexp(s, dim=-1)  # [b, hkv, rep, sq]; -inf where a row sees no key of this block
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))  # such a row: exp(-inf) = 0, not nan
    if drop is not None:
        p = p * _group(drop, k.shape[1])
    out = torch.matmul(p, v.unsqueeze(2))  # [b, hkv, rep, sq, d]
    return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)


@register("attention_block_backward", "reference")
def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool, scale: float, drop: torch.Tensor | None = None,
                   mask: torch.Tensor | None = None):
    """Gradients of one block given the FINAL (all-block) ``out`` and ``lse`` of these query rows.

    With ``p = exp(s - lse)`` the block's share of the final softmax: ``dv = p^T dout``,
    ``ds = p * (dout v^T - rowsum(dout * out))``, ``dq = ds k * scale``, ``dk = ds^T q * scale``
    (with dropout: ``p * drop`` in ``dv`` and ``dout v^T * drop`` in ``ds``).
    Returns ``(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d])``."""
    dout, q, k, v, out, lse = _upcast(dout, q, k, v, out, lse)
    hkv = k.shape[1]
    qg, dog = _group(q, hkv), _group(dout, hkv)
    p = torch.exp(_scores(qg, k, causal, scale, mask) - _group(lse.unsqueeze(-1), hkv))  # [b, hkv, rep, sq, sk]
    dg = None if drop is None else _group(drop, hkv)
    dv = torch.matmul((p if dg is None else p * dg).transpose(-1, -2), dog).sum(2)
    dp = torch.matmul(dog, v.unsqueeze(2).transpose(-1, -2))
    if dg is not None:
        dp = dp * dg
    delta = (dog * _group(out, hkv)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k.unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2) * scale
    return dq.reshape(q.shape), dk, dv
