"""T5 configuration: the GPT fields (same meaning, same flags) plus the encoder-decoder ones.

:class:`T5Config` subclasses :class:`GPTConfig`, so every derived-value function of the GPT config
(``ffn_size``, ``head_dim``, ``padded_vocab_size``, ...) applies as is. T5 adds Megatron's
``--encoder-num-layers`` / ``--decoder-num-layers`` (default ``--num-layers``),
``--encoder-seq-length`` (Megatron's T5 spelling of ``--seq-length``: the encoder input length),
``--decoder-seq-length`` and ``--vocab-extra-ids`` (sentinel tokens ``<extra_id_i>`` added to the
tokenizer). Megatron's T5 is pre-LN with learned absolute positions shared by encoder and decoder
(one embedding), and an LM head tied to the word embedding with its own bias.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.bert.config import validate_single_stage
from omnitron.core.models.gpt.config import GPTConfig, max_positions, padded_vocab_size, query_groups, validate_model
from omnitron.core.models.gpt.config import num_parameters as gpt_num_parameters


@dataclass(kw_only=True)
class T5Config(GPTConfig):
    """A Transformer encoder-decoder trained by span corruption (Megatron's ``pretrain_t5``)."""

    encoder_num_layers: int | None = None
    """--encoder-num-layers: layers of the bidirectional encoder; default --num-layers."""
    decoder_num_layers: int | None = None
    """--decoder-num-layers: layers of the causal decoder (self- then cross-attention); default --num-layers."""
    encoder_seq_length: int | None = None
    """--encoder-seq-length: Megatron's T5 name for --seq-length (encoder input tokens); when given it sets
    --seq-length."""
    decoder_seq_length: int | None = None
    """--decoder-seq-length: decoder input/target tokens; default --seq-length // 4 (Megatron's T5 runs 512/128)."""
    vocab_extra_ids: int = 100
    """--vocab-extra-ids: sentinel tokens <extra_id_0>... added to the tokenizer; one marks each corrupted span."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, v in (("--encoder-num-layers", self.encoder_num_layers),
                        ("--decoder-num-layers", self.decoder_num_layers),
                        ("--decoder-seq-length", self.decoder_seq_length)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
        if not isinstance(self.vocab_extra_ids, int) or self.vocab_extra_ids < 0:
            raise ConfigError(f"--vocab-extra-ids must be a non-negative integer, got {self.vocab_extra_ids!r}")
        if self.encoder_seq_length is not None and self.encoder_seq_length != self.seq_length:
            raise ConfigError(f"--encoder-seq-length {self.encoder_seq_length} and --seq-length {self.seq_length} "
                              "name one setting (the encoder input length); give one of them")


# ---- derived values ------------------------------------------------------------------------
def encoder_layers(c: T5Config) -> int:
    return c.encoder_num_layers or c.num_layers


def decoder_layers(c: T5Config) -> int:
    return c.decoder_num_layers or c.num_layers


def decoder_length(c: T5Config) -> int:
    """Decoder tokens per sample (``--decoder-seq-length``, default a quarter of the encoder's)."""
    return c.decoder_seq_length or max(1, c.seq_length // 4)


def validate_t5(c: T5Config, parallel: ParallelConfig) -> None:
    """The GPT checks, plus what this T5 implementation does not run; errors name the flag and fix."""
    validate_model(c, parallel)
    validate_single_stage(c, parallel, family="T5", needs="every decoder layer reads the encoder output",
                          attention="padded encoder and cross-attention", output="LM head")
    tp, dec = parallel.tensor_model_parallel_size, decoder_length(c)
    if c.qk_layernorm:
        raise ConfigError("--qk-layernorm: T5's cross-attention has no query/key norms; drop --qk-layernorm")
    if query_groups(c) % tp:
        raise ConfigError(f"--num-query-groups {query_groups(c)} is below --tensor-model-parallel-size {tp}: T5's "
                          "cross-attention splits key/value heads over tp; use a multiple of tp query groups")
    if dec > max_positions(c):
        raise ConfigError(f"--decoder-seq-length {dec} exceeds --max-position-embeddings {max_positions(c)} (the "
                          "position table is shared with the encoder); raise --max-position-embeddings")
    if parallel.sequence_parallel and dec % tp:
        raise ConfigError(f"--decoder-seq-length {dec} is not divisible by --tensor-model-parallel-size {tp}, "
                          "which --sequence-parallel requires; change --decoder-seq-length or drop --sequence-parallel")


def num_parameters(c: T5Config, *, tp: int = 1) -> int:
    """Parameters of the whole model: embeddings, encoder and decoder layers (a decoder layer adds a
    cross-attention, the size of a self-attention, and its norm), two final norms, the output bias."""
    one, two = (gpt_num_parameters(replace(c, num_layers=n), tp=tp) for n in (1, 2))
    layer = two - one  # one GPT layer
    h, d = c.hidden_size, c.kv_channels or c.hidden_size // c.num_attention_heads
    norm = h * (2 if c.normalization == "LayerNorm" else 1)
    b, hq, g = (1 if c.add_bias_linear else 0), c.num_attention_heads, query_groups(c)
    cross = (hq * d * h + b * hq * d) + (2 * g * d * h + b * 2 * g * d) + (hq * d * h + b * h)  # q, kv, proj
    total = (one - layer) + norm + padded_vocab_size(c, tp)  # embeddings, final norms, output bias
    return total + layer * (encoder_layers(c) + decoder_layers(c)) + decoder_layers(c) * (cross + norm)


def t5_tiny(**overrides) -> T5Config:
    """Debug T5 (2 + 2 layers, hidden 128, 4 heads, encoder 128 / decoder 32 tokens): fast on CPU with the
    bundled-corpus WordPiece vocabulary plus 100 sentinels."""
    return replace(T5Config(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=128,
                            decoder_seq_length=32, max_position_embeddings=128, vocab_size=8192 + 100), **overrides)


def t5_base(**overrides) -> T5Config:
    """T5-base shape as Megatron trains it (12 + 12 layers, hidden 768, 12 heads, encoder 512 / decoder 128)."""
    return replace(T5Config(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
                            kv_channels=64, seq_length=512, decoder_seq_length=128, max_position_embeddings=512,
                            vocab_size=30522 + 100), **overrides)


__all__ = ["T5Config", "validate_t5", "num_parameters", "encoder_layers", "decoder_layers", "decoder_length",
           "t5_tiny", "t5_base"]
