"""LayerNorm / RMSNorm through the kernel registry."""
from __future__ import annotations

import torch
from torch import nn

from omnitron.core.parallel.tensor.sharding import set_attributes


class Norm(nn.Module):
    """Normalize the last dim with ``kind`` ("LayerNorm" or "RMSNorm") and an affine weight.

    ``partial_grad`` marks the parameters whose gradients are partial sums over tp (applied to
    sequence shards, or shared by heads on different ranks): they get ``sequence_parallel=True``.
    """

    def __init__(self, dim: int, *, kind: str, eps: float, backend, partial_grad: bool = False, dtype=None) -> None:
        super().__init__()
        self.kind, self.eps, self.backend = kind, eps, backend
        self.weight = set_attributes(nn.Parameter(torch.empty(dim, dtype=dtype)), parallel=False, init=("ones",))
        self.weight.sequence_parallel = partial_grad
        self.bias = None
        if kind == "LayerNorm":
            self.bias = set_attributes(nn.Parameter(torch.empty(dim, dtype=dtype)), parallel=False, init=("zeros",))
            self.bias.sequence_parallel = partial_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.backend.kernels
        if self.kind == "RMSNorm":
            return k.rms_norm(x, self.weight, self.eps)
        return k.layer_norm(x, self.weight, self.bias, self.eps)
