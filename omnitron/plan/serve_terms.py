"""The serving estimate's per-phase byte terms on one tensor-parallel rank (the KV cache's bytes a token, the
prefill's MLP, attention and output-head phases), shared by :mod:`omnitron.plan.inference` (GPT / Llama / MLA)
and :mod:`omnitron.plan.serve_families` (T5, LLaVA); the terms are described in :mod:`omnitron.plan.inference`."""
from __future__ import annotations

from omnitron.core.transformer.shapes import ffn_size, head_dim, padded_vocab_size, query_groups

_RESIDUAL = 5
"""``[T, h]`` tensors alive in any phase: the residual stream, the norm's output, the phase's output, the residual
sum, and one more (the norm's or the sum's temporary)."""


def kv_bytes_per_token(cfg, tp: int, layers: int, elem: int) -> int:
    """KV-cache bytes of one token over ``layers`` layers on one tp rank (see the module docstring)."""
    if getattr(cfg, "multi_latent_attention", False):
        return layers * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * elem
    return layers * 2 * max(query_groups(cfg) // tp, 1) * head_dim(cfg) * elem


def _mlp(cfg, tp: int, tokens: int, elem: int, moe: bool) -> int:
    """The MLP phase: the residual, norm and output ``[T, h]`` and the up-projection's output with the activation
    (gated: the fused ``2f`` projection, ``silu(gate)`` and the product; else ``f`` twice)."""
    h, gated = cfg.hidden_size, cfg.swiglu
    if moe:
        f, rows = cfg.moe_ffn_hidden_size or ffn_size(cfg), tokens * cfg.moe_router_topk
        shared = cfg.moe_shared_expert_intermediate_size or 0
    else:
        f, rows, shared = ffn_size(cfg), tokens, 0
    up = (4 if gated else 2) * (rows * f + tokens * shared) // tp
    return (_RESIDUAL * tokens * h + up + (rows - tokens) * h) * elem


def _attention(cfg, tp: int, batch: int, prompt: int, elem: int, padded: bool) -> int:
    """The attention phase: the ``[T, h]`` tensors, the projections (q, k, v and their head-major copies), the
    heads' output; left-padded prompts add what SDPA's math path (cpu, sim) holds at its peak: the fp32 scores and
    probabilities ``[b, heads, s, s]``, its additive fp32 mask ``[b, 1, s, s]``, a bool ``[b, heads, s, s]``
    (one byte a score), and under grouped-query attention the keys and values repeated to every query head (new
    ``[b, heads, s, d]`` tensors beside the cache's). Measured on sim for SDPA alone (b 4-8, s 256-512, 4-8
    heads): peak ``(2 heads + 1) x 4 + heads`` bytes per ``(b, s, s)`` element plus the output and the repeats."""
    tokens, h = batch * prompt, cfg.hidden_size
    heads = cfg.num_attention_heads // tp
    if getattr(cfg, "multi_latent_attention", False):
        qk, v = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim, cfg.v_head_dim
        proj = heads * (2 * qk + v) + cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        out, repeated = heads * v, 0
    else:
        d = head_dim(cfg)
        groups = max(query_groups(cfg) // tp, 1)
        proj, out = (heads + 2 * groups) * d, heads * d
        repeated = 2 * heads * d if groups < heads else 0
    scores = ((2 * heads + 1) * 4 + heads) * batch * prompt * prompt if padded else 0
    return (_RESIDUAL * tokens * h + 2 * tokens * proj + tokens * out + padded * tokens * repeated) * elem + scores


def _head(cfg, tp: int, tokens: int, rows: int, elem: int) -> int:
    """The output head at ``rows`` positions (``T``, or the ``B`` last ones): while the output layer runs, the last
    layer's output ``[T, h]``, the final norm's output ``[rows, h]`` and this rank's logits ``[rows, V / tp]``,
    twice where its vocabulary shard holds padding (the copy with those columns at -inf,
    ``GPTModel._mask_padding``); under tp then, the hidden states freed, its logits and the whole vocabulary twice
    (``gather_last``: the all-gather's ``[tp rows, V / tp]`` and their concatenation ``[rows, V]``)."""
    vocab = padded_vocab_size(cfg, tp)
    local = vocab // tp * (2 if vocab > cfg.vocab_size else 1)
    layer = (tokens + rows) * cfg.hidden_size + rows * local
    return max(layer, rows * (vocab // tp + 2 * vocab) if tp > 1 else 0) * elem


def prefill_bytes(cfg, tp: int, batch: int, prompt: int, elem: int, *, last: bool, moe: bool,
                  padded: bool = True, log_probs: bool = False) -> int:
    """The prefill's largest phase (module docstring) on one rank of a stage (``last``: it holds the head;
    ``log_probs``: the prompt's are wanted, so the head runs at every position)."""
    tokens = batch * prompt
    phases = [_mlp(cfg, tp, tokens, elem, moe), _attention(cfg, tp, batch, prompt, elem, padded)]
    return max(phases + ([_head(cfg, tp, tokens, tokens if log_probs else batch, elem)] if last else []))
