"""The Transformer MLP: column-parallel up projection, activation, row-parallel down projection."""
from __future__ import annotations

import torch
from torch import nn

from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    """``[s, b, h] -> ([s, b, h], bias)``. SwiGLU keeps ``[gate; up]`` fused in ``linear_fc1``
    (full layout: all gate rows, then all up rows; split block-wise so each rank holds matching
    halves); otherwise bias + tanh-GeLU."""

    def __init__(self, c, *, group, sequence_parallel: bool, backend, out_std: float,
                 skip_out_bias: bool = True) -> None:
        super().__init__()
        from omnitron.core.transformer.shapes import ffn_size

        self.swiglu, self.backend = c.swiglu, backend
        f = ffn_size(c)
        kw = dict(group=group, bias=c.add_bias_linear, sequence_parallel=sequence_parallel, dtype=c.params_dtype)
        # NOTE: the bias goes to the fused activation kernel when one exists; with the reference,
        # the GEMM adding it (addmm) saves a full pass over [s, b, f]
        fused_act = backend.kernels.resolved("swiglu" if c.swiglu else "bias_gelu") != "reference"
        self.linear_fc1 = ColumnParallelLinear(c.hidden_size, 2 * f if c.swiglu else f, init_std=c.init_method_std,
                                               stride=2 if c.swiglu else 1, skip_bias_add=fused_act, **kw)
        self.linear_fc2 = RowParallelLinear(f, c.hidden_size, init_std=out_std, skip_bias_add=skip_out_bias, **kw)

    def forward(self, x: torch.Tensor):
        y = self.linear_fc1(x)  # [s, b, (2)f/tp]
        y, bias = y if isinstance(y, tuple) else (y, None)
        k = self.backend.kernels
        y = k.swiglu(y, bias) if self.swiglu else k.bias_gelu(y, bias)
        y = self.linear_fc2(y)
        return y if isinstance(y, tuple) else (y, None)
