"""LayerNorm / RMSNorm through the kernel registry."""
from __future__ import annotations

import torch
from torch import nn

from omnitron.core.parallel.tensor.sharding import set_attributes


class Norm(nn.Module):
    """Normalize the last dim with ``kind`` ("LayerNorm" or "RMSNorm") and an affine weight.

    ``partial_grad`` marks the parameters whose gradients are partial sums over tp (applied to
    sequence shards, or shared by heads on different ranks): they get ``sequence_parallel=True``.
    ``zero_centered`` (``--apply-layernorm-1p``): the scale is ``1 + weight``, the weight starts at 0.
    """

    def __init__(self, dim: int, *, kind: str, eps: float, backend, partial_grad: bool = False, dtype=None,
                 zero_centered: bool = False) -> None:
        super().__init__()
        self.kind, self.eps, self.backend, self.zero_centered = kind, eps, backend, zero_centered
        init = ("zeros",) if zero_centered else ("ones",)
        self.weight = set_attributes(nn.Parameter(torch.empty(dim, dtype=dtype)), parallel=False, init=init)
        self.weight.sequence_parallel = partial_grad
        self.bias = None
        if kind == "LayerNorm":
            self.bias = set_attributes(nn.Parameter(torch.empty(dim, dtype=dtype)), parallel=False, init=("zeros",))
            self.bias.sequence_parallel = partial_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.backend.kernels
        weight = self.weight + 1 if self.zero_centered else self.weight
        if self.kind == "RMSNorm":
            return k.rms_norm(x, weight, self.eps)
        return k.layer_norm(x, weight, self.bias, self.eps)


def norm_kwargs(c, backend, *, partial_grad: bool) -> dict:
    """The keyword arguments of a model's :class:`Norm` from its config ``c`` (kind, epsilon, dtype, 1p)."""
    return dict(kind=c.normalization, eps=c.layernorm_epsilon, backend=backend, partial_grad=partial_grad,
                dtype=c.params_dtype, zero_centered=getattr(c, "apply_layernorm_1p", False))
