"""A pre-norm Transformer layer: two residual lines."""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from omnitron.core.transformer.attention import SelfAttention
from omnitron.core.transformer.mla import MLASelfAttention
from omnitron.core.transformer.mlp import MLP
from omnitron.core.transformer.norm import Norm, norm_kwargs


class TransformerLayer(nn.Module):
    """``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))`` on ``[s, b, h]``
    (``[s/tp, b, h]`` under sequence parallelism). ``mlp`` is a Mixture of Experts when
    ``c.num_experts`` is set and ``--moe-layer-freq`` makes global layer ``layer_number`` (0-based) an MoE
    layer (``groups``: the :class:`ParallelGroups`, for its expert groups)."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, groups=None,
                 layer_number: int = 0) -> None:
        super().__init__()
        self.c, self.tracker, self.backend, self.sp = c, tracker, backend, sequence_parallel
        out_std = c.init_method_std / math.sqrt(2.0 * c.num_layers) if c.apply_scaled_init else c.init_method_std
        nkw = norm_kwargs(c, backend, partial_grad=sequence_parallel)
        # output biases go to a fused bias-dropout-add kernel when one exists, else into the GEMM
        skip = backend.kernels.resolved("bias_dropout_add") != "reference"
        self.input_layernorm = Norm(c.hidden_size, **nkw)
        attention = MLASelfAttention if getattr(c, "multi_latent_attention", False) else SelfAttention
        self.self_attention = attention(c, group=group, sequence_parallel=sequence_parallel, tracker=tracker,
                                            backend=backend, out_std=out_std, skip_out_bias=skip)
        if attention is SelfAttention:
            from omnitron.core.transformer.window import attention_window

            self.self_attention.window = attention_window(c, layer_number)
        self.pre_mlp_layernorm = Norm(c.hidden_size, **nkw)
        from omnitron.core.transformer.moe.pattern import is_moe_layer

        if is_moe_layer(c, layer_number):  # Mixture of Experts in place of the MLP: needs the expert groups
            from omnitron.core.transformer.moe import MoELayer

            if groups is None:
                raise ValueError("an MoE layer (num_experts set) needs groups=ParallelGroups for its expert groups")
            self.mlp = MoELayer(c, groups=groups, sequence_parallel=sequence_parallel, backend=backend, out_std=out_std)
            self.mlp.layer_number = layer_number
        else:
            self.mlp = MLP(c, group=group, sequence_parallel=sequence_parallel, backend=backend, out_std=out_std,
                           skip_out_bias=skip)

    def _bias_dropout_add(self, out_and_bias, residual: torch.Tensor) -> torch.Tensor:
        out, bias = out_and_bias
        p = self.c.hidden_dropout if self.training else 0.0
        if p > 0.0 and self.tracker.in_graph():  # compiled: an explicit mask, this rank's slice under sp
            y = out if bias is None else out + bias
            return residual + y * self.tracker.keep_multiplier(y.shape, p, y, split_dim=0 if self.sp else None)
        # NOTE: sequence shards differ per tp rank, so their dropout masks must too
        ctx = self.tracker.fork() if (self.sp and p > 0.0) else contextlib.nullcontext()
        with ctx:
            return self.backend.kernels.bias_dropout_add(out, bias, residual, p, self.training)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``document_ids [b, s]``: attention stays within each packed document (``--reset-attention-mask``)."""
        attn = self.self_attention(self.input_layernorm(x), freqs, document_ids=document_ids)
        x = self._bias_dropout_add(attn, x)
        # NOTE: the MLP's output is a local before the bound method is looked up: an MoE layer compiled with the eager
        # exchange breaks the graph inside self.mlp, and torch 2.9's dynamo guarded the resumed frame on the bound
        # method left on the stack (new each call: a recompilation per call, eager after its limit of 8)
        out = self.mlp(self.pre_mlp_layernorm(x))
        return self._bias_dropout_add(out, x)
