"""YaRN rotary scaling (Megatron-Core's ``YarnRotaryEmbedding``) of multi-latent attention, and of grouped-query
attention under ``--position-embedding-type yarn`` (gpt-oss: its rotated q and k are multiplied by the
concentration factor, its softmax scale stays ``1/sqrt(d)``, as Megatron's GPTModel with ``yarn``).

The rotated channels of MLA (``--qk-pos-emb-head-dim`` of them) use the inverse frequencies
``inv = inter * (1 - mask) + extra * mask``: ``extra = base^(-2i/d)`` (plain RoPE), ``inter = extra /
--rotary-scaling-factor`` (interpolated), ``mask`` 1 for the fast channels and 0 for the slow ones with a
linear ramp between the correction dims of ``beta_fast`` / ``beta_slow`` rotations over the original
context. The rotated parts are multiplied by the concentration factor ``m(s, mscale) / m(s, mscale_all_dim)``
and the softmax scale is ``m(s, mscale_all_dim)^2 / sqrt(q head dim)``, with ``m(s, a) = 0.1 a ln s + 1``
(1 for ``s <= 1``). With scaling factor 1 (the default) all of it is plain RoPE and 1/sqrt(d).
"""
from __future__ import annotations

import math

import torch

ORIGINAL_MAX_POSITIONS, BETA_FAST, BETA_SLOW = 4096, 32.0, 1.0
"""Megatron's MLATransformerConfig defaults (--yarn-original-max-position-embeddings, --yarn-beta-fast/-slow)."""


def yarn_get_mscale(scale: float, mscale: float) -> float:
    """``0.1 * mscale * ln(scale) + 1``, or 1 for ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def concentration(c) -> float:
    """The factor the rotated q and k parts are multiplied by."""
    s = c.rotary_scaling_factor
    return yarn_get_mscale(s, c.mscale) / yarn_get_mscale(s, c.mscale_all_dim)


def softmax_scale(c) -> float:
    """MLA's softmax scale: ``m(s, mscale_all_dim)^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim)``."""
    return yarn_get_mscale(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(
        c.qk_head_dim + c.qk_pos_emb_head_dim)


def _correction_dim(rotations: float, dim: int, base: float, positions: int) -> float:
    return dim * math.log(positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(c, dim: int | None = None) -> torch.Tensor:
    """Inverse frequencies ``[dim / 2]`` (default ``qk_pos_emb_head_dim``; float32, computed in float64).
    ``--no-yarn-correction-range-round-to-int`` (HF's ``truncate: false``, gpt-oss) keeps the ramp's ends
    fractional."""
    d, base, s = dim or c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor
    extra = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    if s == 1.0:
        return extra.float()
    positions = c.yarn_original_max_position_embeddings or ORIGINAL_MAX_POSITIONS
    fast = BETA_FAST if c.yarn_beta_fast is None else c.yarn_beta_fast
    slow = BETA_SLOW if c.yarn_beta_slow is None else c.yarn_beta_slow
    low, high = _correction_dim(fast, d, base, positions), _correction_dim(slow, d, base, positions)
    if getattr(c, "yarn_correction_range_round_to_int", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # Megatron's guard against a zero-width ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = 1.0 - ramp
    return (extra / s * (1 - mask) + extra * mask).float()
