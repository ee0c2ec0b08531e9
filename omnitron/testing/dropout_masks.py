"""The attention-dropout keep mask a block kernel applies, read back from its outputs.

A fused kernel never materialises its mask; these calls choose inputs that make each output element a
positive multiple of one mask element or zero, so the drop positions of the forward and of both backward
products come back exactly (a comparison of booleans, no tolerance): with zero scores every probability of
a visible key is positive; ``v = I`` makes ``out[i, j] = p_ij m_ij``; with ``out = 0`` and ``lse = 0``
(``p = 1``, ``delta = 0``) and ``dout v^T = c`` the score gradient is ``ds_ij = c m_ij``, which ``k = I`` turns
into ``dq`` and ``q = I`` into ``dk`` (``dout = I``: ``dv`` too). Used by the tests and the device check of
benchmarks/flash_hash_dropout.py against :meth:`omnitron.kernels.hash_dropout.HashDropout.multiplier`.
"""
from __future__ import annotations

import torch


def _eye(b: int, h: int, n: int, m: int, dtype, device) -> torch.Tensor:
    return torch.eye(n, m, dtype=dtype, device=device).expand(b, h, n, m).contiguous()


def visible(sq: int, sk: int, causal: bool, device) -> torch.Tensor:
    """``[sq, sk]``: the keys a query row attends to (top-left causal: key ``j <= i``)."""
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return ok.tril() if causal else ok


def expected(drop, b: int, hq: int, sq: int, sk: int, causal: bool, device) -> torch.Tensor:
    """``[b, hq, sq, sk]``: the reference's kept elements (the hash), among the visible ones."""
    return (drop.multiplier(b, hq, slice(None), torch.float32) > 0) & visible(sq, sk, causal, device)


def forward_kept(forward, drop, b: int, hq: int, hkv: int, sq: int, sk: int, causal: bool, dtype, device):
    """``[b, hq, sq, sk]``: the elements ``forward`` keeps (``sk`` becomes ``v``'s head dim)."""
    q = torch.zeros(b, hq, sq, 16, dtype=dtype, device=device)
    k = torch.randn(b, hkv, sk, 16, device=device).to(dtype)
    out, _ = forward(q, k, _eye(b, hkv, sk, sk, dtype, device), causal=causal, scale=1.0, drop=drop)
    return out > 0


def backward_kept(backward, drop, b: int, h: int, sq: int, sk: int, causal: bool, dtype, device):
    """``(from dq, from dk, from dv)``, each ``[b, h, sq, sk]``: the elements ``backward`` keeps in each product
    (equal query and key/value heads: ``dk`` and ``dv`` of grouped heads would sum their masks)."""
    z = dict(causal=causal, scale=1.0, drop=drop)
    ones = torch.ones(b, h, sk, 16, dtype=dtype, device=device)
    lse = torch.zeros(b, h, sq, device=device)
    dq, _, _ = backward(torch.ones(b, h, sq, 16, dtype=dtype, device=device),  # dout v^T = 16
                        torch.zeros(b, h, sq, sk, dtype=dtype, device=device), _eye(b, h, sk, sk, dtype, device),
                        ones, torch.zeros(b, h, sq, 16, dtype=dtype, device=device), lse, **z)
    eye_q = _eye(b, h, sq, sq, dtype, device)
    _, dk, dv = backward(eye_q, eye_q, torch.zeros(b, h, sk, sq, dtype=dtype, device=device),  # dout v^T = 1
                         torch.ones(b, h, sk, sq, dtype=dtype, device=device),
                         torch.zeros(b, h, sq, sq, dtype=dtype, device=device), lse, **z)
    return dq > 0, dk.transpose(-1, -2) > 0, dv.transpose(-1, -2) > 0
