"""BERT configuration: the GPT fields (same meaning, same flags) plus BERT's own, presets, validation.

:class:`BertConfig` subclasses :class:`GPTConfig`, so every derived-value function of the GPT
config (``ffn_size``, ``head_dim``, ``padded_vocab_size``, ``validate_model``, ...) applies as is.
BERT adds ``--bert-binary-head`` / ``--no-bert-binary-head`` (Megatron's ``--bert-no-binary-head``) and
``--num-tokentypes``. Megatron BERT is pre-LN (``--apply-residual-connection-post-layernorm`` off), as the
shared Transformer layer is; learned absolute positions; the MLM output tied to the word embedding.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.gpt.config import GPTConfig, max_positions, padded_vocab_size, validate_model
from omnitron.core.models.gpt.config import num_parameters as gpt_num_parameters


@dataclass(kw_only=True)
class BertConfig(GPTConfig):
    """A bidirectional Transformer encoder with masked-LM and binary (NSP/SOP) heads."""

    bert_binary_head: bool = True
    """--bert-binary-head / --no-bert-binary-head: the sentence-pair (NSP/SOP) classifier on the pooled [CLS]."""
    num_tokentypes: int | None = None
    """--num-tokentypes: rows of the token-type (segment A/B) embedding; 0 = no token-type embedding. Default as
    Megatron's pretrain_bert: 2 with the binary head, 0 without (see :func:`tokentypes`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokentypes is not None and (not isinstance(self.num_tokentypes, int) or self.num_tokentypes < 0):
            raise ConfigError(f"--num-tokentypes must be a non-negative integer, got {self.num_tokentypes!r}")


def tokentypes(c: BertConfig) -> int:
    """Rows of the token-type embedding: ``--num-tokentypes`` when given, else Megatron's pretrain_bert rule
    (two segments with the binary head; none without it, where Megatron also feeds no token types)."""
    if c.num_tokentypes is not None:
        return c.num_tokentypes
    return 2 if c.bert_binary_head else 0


def validate_bert(c: BertConfig, parallel: ParallelConfig, *, check_layers: bool = True) -> None:
    """The GPT checks, plus what this BERT implementation does not run; errors name the flag and fix.
    Pipeline stages run (``check_layers=False``: uneven stages, checked by the layer placement)."""
    validate_model(c, parallel, check_layers=check_layers and not parallel.uneven_pipeline)
    validate_single_stage(c, parallel, family="BERT", needs=None, attention="bidirectional, padded attention",
                          output="masked-LM output")
    if c.bert_binary_head and tokentypes(c) < 2:
        raise ConfigError(f"--bert-binary-head needs two segments, so --num-tokentypes >= 2 (got "
                          f"{tokentypes(c)}); set --num-tokentypes 2 or pass --bert-no-binary-head")


def validate_single_stage(c, parallel: ParallelConfig, *, family: str, needs: str | None, attention: str,
                          output: str) -> None:
    """What the padded-attention families (BERT, T5) do not run, each error naming the flag and the fix:
    pipeline parallelism (``needs``: why; None: the family runs pipeline stages) and context parallelism
    (``attention``: what has no ring), positions other than learned absolute, an untied ``output``,
    Mixture-of-Experts layers."""
    if needs is not None and parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}: {family} runs "
                          f"without pipeline parallelism here ({needs}); use --pipeline-model-parallel-size 1 and "
                          "tensor/data parallelism")
    if parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {parallel.context_parallel_size}: {family}'s {attention} has "
                          "no context-parallel ring; use --context-parallel-size 1")
    if c.position_embedding_type != "learned_absolute":
        raise ConfigError(f"--position-embedding-type {c.position_embedding_type}: {family} uses learned absolute "
                          "positions; use --position-embedding-type learned_absolute")
    if c.untie_embeddings_and_output_weights:
        raise ConfigError(f"--untie-embeddings-and-output-weights: {family}'s {output} is tied to the word "
                          "embedding; drop the flag")
    if c.num_experts is not None:
        raise ConfigError(f"--num-experts: Mixture-of-Experts layers are not wired into {family}; drop --num-experts")


def num_parameters(c: BertConfig, *, tp: int = 1) -> int:
    """Parameters of the whole model: the GPT count (embeddings, layers, final norm, tied output)
    plus token types, the MLM head (dense, norm, output bias) and the pooler + binary head."""
    h = c.hidden_size
    norm = h * (2 if c.normalization == "LayerNorm" else 1)
    total = gpt_num_parameters(c, tp=tp) + tokentypes(c) * h
    total += h * h + h + norm + padded_vocab_size(c, tp)  # lm_head.dense, lm_head.layer_norm, output bias
    if c.bert_binary_head:
        total += h * h + h + 2 * h + 2  # pooler.dense, binary_head
    return total


def bert_tiny(**overrides) -> BertConfig:
    """Debug BERT (4 layers, hidden 128, 4 heads, seq 128): fast on CPU with a small WordPiece vocabulary."""
    return replace(BertConfig(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                              seq_length=128, max_position_embeddings=128, vocab_size=8192), **overrides)


def bert_base(**overrides) -> BertConfig:
    """BERT-base shape (12 layers, hidden 768, 12 heads, seq 512)."""
    return replace(BertConfig(num_layers=12, hidden_size=768, num_attention_heads=12, seq_length=512,
                              max_position_embeddings=512, vocab_size=30522), **overrides)


__all__ = ["BertConfig", "tokentypes", "validate_bert", "num_parameters", "bert_tiny", "bert_base", "max_positions"]
