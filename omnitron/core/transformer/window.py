"""Sliding-window attention and attention sinks (gpt-oss, Mistral; Megatron's ``--window-size``,
``--window-attn-skip-freq`` and ``--softmax-type``).

Window ``(left, right)`` (flash-attention's convention, as Megatron): query ``i`` attends to keys
``i - left <= j <= i + right`` (``-1``: unbounded), and causally ``j <= i``; Hugging Face's
``sliding_window = W`` is ``(W - 1, 0)``. ``--window-attn-skip-freq N``: layer ``l`` (1-based) has the
window unless ``l % N == 0`` (gpt-oss: N = 2, windows on the even 0-based layers); a 0/1 list: 1 = window.

Sinks: the softmax of each head gets one extra logit ``a_h`` that takes probability mass and
contributes no value: ``p_ij = exp(s_ij) / (exp(a_h) + sum_j exp(s_ij))``. ``learnable``: ``a_h`` is a
parameter per head (gpt-oss's ``sinks``, Megatron's ``softmax_offset``); ``off-by-one``: ``a_h = 0``.
"""
from __future__ import annotations

import torch

from omnitron.core.config.parallel import ConfigError

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def parse_window(spec) -> tuple[int, int] | None:
    """``--window-size "L,R"`` (or a pair) -> ``(L, R)``; None stays None."""
    if spec is None:
        return None
    try:
        left, right = (int(v) for v in (spec.split(",") if isinstance(spec, str) else spec))
    except (TypeError, ValueError):
        raise ConfigError(f"--window-size {spec!r} is not two integers LEFT,RIGHT such as 128,0") from None
    if left < -1 or right < -1:
        raise ConfigError(f"--window-size {spec!r}: each side is >= 0, or -1 for unbounded")
    return left, right


def window_layers(c) -> list[bool]:
    """``[num_layers]`` True where the layer attends within the window (0-based)."""
    if c.window_size is None:
        return [False] * c.num_layers
    spec = c.window_attn_skip_freq
    if spec is None:
        return [True] * c.num_layers
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise ConfigError(f"--window-attn-skip-freq {n} must be >= 1 (every N-th layer has full attention)")
        return [(i + 1) % n != 0 for i in range(c.num_layers)]
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    return moe_layer_pattern(spec, c.num_layers, "--window-attn-skip-freq", ("full attention", "sliding window"))


def attention_window(c, layer_number: int) -> tuple[int, int] | None:
    """The window of global layer ``layer_number`` (0-based), or None (full causal attention)."""
    if getattr(c, "window_size", None) is None or layer_number >= c.num_layers:
        return None
    return parse_window(c.window_size) if window_layers(c)[layer_number] else None


def keep_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: tuple[int, int] | None) -> torch.Tensor:
    """``[sq, sk]`` bool, True where query position ``qpos[i]`` attends to key position ``kpos[j]``: causal,
    within ``window``."""
    d = qpos[:, None] - kpos[None, :]  # i - j
    keep = d >= 0
    if window is not None and window[0] >= 0:
        keep = keep & (d <= window[0])
    return keep


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                   sinks: torch.Tensor | None, scale: float | None = None, dropout_p: float = 0.0,
                   drop=None) -> torch.Tensor:
    """``softmax([q k^T * scale | sink]) v`` without the sink's column: ``q [b, hq, sq, d]``, ``k, v [b, g, sk,
    d]`` (grouped-query heads repeated), ``keep`` broadcastable to ``[b, hq, sq, sk]``, ``sinks [hq]`` (None:
    a plain masked softmax). The softmax runs in float32 (float64 stays float64). Dropout: ``dropout_p`` from the
    current generator, or ``drop`` (:class:`omnitron.kernels.hash_dropout.HashDropout` of these rows and keys:
    context parallelism's hash masks)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.to(acc).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = probs[..., :-1] if sinks is not None else probs
    if drop is not None:
        probs = probs * drop.multiplier(q.shape[0], q.shape[1], slice(None), acc)
    elif dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, dropout_p, training=True)
    return (probs @ v.to(acc)).to(q.dtype)
