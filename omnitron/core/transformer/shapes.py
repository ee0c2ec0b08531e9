"""Derived sizes of a transformer layer, read from any config that has Megatron's field names.

The layers (attention, MLP, MoE, cross-attention) need these and nothing else of a model's config, so
they live here rather than in one family's package: a family's config only has to carry
``hidden_size``, ``num_attention_heads``, ``ffn_hidden_size``, ``num_query_groups`` and ``kv_channels``.
"""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError


def ffn_size(c) -> int:
    """``--ffn-hidden-size``, else Megatron's default: 4 x hidden, and with ``--swiglu`` (whose MLP has a third
    matrix) two thirds of that rounded down to a multiple of 64 (Megatron's ``validate_args``)."""
    if c.ffn_hidden_size:
        return c.ffn_hidden_size
    return swiglu_default_ffn(c.hidden_size) if getattr(c, "swiglu", False) else 4 * c.hidden_size


def swiglu_default_ffn(hidden: int) -> int:
    """Megatron's ``--ffn-hidden-size`` under ``--swiglu`` when none is given: ``int(4 h * 2 / 3 / 64) * 64``
    (0 below hidden 24, which the model config refuses)."""
    return int((4 * hidden * 2 / 3) / 64) * 64


def query_groups(c) -> int:
    """Key/value heads (``--num-query-groups``); one per query head without grouped-query attention."""
    return c.num_query_groups or c.num_attention_heads


def head_dim(c) -> int:
    """``--kv-channels``, default hidden / heads."""
    return c.kv_channels or c.hidden_size // c.num_attention_heads


def padded_vocab_size(c, tp: int = 1) -> int:
    """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` (Megatron), or
    ``--padded-vocab-size`` as given (Megatron uses it unrounded)."""
    given = getattr(c, "padded_vocab_size", None)
    if given:
        if given % tp or given < c.vocab_size:
            raise ConfigError(f"--padded-vocab-size {given} must be a multiple of --tensor-model-parallel-size {tp} "
                              f"and at least the tokenizer's vocabulary ({c.vocab_size}); give such a size or drop "
                              "it to round per --make-vocab-size-divisible-by")
        return given
    m = c.make_vocab_size_divisible_by * tp
    return -(-c.vocab_size // m) * m
