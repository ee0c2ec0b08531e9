"""Attention over one key/value block with its log-sum-exp, and that block's backward given the
final (all-block) output and log-sum-exp: the compute kernel of ring attention (context parallelism).

Plain PyTorch maths in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype: the ring passes its
inputs as they are, and a flash implementation takes bf16/fp16 natively.
``drop`` (optional) is the block's counter-based attention dropout (:class:`omnitron.kernels.hash_dropout.
HashDropout`: seed, p, the rows' and keys' global positions), applied to the block's probabilities; ``mask``
(optional, bool ``[sq, sk]``, True = attend) replaces the square causal mask (the sliding windows of context
parallelism; only the reference takes it). A query row with no key in the block gets ``lse = -inf`` and a
zero output. Grouped-query attention is computed without repeating keys/values: queries are viewed as
``[b, hkv, hq/hkv, s, d]``. Fast versions (a flash kernel that returns the log-sum-exp) register under the
same op names.

Both directions run in chunks of :data:`ROW_CHUNK` query rows (each chunk sees all the block's keys, so its
log-sum-exp is exact without a merge; backward's rows are independent given the final ``out`` and ``lse``):
scores, probabilities and the chunk's dropout multiplier, drawn from the hash, are ``O(ROW_CHUNK x sk)``,
never ``O(sq x sk)``; the mask is regenerated in backward, never stored. A causal square block's chunk takes
only the keys up to its last row (the rest are masked): half the work of the whole block. At most three
chunk-sized tensors are alive at once (the scores scaled and masked in place, the hash's words mixed through one
scratch tensor, backward's multiplier drawn before ``dp`` and turned into ``p * m`` in place; five before).
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


ROW_CHUNK = 256
"""Query rows per chunk of the reference block (peak scores ``[b, hq, ROW_CHUNK, sk]``)."""


def _chunks(sq: int, causal: bool, mask):
    """``(rows, keys)`` per chunk: a causal square block's chunk needs only the keys up to its last row."""
    for lo in range(0, sq, ROW_CHUNK):
        hi = min(lo + ROW_CHUNK, sq)
        yield slice(lo, hi), slice(0, hi) if causal and mask is None else slice(None)


def _scores(qg: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
            rows: slice) -> torch.Tensor:
    """``[b, hkv, rep, len(rows), sk]`` scaled scores of the query rows ``rows`` of ``qg``; ``causal`` masks key
    j > query i (square blocks), ``mask`` (True = attend, ``[sq, sk]``) every key it does not keep."""
    s = torch.matmul(qg[..., rows, :], k.unsqueeze(2).transpose(-1, -2)).mul_(scale)  # one chunk-sized tensor
    if mask is not None:
        s.masked_fill_(~mask[rows], float("-inf"))
    elif causal:
        sk = s.shape[-1]
        i = torch.arange(rows.start, rows.stop, device=s.device)
        s.masked_fill_(i[:, None] < torch.arange(sk, device=s.device)[None, :], float("-inf"))
    return s


def _drop(drop, b: int, hq: int, hkv: int, rows: slice, keys: slice, dtype) -> torch.Tensor | None:
    """The chunk's dropout multiplier ``[b, hkv, rep, rows, keys]`` (None without dropout)."""
    return None if drop is None else _group(drop.narrow(slice(None), keys).multiplier(b, hq, rows, dtype), hkv)


@register("attention_block_forward", "reference")
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  drop=None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [b, hq, sq, d]``, ``k, v [b, hkv, sk, d]`` -> (``out [b, hq, sq, d]``, ``lse [b, hq, sq]``).

    ``out`` is normalised within the block; ``lse`` is the log of the block's softmax denominator,
    which is all the ring needs to merge blocks exactly (dropout leaves it unchanged). ``out`` has ``v``'s
    head dim (multi-latent attention's differs from ``q``'s)."""
    q, k, v = _upcast(q, k, v)
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    qg = _group(q, hkv)
    out = q.new_empty(qg.shape[:-1] + v.shape[-1:])  # [b, hkv, rep, sq, dv]
    lse = q.new_empty(qg.shape[:-1])
    for rows, keys in _chunks(sq, causal, mask):
        p = _scores(qg, k[:, :, keys], causal, scale, mask, rows)
        lse[..., rows] = torch.logsumexp(p, dim=-1)  # -inf where a row sees no key of this block
        p.sub_(lse[..., rows].nan_to_num(neginf=0.0).unsqueeze(-1)).exp_()  # such a row: exp(-inf) = 0
        d = _drop(drop, b, hq, hkv, rows, keys, p.dtype)
        out[..., rows, :] = torch.matmul(p if d is None else p.mul_(d), v[:, :, keys].unsqueeze(2))
    return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)


@register("attention_block_backward", "reference")
def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool, scale: float, drop=None,
                   mask: torch.Tensor | None = None):
    """Gradients of one block given the FINAL (all-block) ``out`` and ``lse`` of these query rows.

    With ``p = exp(s - lse)`` the block's share of the final softmax: ``dv = p^T dout``,
    ``ds = p * (dout v^T - rowsum(dout * out))``, ``dq = ds k * scale``, ``dk = ds^T q * scale``
    (with dropout multiplier ``m``: ``p * m`` in ``dv`` and ``dout v^T * m`` in ``ds``), chunk by chunk of rows.
    Returns ``(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d])``."""
    dout, q, k, v, out, lse = _upcast(dout, q, k, v, out, lse)
    b, hq, sq, _ = q.shape
    hkv = k.shape[1]
    qg, dog, og, lg = _group(q, hkv), _group(dout, hkv), _group(out, hkv), _group(lse.unsqueeze(-1), hkv)
    dq, dk, dv = torch.empty_like(qg), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys in _chunks(sq, causal, mask):
        kc, vc = k[:, :, keys], v[:, :, keys]
        p = _scores(qg, kc, causal, scale, mask, rows).sub_(lg[..., rows, :]).exp_()  # [b, hkv, rep, rows, keys]
        do = dog[..., rows, :]
        d = _drop(drop, b, hq, hkv, rows, keys, p.dtype)  # before dp: the hash's words and p, not dp too
        dp = torch.matmul(do, vc.unsqueeze(2).transpose(-1, -2))
        if d is not None:
            dp.mul_(d)
        dv[:, :, keys] += torch.matmul((p if d is None else d.mul_(p)).transpose(-1, -2), do).sum(2)  # d: done
        del d
        ds = dp.sub_((do * og[..., rows, :]).sum(-1, keepdim=True)).mul_(p)
        dq[..., rows, :] = torch.matmul(ds, kc.unsqueeze(2)) * scale
        dk[:, :, keys] += torch.matmul(ds.transpose(-1, -2), qg[..., rows, :]).sum(2) * scale
    return dq.reshape(q.shape), dk, dv
