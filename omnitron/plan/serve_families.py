"""Serving memory of the families ``omnitron serve`` generates with beside GPT: T5 and LLaVA (one process each,
:mod:`omnitron.core.inference.families`), on the terms of :mod:`omnitron.plan.inference`.

- T5 (:func:`t5_memory`): ``--inference-max-seq-length S`` counts the decoder's tokens (its start token and the
  generated ones: the self-attention cache's slots); the encoder input is ``prompt`` tokens (default the model's
  ``--seq-length``, the encoder length). Weights: encoder, decoder and the shared embedding. KV cache: the decoder
  layers' self-attention keys and values of ``B x S`` slots, their cross-attention keys and values of the encoder
  output (:class:`~omnitron.core.inference.kv_cache.CrossKVCache`: ``B x prompt`` positions each, computed once and
  kept) and the encoder output itself (the decoder's memory, kept while decoding). Activations: the encoder's
  largest phase over ``B x prompt`` tokens (its padding mask: the masked softmax), or the output head at the
  ``B`` decoding positions (the GPT head's tensors and one more ``[B, V]``: the head's bias added to the logits).
- LLaVA (:func:`check_llava`, :func:`vision_bytes`): the GPT terms over the language model with its ``S`` slots
  counting the image's placeholder positions (every prompt starts with them), the vision tower and projector in the
  weights, and the prefill's working set the larger of the language model's and the ViT's over its ``B`` images.
"""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError


def check_serving_family(settings) -> None:
    """GPT, T5 and LLaVA generate; BERT does not (ConfigError); T5 and LLaVA only in one process."""
    family, pc = getattr(settings, "model_type", "gpt"), settings.parallel
    if family == "bert":
        raise ConfigError("--model-type bert has no text to generate (omnitron serve refuses it): price GPT, T5 or "
                          "multimodal models")
    if family in ("t5", "multimodal") and pc.tensor_model_parallel_size * pc.pipeline_model_parallel_size > 1:
        raise ConfigError(f"a {family} model is served in one process: drop --tensor-model-parallel-size / "
                          "--pipeline-model-parallel-size")


def t5_memory(cfg, requests: int, seq_length: int, prompt: int | None, elem: int) -> tuple[int, int, int, int]:
    """(decoder layers, weights, KV cache, activations bytes) serving T5 (module docstring; the log-probs cover the
    generated tokens only, so the head runs at the ``B`` decoding positions either way)."""
    from omnitron.core.models.t5.config import decoder_layers
    from omnitron.core.transformer.shapes import padded_vocab_size
    from omnitron.plan.serve_terms import _attention, _head, _mlp, kv_bytes_per_token
    from omnitron.plan.state import skeleton

    source = prompt or cfg.seq_length
    if source > cfg.seq_length:
        raise ConfigError(f"a T5 source of {source} tokens is more than the encoder's --seq-length {cfg.seq_length}")
    weights = sum(p.numel() for m in skeleton(cfg, _one(), 0) for p in m.parameters()) * elem
    layers, per_layer = decoder_layers(cfg), kv_bytes_per_token(cfg, 1, 1, elem)  # one position in one layer
    kv = requests * (layers * per_layer * (seq_length + source) + source * cfg.hidden_size * elem)
    tokens = requests * source
    encoder = max(_mlp(cfg, 1, tokens, elem, False), _attention(cfg, 1, requests, source, elem, True))
    vocab = padded_vocab_size(cfg, 1)  # the LM head's bias sum: one more [B, V] beside the GPT head's logits
    return layers, weights, kv, max(encoder, _head(cfg, 1, requests, requests, elem) + requests * vocab * elem)


def check_llava(cfg, seq_length: int, prompt: int | None) -> None:
    """ConfigError when ``S`` (or the prompt) leaves no room after the image's placeholder positions."""
    from omnitron.core.models.multimodal.config import num_image_tokens

    n = num_image_tokens(cfg)
    if seq_length <= n or (prompt is not None and prompt < n):
        raise ConfigError(f"--inference-max-seq-length {seq_length} must exceed the {n} image positions every LLaVA "
                          "prompt starts with (--img-h / --img-w / --patch-dim): give more")


def vision_bytes(cfg, requests: int, elem: int) -> int:
    """The ViT's largest phase over ``B`` images (bidirectional, no padding), and the projector's ``[B n, f]``."""
    from omnitron.core.models.multimodal.config import num_image_tokens, vision_config
    from omnitron.plan.serve_terms import _attention, _mlp

    v, n = vision_config(cfg), num_image_tokens(cfg)
    tokens = requests * v.seq_length
    projector = requests * n * (cfg.projector_ffn_hidden_size or cfg.hidden_size) * 2 * elem
    return max(_mlp(v, 1, tokens, elem, False), _attention(v, 1, requests, v.seq_length, elem, False), projector)


def _one():
    from omnitron.core.config import ParallelConfig

    return ParallelConfig()
