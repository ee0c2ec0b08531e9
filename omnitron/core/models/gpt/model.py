"""GPTModel: one pipeline stage (or the whole model) of a GPT-2 / Llama style decoder.

A stage owns layers ``[layer_offset, layer_offset + num_layers)`` of the global stack, named by
their GLOBAL index (``decoder.layers.7....``), so parameter names and initial values do not depend
on the parallel layout. ``pre_process`` adds the embedding, ``post_process`` the final norm, the
output layer and the loss.

Under context parallelism (``groups.cp.size > 1``) a stage sees only this cp rank's
load-balanced slice of each sequence (tokens ``[b, s/cp]``, activations ``[s/cp, b, h]``), and
its attention modules run the ring over ``groups.cp``; positions default to the slice's own.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from omnitron.core.models.gpt import config as C
from omnitron.core.parallel.context import apply_context_parallel, local_positions
from omnitron.core.parallel.groups import resolve_backend
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, VocabParallelEmbedding, embedding_lookup
from omnitron.core.parallel.tensor.random import MODEL_PARALLEL, RNGTracker, checkpoint, model_parallel_seed
from omnitron.core.parallel.tensor.sharding import full_shape, init_full, set_attributes, shard_param
from omnitron.core.transformer.attention import extract_rows
from omnitron.core.transformer.layer import TransformerLayer
from omnitron.core.transformer.norm import Norm, norm_kwargs
from omnitron.core.transformer.offload import ActivationOffloader
from omnitron.core.transformer.offload_modules import ModuleOffloader

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class GPTEmbedding(nn.Module):
    """Word (vocab-parallel) plus optional learned position embeddings, then dropout: ``[b, s] -> [s, b, h]``
    (``[s/tp, b, h]`` under sequence parallelism)."""

    def __init__(self, c: C.GPTConfig, *, group, sequence_parallel: bool, tracker) -> None:
        super().__init__()
        self.c, self.group, self.sp, self.tracker = c, group, sequence_parallel, tracker
        self.word_embeddings = VocabParallelEmbedding(C.padded_vocab_size(c, group.size), c.hidden_size, group=group,
                                                      vocab_size=c.vocab_size, init_std=c.init_method_std,
                                                      dtype=c.params_dtype)
        self.word_embeddings.weight.is_embedding_or_output_parameter = True  # --decoupled-lr applies to it
        self.position_embeddings = None
        if c.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(C.max_positions(c), c.hidden_size, dtype=c.params_dtype)
            set_attributes(self.position_embeddings.weight, parallel=False, init=("normal", c.init_method_std))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens.t(), reduce_scatter=self.sp)  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            pos = self.position_embeddings(position_ids.t())  # [s, b, h], replicated over tp
            x = x + (M.scatter_to_sp(pos, self.group) if self.sp else pos)
        return embedding_dropout(x, self.c.hidden_dropout if self.training else 0.0, self.tracker, self.sp)


def embedding_dropout(x: torch.Tensor, p: float, tracker, sp: bool) -> torch.Tensor:
    """Hidden dropout on an embedding output; sequence shards (``sp``) draw from the tp-rank-specific stream."""
    if p == 0.0:
        return x
    with tracker.fork() if sp else contextlib.nullcontext():
        return torch.nn.functional.dropout(x, p, training=True)


class GPTModel(nn.Module):
    """A GPT stage. See the module docstring; ``forward`` documents the tensors in and out."""

    offloader: ActivationOffloader | None = None
    """--cpu-offloading's offloader (None: off; also for subclasses that build their own layers)."""

    def __init__(self, config: C.GPTConfig, groups, *, pre_process: bool = True, post_process: bool = True,
                 layer_offset: int = 0, num_layers: int | None = None, backend=None, seed: int = 1234,
                 label_smoothing: float = 0.0) -> None:
        super().__init__()
        C.validate_model(config, groups.config, check_layers=num_layers is None)
        self.config, self.groups = config, groups
        self.backend = resolve_backend(backend, groups)
        self.pre_process, self.post_process = pre_process, post_process
        self.label_smoothing = label_smoothing
        tp = groups.tp
        self.sp = bool(groups.config.sequence_parallel and tp.size > 1)
        n = config.num_layers if num_layers is None else num_layers
        if layer_offset < 0 or layer_offset + n > config.num_layers:
            raise ValueError(f"layers [{layer_offset}, {layer_offset + n}) outside the model's {config.num_layers}")
        self.layer_offset, self.num_local_layers = layer_offset, n
        self.rng_tracker = RNGTracker(self.backend, tp.size, M.local_rank(tp))
        self.rng_tracker.add(MODEL_PARALLEL, model_parallel_seed(seed, M.local_rank(tp), M.local_rank(groups.pp)))
        lkw = dict(group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker, backend=self.backend, groups=groups)
        if pre_process:
            self.embedding = GPTEmbedding(config, group=tp, sequence_parallel=self.sp, tracker=self.rng_tracker)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict({
            str(i): TransformerLayer(config, **lkw, layer_number=i) for i in range(layer_offset, layer_offset + n)})
        if post_process:
            self.decoder.final_layernorm = Norm(config.hidden_size,
                                                **norm_kwargs(config, self.backend, partial_grad=self.sp))
            tied = not config.untie_embeddings_and_output_weights
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, C.padded_vocab_size(config, tp.size), group=tp, bias=False,
                sequence_parallel=self.sp, init_std=config.init_method_std, own_weight=not (tied and pre_process),
                valid_rows=config.vocab_size, dtype=config.params_dtype)
            if self.output_layer.weight is not None:
                self.output_layer.weight.is_embedding_or_output_parameter = True
            if tied and not pre_process:
                # the last stage's copy of the word embedding: same initial values, grads all-reduced
                self.output_layer.weight.init_name = WORD_EMBEDDING
                self.output_layer.weight.shared_embedding = True
        if post_process and config.mtp_num_layers:
            self._build_mtp(config, lkw)
        if C.uses_rope(config):
            self.register_buffer("inv_freq", C.rope_inv_freq(config), persistent=False)
        self.reset_parameters(seed)
        if C.offload_layers(config):
            self.offloader = ActivationOffloader(self.backend, activations=config.cpu_offloading_activations,
                                                 weights=config.cpu_offloading_weights,
                                                 retain=config.cpu_offloading_retain_pinned_cpu_buffers)
        elif config.fine_grained_activation_offloading:
            self.offloader = ModuleOffloader(self.backend, min_numel=config.min_offloaded_tensor_size)
            self.offloader.attach(list(self.decoder.layers.values()), config.offload_modules)
        self._apply_context_parallel(groups)

    def _apply_context_parallel(self, groups) -> None:
        """Point the attention at the cp group with --cp-comm-type: one type for every layer, or per layer (layer
        ``i`` the i-th type; multi-token-prediction depth ``k`` the k-th, as Megatron numbers its layers)."""
        pc = groups.config
        comm = getattr(pc, "cp_comm_type", "p2p")
        types = pc.cp_comm_types() if hasattr(pc, "cp_comm_types") else (comm,)
        sub = (groups.cp_a2a, groups.cp_p2p) if groups.cp.size > 1 and "a2a+p2p" in types else None
        if isinstance(comm, str):
            apply_context_parallel(self, groups.cp, comm, sub)
            return
        for name, layer in self.decoder.layers.items():
            apply_context_parallel(layer, groups.cp, pc.layer_cp_comm_type(int(name)), sub)
        for k, layer in enumerate(self.mtp.layers if getattr(self, "mtp", None) is not None else ()):
            apply_context_parallel(layer, groups.cp, pc.layer_cp_comm_type(k), sub)

    def _build_mtp(self, config: C.GPTConfig, layer_kw: dict) -> None:
        """Multi-token prediction on the last stage (transformer/mtp.py). Its embedding: the first stage's own
        here, else the tied output copy, else (untied) a copy of the word embedding tied across stages."""
        from omnitron.core.transformer.mtp import MultiTokenPrediction

        self.mtp = MultiTokenPrediction(config, **layer_kw)
        if self.pre_process or not config.untie_embeddings_and_output_weights:
            return
        tp = self.groups.tp
        self.mtp_embedding = VocabParallelEmbedding(C.padded_vocab_size(config, tp.size), config.hidden_size,
                                                    group=tp, vocab_size=config.vocab_size,
                                                    init_std=config.init_method_std, dtype=config.params_dtype)
        w = self.mtp_embedding.weight
        w.init_name, w.shared_embedding, w.is_embedding_or_output_parameter = WORD_EMBEDDING, True, True

    def _mtp_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The word embedding of ``tokens [b, s]`` on the last stage: ``[s(/tp), b, h]``, with hidden dropout."""
        if self.pre_process:
            weight = self.embedding.word_embeddings.weight
        elif hasattr(self, "mtp_embedding"):
            weight = self.mtp_embedding.weight
        else:
            weight = self.output_layer.weight  # the tied copy of the word embedding
        x = embedding_lookup(tokens.t(), weight, self.groups.tp, reduce_scatter=self.sp)
        return embedding_dropout(x, self.config.hidden_dropout if self.training else 0.0, self.rng_tracker, self.sp)

    # ---- parameters ------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Fill every parameter with its shard of the layout-independent full init for ``seed``."""
        tp = self.groups.tp
        for name, p in self.named_parameters():
            if p.is_meta:  # a skeleton (the memory plan's): no storage to fill, and meta randn is slow
                continue
            if hasattr(p, "init_from"):  # a part of a canonical fused tensor (replicated-KV attention)
                suffix, shape, which, g, qpg, d = p.init_from
                canonical = init_full(name.rsplit(".", 2)[0] + "." + suffix, shape, p.init, seed)
                full = extract_rows(canonical, which, g, qpg, d)
            else:
                shape = full_shape(p, tp.size)
                full = init_full(getattr(p, "init_name", name), shape, p.init, seed, getattr(p, "valid_rows", None))
            p.copy_(shard_param(full, p, tp.size, M.local_rank(tp)))

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        """Parameters whose grads are all-reduced over ``groups.embedding`` when tied across stages:
        the first stage's word embedding and the last stage's output copy (empty when untied). A chunk with neither
        end holds none: under a V-shaped schedule the last pipeline rank is in ``groups.embedding`` with middle
        stages only."""
        if not (self.pre_process or self.post_process):
            return []
        if self.config.untie_embeddings_and_output_weights:
            # multi-token prediction on a later stage than the embedding: its copy (mtp_embedding) is tied
            mtp = bool(self.config.mtp_num_layers) and not (self.pre_process and self.post_process)
            if not mtp:
                return []
            return [self.embedding.word_embeddings.weight if self.pre_process else self.mtp_embedding.weight]
        out = []
        if self.pre_process:
            out.append(self.embedding.word_embeddings.weight)
        if self.post_process and self.output_layer.weight is not None:
            out.append(self.output_layer.weight)
        return out

    # ---- forward ---------------------------------------------------------------------------
    def _rope_freqs(self, position_ids: torch.Tensor | None, s: int, device) -> torch.Tensor | None:
        if not C.uses_rope(self.config):
            return None
        if position_ids is None:
            pos = local_positions(s, self.groups.cp, device).float()[:, None]  # [s/cp, 1]
        else:
            pos = position_ids.t().float()  # [s, b]
        return (pos[..., None] * self.inv_freq.to(device))[:, :, None, :]  # [s, b|1, 1, r/2]

    def _run_layers(self, x: torch.Tensor, freqs, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        layers = list(self.decoder.layers.values())
        chunks = {c[0]: c for c in C.recompute_layers(self.config, len(layers))}
        extra = () if document_ids is None else (document_ids,)  # NOTE: BertModel's layers take two arguments
        offload = C.offload_layers(self.config) if self.offloader and self.training and torch.is_grad_enabled() else 0
        i = 0
        while i < offload:  # saved tensors to the host; layer i's come back as layer i + 1's backward starts
            with self.offloader.layer(layers[i]) as group:
                x = layers[i](x, freqs, *extra)
            if i:
                self.offloader.prefetch_hook(previous, x)
            previous, i = group, i + 1
        if offload:
            x = layers[i](x, freqs, *extra)  # offload < len(layers) (validated)
            self.offloader.prefetch_hook(previous, x)
            i += 1
        while i < len(layers):
            if i in chunks and self.training and torch.is_grad_enabled():
                chunk = [layers[j] for j in chunks[i]]

                def run(h, f, *d, chunk=chunk):
                    for layer in chunk:
                        h = layer(h, f, *d)
                    return h

                x = checkpoint(run, self.rng_tracker, x, freqs, *extra)
                i += len(chunk)
            else:
                x = layers[i](x, freqs, *extra)
                i += 1
        return x

    def forward(self, tokens: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None, *,
                rope_at_sequence_positions: bool = False, last_position_only: bool = False) -> torch.Tensor:
        """First stage: ``tokens [b, s]`` int64. Later stages: ``hidden [s, b, h]`` (``[s/tp, b, h]``
        under sequence parallelism; ``s`` is ``s/cp``, this rank's slice, under context parallelism). Last stage returns
        the per-token float32 loss ``[b, s]`` when ``labels [b, s]`` are given, else tp-local logits ``[s, b,
        V_pad/tp]`` with padding columns at -inf. Other stages return the hidden states for the next stage.
        ``document_ids [b, s]`` (every stage, ``--reset-attention-mask``): attention stays within each packed document.
        Multi-token prediction (``--mtp-num-layers``): a last stage given ``labels`` also reads ``tokens`` and
        ``loss_mask [b, s]`` (default all ones), and its loss joins the backward of the returned loss.
        ``rope_at_sequence_positions`` (training): the rotary angles at the sequence positions (this rank's under
        cp) whatever ``position_ids`` say, which then feed the learned position embedding only: Megatron's
        GPTModel, where --reset-position-ids restarts the learned positions but never RoPE's, and where a later
        pipeline stage (given no positions) rotates as the first one does.
        ``last_position_only`` (generation; Megatron's ``materialize_only_last_token_logits``): the logits of the
        last position alone, ``[1, b, V_pad/tp]``: the output layer skips the others' ``[s - 1, b, V_pad/tp]``."""
        x, freqs = self._inputs(tokens, position_ids, hidden, rope_at_sequence_positions)
        x = self._run_layers(x, freqs, document_ids)
        if last_position_only and self.post_process and labels is None:
            x = self._last_position(x)
        return self._outputs(x, labels, tokens, loss_mask, freqs)

    def _last_position(self, x: torch.Tensor) -> torch.Tensor:
        """``x [s, b, h]``'s last position ``[1, b, h]`` (norms and the output layer are per position)."""
        if self.sp:
            raise ValueError("last_position_only needs the whole sequence on every rank: generate with sequence "
                             "parallelism off (--sequence-parallel unset)")
        return x[-1:]

    def _inputs(self, tokens, position_ids, hidden,
                sequence_rope: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first layer's input ``[s, b, h]`` (embedded tokens, or the previous stage's hidden states) and the
        rotary frequencies."""
        if self.pre_process:
            if tokens is None:
                raise ValueError("the first pipeline stage needs tokens [b, s]")
            if position_ids is None:
                position_ids = local_positions(tokens.shape[1], self.groups.cp, tokens.device).expand_as(tokens)
            x = self.embedding(tokens, position_ids)
        else:
            if hidden is None:
                raise ValueError("a non-first pipeline stage needs hidden [s, b, h] from the previous stage")
            x = hidden
        s = x.shape[0] * (self.groups.tp.size if self.sp else 1)
        return x, self._rope_freqs(None if sequence_rope else position_ids, s, x.device)

    def _outputs(self, x: torch.Tensor, labels: torch.Tensor | None, tokens: torch.Tensor | None = None,
                 loss_mask: torch.Tensor | None = None, freqs: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's output from the last layer's: hidden states, or (last stage) the loss (with multi-token
        prediction's joined, which reads the micro-batch's ``tokens``) or the logits."""
        if not self.post_process:
            return x
        x = self.decoder.final_layernorm(x)
        if labels is None:
            return self._mask_padding(self._logits(x))
        loss = self._per_token_loss(x, labels)
        if getattr(self, "mtp", None) is not None and torch.is_grad_enabled():
            if tokens is None:
                raise ValueError("multi-token prediction: the last pipeline stage needs the micro-batch's tokens")
            mask = torch.ones_like(labels) if loss_mask is None else loss_mask
            extra = self.mtp.loss(x, tokens, labels, mask, freqs, self._mtp_embed, self._per_token_loss)
            loss = self.mtp.attach(loss, extra)
        return loss

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """The output layer on final hidden states: tp-local ``[s, b, V_pad/tp]``."""
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        return self.output_layer(x, weight)

    def _per_token_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` float32 cross-entropy of the output layer on ``x`` against ``labels [b, s]``."""
        loss = vocab_parallel_cross_entropy(self._logits(x), labels.t(), self.groups.tp,
                                            vocab_size=self.config.vocab_size, label_smoothing=self.label_smoothing,
                                            kernels=self.backend.kernels, inplace_backward=True)
        return loss.t()

    def _mask_padding(self, logits: torch.Tensor) -> torch.Tensor:
        """Padding vocabulary columns at -inf, so sampling and softmax never pick them."""
        tp = self.groups.tp
        v_local = logits.shape[-1]
        start = M.local_rank(tp) * v_local
        valid = max(0, min(v_local, self.config.vocab_size - start))
        if valid == v_local:
            return logits
        mask = torch.arange(v_local, device=logits.device) >= valid
        return logits.masked_fill(mask, float("-inf"))
