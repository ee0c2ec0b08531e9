"""Multi-latent attention over the generation cache's latents, the up-projection absorbed (DeepSeek-V2, sec. 2.1.2).

The expanded path (:meth:`MLASelfAttention._project`) multiplies every cached latent ``c_t [r]`` by ``W_ukv``
at each step: ``L x n x (dn + dv) x r`` multiply-adds and ``[L, b, n, dn + dv]`` keys and values (and their
concatenation with the rotated part) for a cache of ``L`` slots. With ``W_ukv``'s rows split per head into
``W_uk [dn, r]`` and ``W_uv [dv, r]``, associativity moves them off the cache::

    q_nope . (W_uk c_t) = (W_uk^T q_nope) . c_t            query in latent space, [n, r]
    sum_t p_t (W_uv c_t) = W_uv (sum_t p_t c_t)             weighted sum of latents first, [n, r]
    score_t = (q_lat . c_t + q_pe . k_pe_t) * scale         k_pe: the shared rotated key part

so a step costs ``n (dn r + 2 L r + L dr + dv r)`` multiply-adds per query and holds ``[b, n, s, L]`` scores and
``[b, n, s, r]`` latent-space queries and outputs, never a per-head key or value of the cache. The sums run in
another order than the expanded path's (over ``r`` where it sums over ``dn``): equal up to rounding.

Tensor parallelism: the local heads' rows of the column-parallel ``W_ukv`` are the local ``W_uk``, ``W_uv``; the
latents and ``k_pe`` are replicated (the down-projection is), so no communication is added (the output
projection's all-reduce stays). It computes in the weights' dtype with the softmax in float32 or wider; under
FP8 it reads the high-precision ``W_ukv`` where the expanded path runs the FP8 GEMM.

When :class:`~omnitron.core.transformer.mla.MLASelfAttention` uses it: steps through the generation KV cache
(``latent_cache`` set), one new token per step with ``absorb`` None (automatic), every cached step (the
prefill included) with ``absorb=True``, never with ``absorb=False``. It cannot apply, and the expanded path
runs (``absorb=True`` refuses instead), under sequence parallelism (the step's tokens are split over tp and
the up-projection all-gathers them), under context parallelism (the cache and the ring split the sequence)
and in training mode with attention dropout (the expanded path's dropout stream).
"""
from __future__ import annotations

import torch


def absorbed_attention(module, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                       keep: torch.Tensor | None) -> torch.Tensor:
    """``q [s, b, n/tp, dn + dr]`` (its rope part rotated), every slot's ``latent [L, b, r]`` and ``k_pe
    [L, b, 1, dr]``, ``keep [b|1, s, L]`` the slots each query sees (None: all) -> ``[s, b, n/tp * dv]``, the
    input of the output projection."""
    dn, dv, r = module.dn, module.dv, latent.shape[-1]
    s, b, heads = q.shape[:3]
    w = module.linear_kv_up_proj.weight.view(heads, dn + dv, r)
    w_uk, w_uv = w[:, :dn], w[:, dn:]  # [n/tp, dn, r], [n/tp, dv, r]
    q_nope, q_pe = q.split([dn, q.shape[-1] - dn], dim=-1)
    lat = latent.transpose(0, 1)  # [b, L, r]
    q_lat = torch.einsum("sbhd,hdr->bhsr", q_nope, w_uk.to(q.dtype))
    scores = torch.einsum("bhsr,btr->bhst", q_lat, lat) + torch.einsum("sbhd,tbd->bhst", q_pe, k_pe[:, :, 0])
    scores = scores * module.softmax_scale
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    o_lat = torch.einsum("bhst,btr->bhsr", p, lat)
    return torch.einsum("bhsr,hvr->sbhv", o_lat, w_uv.to(q.dtype)).reshape(s, b, heads * dv)
