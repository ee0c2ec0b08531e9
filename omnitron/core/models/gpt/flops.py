"""Training FLOPs of MoE, multi-latent-attention and multi-token-prediction models: Megatron-LM's
``num_floating_point_operations`` (``megatron/training/training.py``, ``transformer_flops``, at d98e8a6).

Per step, for ``T`` tokens in ``B`` sequences of length ``s`` (forward + backward = 3 x the forward, 2 FLOPs
per multiply-add, so the factor 6):

    6 T ( h (f e n_dense + f_moe k e n_moe + f_shared e n_moe) + A n_layers + D (3h + 2h^2) + h V (D + 1) )
    + B s^2 C n_layers

``e`` is 3 with SwiGLU (else 2); each of the ``D`` MTP depths adds one layer of the last decoder layer's kind,
its ``eh_proj`` and norms and one more logits GEMM. ``A`` is the attention's projections per token, ``C`` its
core (causal: half of ``QK^T`` and of the values' product). MLA:
``A = 6 (q + r_kv (h + n (d_qk + d_v) + 1) + h d_rope + n d_v h)`` with ``q = r_q (h + n (d_qk + d_rope) + 1)``
(or ``h n (d_qk + d_rope)`` without a query rank), ``C = 6 (n (d_qk + d_rope) / 2 + n d_v / 2)``; otherwise
``A = 6 (h (q + 2 g d) + q h)``, ``C = 6 q`` with ``q = n d``. Megatron counts the latent norms as one
multiply-add per rank element (the ``+ 1``) and no other norm.
"""
from __future__ import annotations

from omnitron.core.transformer.moe.pattern import moe_layer_pattern
from omnitron.core.transformer.shapes import ffn_size, head_dim, padded_vocab_size, query_groups


def megatron_flops(c, batch_size: int, seq_length: int, tp: int = 1) -> float:
    """Megatron's training FLOPs of ``batch_size`` sequences of ``seq_length`` tokens (see the module docstring);
    ``tp``: the tensor-parallel size the vocabulary is padded for (Megatron's ``padded_vocab_size`` depends on it).
    For a dense model (no experts, MLA or MTP) this is Megatron's current dense count, causal core attention."""
    h, s, D = c.hidden_size, seq_length, c.mtp_num_layers or 0
    tokens = batch_size * s
    pattern = moe_layer_pattern(c.moe_layer_freq, c.num_layers) if c.num_experts else [False] * c.num_layers
    n_moe = sum(pattern) + (D if pattern[-1] else 0)
    n_dense = c.num_layers + D - n_moe
    e = 3 if c.swiglu else 2
    mlp = ffn_size(c) * e * n_dense
    if c.num_experts:
        routed = (c.moe_ffn_hidden_size or ffn_size(c)) * c.moe_router_topk * e
        mlp += (routed + (c.moe_shared_expert_intermediate_size or 0) * e) * n_moe
    attn, core = _attention_terms(c, h, head_dim(c), query_groups(c))
    layers = c.num_layers + D
    per_token = 6 * h * mlp + attn * layers + 6 * D * (3 * h + 2 * h * h) + 6 * h * padded_vocab_size(c, tp) * (D + 1)
    return float(tokens * per_token + batch_size * s * s * core * layers)


def _attention_terms(c, h: int, d: int, g: int) -> tuple[float, float]:
    """(projections per token, core per token pair) of one layer's attention, Megatron's counting."""
    n = c.num_attention_heads
    if not c.multi_latent_attention:
        q = d * n
        return 6 * (h * (q + 2 * d * g) + q * h), 6 * q
    qk = c.qk_head_dim + c.qk_pos_emb_head_dim
    q = h * n * qk if c.q_lora_rank is None else c.q_lora_rank * (h + n * qk + 1)
    kv = c.kv_lora_rank * (h + n * (c.qk_head_dim + c.v_head_dim) + 1)
    return 6 * (q + kv + h * c.qk_pos_emb_head_dim + n * c.v_head_dim * h), 6 * (n * qk / 2 + n * c.v_head_dim / 2)
