"""T5 (Megatron's pretrain_t5 model): a bidirectional encoder and a causal decoder with cross-attention.

``tokens [b, s_enc]`` and ``decoder_tokens [b, s_dec]`` share one embedding (vocab-parallel word +
learned absolute position, as Megatron's T5). Encoder: pre-LN layers attending bidirectionally over
the non-padding tokens (:class:`~omnitron.core.models.bert.model.BertLayer`) -> final norm = the
memory. Decoder: pre-LN layers with three residual lines -- causal self-attention, cross-attention
over the memory's non-padding positions, MLP -> final norm. LM head: the tied word embedding as a
column-parallel output layer with its own bias -> vocab-parallel cross-entropy over the decoder
labels (the loss mask, applied by the training step, picks the target tokens).

Tensor and sequence parallelism reuse the GPT layers (the memory is a sequence shard under SP, like
every activation). The class reuses :class:`GPTModel`'s layout-independent init and padding helper.
No pipeline stages and no context parallelism (the config validation says so).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from omnitron.core.models.bert.model import BertLayer, init_single_stage
from omnitron.core.models.gpt import config as C
from omnitron.core.models.gpt.model import GPTEmbedding, GPTModel
from omnitron.core.models.t5 import config as T
from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear
from omnitron.core.parallel.tensor.random import checkpoint
from omnitron.core.transformer.cross_attention import CrossAttention
from omnitron.core.transformer.layer import TransformerLayer
from omnitron.core.transformer.norm import Norm, norm_kwargs


class T5DecoderLayer(TransformerLayer):
    """The shared pre-LN layer plus a cross-attention between self-attention (causal) and MLP."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend) -> None:
        super().__init__(c, group=group, sequence_parallel=sequence_parallel, tracker=tracker, backend=backend)
        out_std = c.init_method_std / math.sqrt(2.0 * c.num_layers) if c.apply_scaled_init else c.init_method_std
        self.pre_cross_attn_layernorm = Norm(c.hidden_size, **norm_kwargs(c, backend, partial_grad=sequence_parallel))
        self.cross_attention = CrossAttention(c, group=group, sequence_parallel=sequence_parallel, tracker=tracker,
                                              backend=backend, out_std=out_std,
                                              skip_out_bias=backend.kernels.resolved("bias_dropout_add") != "reference")

    def forward(self, x: torch.Tensor, memory: torch.Tensor, memory_padding_mask: torch.Tensor,
                decoder_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        attn = self.self_attention(self.input_layernorm(x), None, causal_padding_mask=decoder_padding_mask)
        x = self._bias_dropout_add(attn, x)
        cross = self.cross_attention(self.pre_cross_attn_layernorm(x), memory, memory_padding_mask)
        x = self._bias_dropout_add(cross, x)
        return self._bias_dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)


def _stack(layers: dict, c, *, sequence_parallel: bool, backend) -> nn.Module:
    """``layers`` (a ModuleDict named by index) followed by ``final_layernorm``."""
    stack = nn.Module()
    stack.layers = nn.ModuleDict(layers)
    stack.final_layernorm = Norm(c.hidden_size, **norm_kwargs(c, backend, partial_grad=sequence_parallel))
    return stack


class T5Model(GPTModel):
    """The whole T5 on one pipeline stage; ``forward`` documents the tensors in and out."""

    def __init__(self, config: T.T5Config, groups, *, backend=None, seed: int = 1234) -> None:
        T.validate_t5(config, groups.config)
        enc, dec = T.encoder_layers(config), T.decoder_layers(config)
        init_single_stage(self, config, groups, backend=backend, seed=seed, num_layers=enc + dec)
        tp = groups.tp
        lkw = dict(group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker, backend=self.backend)
        skw = dict(sequence_parallel=self.sp, backend=self.backend)
        self.embedding = GPTEmbedding(config, group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker)
        self.encoder = _stack({str(i): BertLayer(config, **lkw) for i in range(enc)}, config, **skw)
        self.decoder = _stack({str(i): T5DecoderLayer(config, **lkw) for i in range(dec)}, config, **skw)
        self.output_layer = ColumnParallelLinear(config.hidden_size, C.padded_vocab_size(config, tp.size), group=tp,
                                                 bias=True, sequence_parallel=self.sp, own_weight=False,
                                                 dtype=config.params_dtype)
        self.output_layer.bias.valid_rows = config.vocab_size  # padding columns are dropped from full views
        self.reset_parameters(seed)

    def _run_stack(self, stack: nn.Module, x: torch.Tensor, *context) -> torch.Tensor:
        """Each layer of ``stack`` on ``x`` (with ``context`` passed through); ``--recompute-granularity
        full`` recomputes the configured chunks of layers in backward."""
        layers = list(stack.layers.values())
        recompute = self.training and torch.is_grad_enabled()
        chunks = {c[0]: c for c in C.recompute_layers(self.config, len(layers))} if recompute else {}
        i = 0
        while i < len(layers):
            chunk = [layers[j] for j in chunks.get(i, [i])]

            def run(h, *ctx, chunk=chunk):
                for layer in chunk:
                    h = layer(h, *ctx)
                return h

            x = checkpoint(run, self.rng_tracker, x, *context) if i in chunks else run(x, *context)
            i += len(chunk)
        return x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` -> word + position (from 0) embeddings ``[s(/tp), b, h]``."""
        return self.embedding(tokens, torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens))

    def forward(self, tokens: torch.Tensor, decoder_tokens: torch.Tensor, padding_mask: torch.Tensor,
                labels: torch.Tensor | None = None, decoder_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens [b, s_enc]`` (encoder input, int64), ``decoder_tokens [b, s_dec]`` (decoder input),
        ``padding_mask [b, s_enc]`` (nonzero at encoder padding), ``decoder_padding_mask [b, s_dec]`` (nonzero
        where the decoder input is [PAD], by id as Megatron's ``dec_mask``: no later decoder position attends
        to it; None: plain causal). Returns the per-token float32 loss
        ``[b, s_dec]`` when ``labels [b, s_dec]`` are given (every position; the loss mask picks the
        targets), else the tp-local logits ``[s_dec, b, V_pad/tp]`` with padding columns at -inf."""
        pad = padding_mask.to(torch.bool)
        memory = self.encoder.final_layernorm(self._run_stack(self.encoder, self._embed(tokens), pad))
        dec = () if decoder_padding_mask is None else (decoder_padding_mask.to(torch.bool),)
        y = self._run_stack(self.decoder, self._embed(decoder_tokens), memory, pad, *dec)
        logits = self.output_layer(self.decoder.final_layernorm(y), self.embedding.word_embeddings.weight)
        if labels is None:
            return self._mask_padding(logits)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp, vocab_size=self.config.vocab_size,
                                            kernels=self.backend.kernels, inplace_backward=True)
        return loss.t()  # [b, s_dec] float32

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        """None: the output layer uses the word embedding itself (one stage)."""
        return []
