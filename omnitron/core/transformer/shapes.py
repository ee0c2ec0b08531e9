"""Derived sizes of a transformer layer, read from any config that has Megatron's field names.

The layers (attention, MLP, MoE, cross-attention) need these and nothing else of a model's config, so
they live here rather than in one family's package: a family's config only has to carry
``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``, ``num_query_groups`` and ``kv_channels``.
"""
from __future__ import annotations


def ffn_size(c) -> int:
    """``--ffn-hidden-size``, Megatron's default 4 x hidden."""
    return c.ffn_hidden_size or 4 * c.hidden_size


def query_groups(c) -> int:
    """Key/value heads (``--num-query-groups``); one per query head without grouped-query attention."""
    return c.num_query_groups or c.num_attention_heads


def head_dim(c) -> int:
    """``--kv-channels``, default hidden / heads."""
    return c.kv_channels or c.hidden_size // c.num_attention_heads
