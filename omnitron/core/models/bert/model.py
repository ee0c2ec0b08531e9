"""BERT (Megatron's pretrain_bert model): a bidirectional encoder with masked-LM and binary heads.

``tokens [b, s]`` -> word (vocab-parallel) + learned position + token-type embeddings -> pre-LN
Transformer layers attending bidirectionally over the non-padding keys -> final norm. Heads:

* masked LM: ``dense(h, h)`` + GeLU + norm, then the tied word embedding as a column-parallel
  output layer with its own bias -> vocab-parallel cross-entropy per token;
* binary (NSP/SOP, ``bert_binary_head``): pooler ``tanh(dense(h, h))`` on the ``[CLS]`` (position
  0) hidden state -> ``Linear(h, 2)`` logits.

Tensor and sequence parallelism reuse the GPT layers. The class reuses :class:`GPTModel`'s
layout-independent init, recompute-aware layer runner and vocabulary-padding helpers, so the
layer stack keeps GPT's name ``decoder`` (the same checkpoint and state tools read both).

Pipeline stages as GPT's: ``pre_process`` adds the embeddings, ``post_process`` the final norm and
both heads; layers keep their global names. A last stage that is not also the first holds a copy
of the word embedding as its output weight (same initial values, gradients summed with the first
stage's over ``groups.embedding``). Every stage reads the padding mask.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.models.bert import config as B
from omnitron.core.models.gpt import config as C
from omnitron.core.models.gpt.model import WORD_EMBEDDING, GPTEmbedding, GPTModel
from omnitron.core.parallel.groups import resolve_backend
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear
from omnitron.core.parallel.tensor.random import MODEL_PARALLEL, RNGTracker, model_parallel_seed
from omnitron.core.parallel.tensor.sharding import set_attributes
from omnitron.core.transformer.layer import TransformerLayer
from omnitron.core.transformer.norm import Norm, norm_kwargs


def _linear(n_in: int, n_out: int, c, *, partial_grad: bool = False) -> nn.Linear:
    """A replicated ``nn.Linear`` with the init attributes the layout-independent init reads;
    ``partial_grad``: applied to sequence shards, so its gradient is summed over tp before the step."""
    lin = nn.Linear(n_in, n_out, dtype=c.params_dtype)
    set_attributes(lin.weight, parallel=False, init=("normal", c.init_method_std))
    set_attributes(lin.bias, parallel=False, init=("zeros",))
    lin.weight.sequence_parallel = lin.bias.sequence_parallel = partial_grad
    return lin


class BertEmbedding(GPTEmbedding):
    """GPT's word + position embeddings plus the token-type embedding: ``[b, s] -> [s, b, h]``
    (``[s/tp, b, h]`` under sequence parallelism)."""

    def __init__(self, c: B.BertConfig, *, group, sequence_parallel: bool, tracker) -> None:
        super().__init__(c, group=group, sequence_parallel=sequence_parallel, tracker=tracker)
        self.tokentype_embeddings = None
        if B.tokentypes(c):
            self.tokentype_embeddings = nn.Embedding(B.tokentypes(c), c.hidden_size, dtype=c.params_dtype)
            set_attributes(self.tokentype_embeddings.weight, parallel=False, init=("normal", c.init_method_std))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                tokentype_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(tokens.t(), reduce_scatter=self.sp)  # [s(/tp), b, h]
        extra = self.position_embeddings(position_ids.t())  # [s, b, h], replicated over tp
        if self.tokentype_embeddings is not None:
            if tokentype_ids is None:
                raise ValueError("this BERT has a token-type embedding (--num-tokentypes > 0): pass tokentype_ids")
            extra = extra + self.tokentype_embeddings(tokentype_ids.t())
        x = x + (M.scatter_to_sp(extra, self.group) if self.sp else extra)
        p = self.c.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return x
        with self.tracker.fork() if self.sp else contextlib.nullcontext():
            return F.dropout(x, p, training=True)


class BertLayer(TransformerLayer):
    """The shared pre-LN layer, attending bidirectionally over the keys that are not padding."""

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor) -> torch.Tensor:
        x = self._bias_dropout_add(self.self_attention(self.input_layernorm(x), None, key_padding_mask), x)
        return self._bias_dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)


class BertLMHead(nn.Module):
    """``dense -> gelu -> norm`` on ``[s(/tp), b, h]`` (the tied output projection follows)."""

    def __init__(self, c: B.BertConfig, *, sequence_parallel: bool, backend) -> None:
        super().__init__()
        self.dense = _linear(c.hidden_size, c.hidden_size, c, partial_grad=sequence_parallel)
        self.layer_norm = Norm(c.hidden_size, **norm_kwargs(c, backend, partial_grad=sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(F.gelu(self.dense(x)))


def init_single_stage(model: GPTModel, config, groups, *, backend, seed: int, num_layers: int,
                      pre_process: bool = True, post_process: bool = True, layer_offset: int = 0) -> None:
    """What :class:`GPTModel`'s reused methods read, set on a model (BERT, T5) whose own ``__init__``
    replaces GPTModel's: config, groups, backend, the stage flags and layer range (default: the whole
    model on one stage), sequence parallelism and the RNG tracker with the tp- and pp-rank stream."""
    nn.Module.__init__(model)  # NOTE: GPTModel's own __init__ builds GPT modules; only its methods are reused
    model.config, model.groups = config, groups
    model.backend = resolve_backend(backend, groups)
    model.pre_process, model.post_process = pre_process, post_process
    model.label_smoothing, model.layer_offset, model.num_local_layers = 0.0, layer_offset, num_layers
    model.sp = bool(groups.config.sequence_parallel and groups.tp.size > 1)
    model.rng_tracker = RNGTracker(model.backend, groups.tp.size, M.local_rank(groups.tp))
    model.rng_tracker.add(MODEL_PARALLEL, model_parallel_seed(seed, M.local_rank(groups.tp), M.local_rank(groups.pp)))


class BertModel(GPTModel):
    """A BERT pipeline stage (by default the whole model); ``forward`` documents the tensors in and out."""

    def __init__(self, config: B.BertConfig, groups, *, pre_process: bool = True, post_process: bool = True,
                 layer_offset: int = 0, num_layers: int | None = None, backend=None, seed: int = 1234) -> None:
        B.validate_bert(config, groups.config, check_layers=num_layers is None)
        n = config.num_layers if num_layers is None else num_layers
        if layer_offset < 0 or layer_offset + n > config.num_layers:
            raise ValueError(f"layers [{layer_offset}, {layer_offset + n}) outside the model's {config.num_layers}")
        init_single_stage(self, config, groups, backend=backend, seed=seed, num_layers=n, pre_process=pre_process,
                          post_process=post_process, layer_offset=layer_offset)
        tp = groups.tp
        lkw = dict(group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker, backend=self.backend)
        if pre_process:
            self.embedding = BertEmbedding(config, group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict({str(i): BertLayer(config, **lkw)
                                             for i in range(layer_offset, layer_offset + n)})
        if post_process:
            self._build_heads(config)
        self.sop_loss_total = None  # the training micro-batches' sentence-order losses, for the log (sop_loss)
        self.reset_parameters(seed)

    def _build_heads(self, config: B.BertConfig) -> None:
        """Final norm, MLM head and tied output layer (its own copy of the word embedding when this
        stage has no embedding), pooler + binary head."""
        tp = self.groups.tp
        self.decoder.final_layernorm = Norm(config.hidden_size,
                                            **norm_kwargs(config, self.backend, partial_grad=self.sp))
        self.lm_head = BertLMHead(config, sequence_parallel=self.sp, backend=self.backend)
        self.output_layer = ColumnParallelLinear(config.hidden_size, C.padded_vocab_size(config, tp.size), group=tp,
                                                 bias=True, sequence_parallel=self.sp, own_weight=not self.pre_process,
                                                 init_std=config.init_method_std, valid_rows=config.vocab_size,
                                                 dtype=config.params_dtype)
        if self.output_layer.weight is not None:  # the last stage's copy of the word embedding
            self.output_layer.weight.is_embedding_or_output_parameter = True
        self.output_layer.bias.valid_rows = config.vocab_size  # padding columns are dropped from full views
        if not self.pre_process:  # the last stage's copy of the word embedding: same init, grads all-reduced
            self.output_layer.weight.init_name = WORD_EMBEDDING
            self.output_layer.weight.shared_embedding = True
        self.pooler = self.binary_head = None
        if config.bert_binary_head:
            self.pooler = nn.Module()
            self.pooler.dense = _linear(config.hidden_size, config.hidden_size, config)
            self.binary_head = _linear(config.hidden_size, 2, config)

    def forward(self, tokens: torch.Tensor | None = None, padding_mask: torch.Tensor | None = None,
                tokentype_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, hidden: torch.Tensor | None = None):
        """``padding_mask [b, s]`` (nonzero at padding) on every stage. First stage: ``tokens [b, s]``
        int64 and ``tokentype_ids [b, s]``; later stages: ``hidden [s(/tp), b, h]`` from the previous one.

        A stage without the heads returns its hidden states for the next stage. The last returns
        ``(lm, binary_logits)``: ``lm`` is the per-token MLM loss ``[b, s]`` when ``labels [b, s]``
        are given (every position; the loss mask picks the masked ones), else the tp-local logits
        ``[s, b, V_pad/tp]`` with padding columns at -inf; ``binary_logits [b, 2]`` (None without the
        binary head); both float32 at least (a float64 model's stay float64)."""
        if padding_mask is None:
            raise ValueError("every BERT pipeline stage needs padding_mask [b, s] (nonzero at padding)")
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first BERT pipeline stage needs tokens [b, s]")
            if position_ids is None:
                position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
            x = self.embedding(tokens, position_ids, tokentype_ids)
        elif hidden is None:
            raise ValueError("a non-first BERT pipeline stage needs hidden [s, b, h] from the previous stage")
        else:
            x = hidden
        x = self._run_layers(x, padding_mask.to(torch.bool))  # NOTE: GPT's runner passes the mask to each layer
        return self._heads(x, labels) if self.post_process else x

    def _heads(self, x: torch.Tensor, labels: torch.Tensor | None):
        """Final norm, then ``(MLM loss or logits, binary logits)`` as :meth:`forward` returns them."""
        x = self.decoder.final_layernorm(x)  # [s(/tp), b, h]
        binary = None
        if self.binary_head is not None:
            cls = (M.gather_from_sp(x, self.groups.tp, grad_is_partial=False) if self.sp else x)[0]  # [b, h]
            binary = _widened(self.binary_head(torch.tanh(self.pooler.dense(cls))))
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self.output_layer(self.lm_head(x), weight)  # [s, b, V_pad/tp]
        if labels is None:
            return self._mask_padding(logits), binary
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp, vocab_size=self.config.vocab_size,
                                            kernels=self.backend.kernels, inplace_backward=True)
        return loss.t(), binary  # [b, s]


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 at least (Megatron's ``.float()`` widens bf16 / fp16); a float64 model's stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def bert_loss(output, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's BERT loss for one micro-batch, as ``(loss, 1)``: the mean MLM loss over the masked
    positions (``batch["loss_mask"]``) plus, with the binary head, the mean cross-entropy of the
    sentence-pair logits against ``batch["is_random"]``."""
    lm, binary = output
    lm = _widened(lm)
    mask = batch["loss_mask"].to(lm.dtype).reshape(lm.shape)
    loss = (lm * mask).sum() / mask.sum().clamp(min=1.0)
    if binary is not None:
        loss = loss + F.cross_entropy(_widened(binary), batch["is_random"].reshape(-1).long())
    return loss, torch.ones((), device=loss.device)


def record_sop_loss(model: BertModel, binary: torch.Tensor, is_random: torch.Tensor) -> None:
    """Add one micro-batch's sentence-order loss (detached) to ``model``'s total for the log."""
    sop = F.cross_entropy(_widened(binary.detach()), is_random.reshape(-1).long())
    model.sop_loss_total = sop if model.sop_loss_total is None else model.sop_loss_total + sop


def sop_loss(modules, groups, collectives, num_microbatches: int) -> float:
    """Collective over pp and dp: the sentence-order loss (part of the BERT loss) of the micro-batches run since
    the last call, averaged over them and data-parallel replicas as Megatron's ``sop loss``; resets the totals."""
    from omnitron.core.transformer.moe.metrics import logged_loss

    holders = [m for mod in modules for m in mod.modules() if isinstance(m, BertModel)]
    return logged_loss(modules, holders, "sop_loss_total", groups, collectives, num_microbatches)
