"""The Transformer MLP: column-parallel up projection, activation, row-parallel down projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def exact_gelu(c) -> bool:
    """Whether the GeLU MLP runs the exact erf GeLU: Megatron-Core runs the tanh approximation only inside its
    fused bias-GeLU kernel, which it uses when ``bias_gelu_fusion`` and the linears have biases
    (``megatron/core/transformer/mlp.py``, ``megatron/training/arguments.py``); otherwise ``F.gelu``."""
    if c.swiglu or getattr(c, "squared_relu", False):
        return False
    return not (getattr(c, "bias_gelu_fusion", True) and c.add_bias_linear)


def glu_variant(c) -> tuple[str, float, float | None] | None:
    """``(activation, offset, clamp)`` of a gated MLP other than plain SwiGLU, else None: ``--quick-geglu``
    (``x sigmoid(1.702 x)``), ``--glu-linear-offset``, ``--activation-func-clamp-value`` (gpt-oss)."""
    quick, offset = getattr(c, "quick_geglu", False), getattr(c, "glu_linear_offset", 0.0)
    clamp = getattr(c, "activation_func_clamp_value", None)
    if not quick and offset == 0.0 and clamp is None:
        return None
    return ("quick_gelu" if quick else "silu"), offset, clamp


def gated_activation(y: torch.Tensor, act: str, offset: float, clamp: float | None) -> torch.Tensor:
    """``act(gate) * (up + offset)`` of ``y = [gate | up]`` (each half of the last dim); with ``clamp`` the gate
    is clamped above at it and ``up`` to ``[-clamp, clamp]`` first (gpt-oss's SwiGLU, Megatron's
    ``activation_func_clamp_value``)."""
    gate, up = y.chunk(2, dim=-1)
    if clamp is not None:
        gate, up = gate.clamp(max=clamp), up.clamp(min=-clamp, max=clamp)
    gate = gate * torch.sigmoid(1.702 * gate) if act == "quick_gelu" else F.silu(gate)
    return gate * (up + offset)


def activate(kernels, y: torch.Tensor, bias: torch.Tensor | None, *, swiglu: bool, exact: bool,
             glu: tuple | None = None, squared_relu: bool = False) -> torch.Tensor:
    """The MLP's activation on ``y`` (+ ``bias`` when the GEMM left it out): SwiGLU, exact or tanh GeLU, the
    gated variant ``glu`` (:func:`glu_variant`), or ``relu(y)^2`` (``squared_relu``, --squared-relu)."""
    if squared_relu:  # Megatron's megatron.core.activations.squared_relu: pow(relu(x), 2)
        return F.relu(y if bias is None else y + bias).pow(2)
    if glu is not None:
        return gated_activation(y if bias is None else y + bias, *glu)
    if exact:  # the bias was added by the GEMM (no fused kernel takes it)
        return F.gelu(y if bias is None else y + bias)
    return kernels.swiglu(y, bias) if swiglu else kernels.bias_gelu(y, bias)


def fused_activation(c, kernels) -> bool:
    """Whether an MLP of config ``c`` built on kernel table ``kernels`` hands fc1's bias to a fused activation kernel
    (its ``skip_bias_add``): where the table resolves the activation (SwiGLU, tanh GeLU) to a kernel other than the
    reference; with the reference, the GEMM adding it (addmm) saves a full pass over ``[s, b, f]``."""
    return kernels.resolved("swiglu" if c.swiglu else "bias_gelu") != "reference" and not exact_gelu(c) \
        and glu_variant(c) is None and not getattr(c, "squared_relu", False)


class MLP(nn.Module):
    """``[s, b, h] -> ([s, b, h], bias)``. SwiGLU keeps ``[gate; up]`` fused in ``linear_fc1``
    (full layout: all gate rows, then all up rows; split block-wise so each rank holds matching
    halves); otherwise bias + GeLU (tanh or exact, see :func:`exact_gelu`), or bias + squared ReLU
    (--squared-relu)."""

    def __init__(self, c, *, group, sequence_parallel: bool, backend, out_std: float,
                 skip_out_bias: bool = True) -> None:
        super().__init__()
        from omnitron.core.transformer.shapes import ffn_size

        self.swiglu, self.exact_gelu, self.backend, self.glu = c.swiglu, exact_gelu(c), backend, glu_variant(c)
        self.squared_relu = getattr(c, "squared_relu", False)
        f = ffn_size(c)
        kw = dict(group=group, bias=c.add_bias_linear, sequence_parallel=sequence_parallel, dtype=c.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(c.hidden_size, 2 * f if c.swiglu else f, init_std=c.init_method_std,
                                               stride=2 if c.swiglu else 1,
                                               skip_bias_add=fused_activation(c, backend.kernels), **kw)
        self.linear_fc2 = RowParallelLinear(f, c.hidden_size, init_std=out_std, skip_bias_add=skip_out_bias, **kw)

    def forward(self, x: torch.Tensor):
        y = self.linear_fc1(x)  # [s, b, (2)f/tp]
        y, bias = y if isinstance(y, tuple) else (y, None)
        y = activate(self.backend.kernels, y, bias, swiglu=self.swiglu, exact=self.exact_gelu, glu=self.glu,
                     squared_relu=self.squared_relu)
        y = self.linear_fc2(y)
        return y if isinstance(y, tuple) else (y, None)
