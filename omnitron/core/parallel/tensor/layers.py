"""Tensor-parallel linear layers and the vocabulary-parallel embedding.

Shapes follow Megatron: activations are ``[s, b, h]``; under sequence parallelism the input of a
column-parallel layer and the output of a row-parallel layer are sequence shards ``[s/tp, b, h]``.
Parameters are created empty; the model fills them from layout-independent full tensors
(:func:`omnitron.core.parallel.tensor.sharding.init_full`).

FP8 seam: each linear has ``self.fp8 = None``. When set, the local GEMM is
``self.fp8(x, weight, bias)`` (a callable with F.linear's contract); nothing else changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.gather_linear import gather_linear
from omnitron.core.parallel.tensor.sharding import set_attributes


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor-parallel size {d}")
    return n // d


class _ParallelLinear(nn.Module):
    """Shared GEMM seam of the column- and row-parallel layers."""

    fp8 = None

    def _gemm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The one local GEMM: FP8 when ``self.fp8`` is set, else F.linear."""
        return self.fp8(x, weight, bias) if self.fp8 is not None else F.linear(x, weight, bias)


class ColumnParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by output rows over tp: each rank computes ``[.., out/tp]``.

    ``gather_output`` all-gathers the result to ``[.., out]``. With ``sequence_parallel`` the input
    is a sequence shard that is all-gathered first (backward: reduce-scatter); on the plain GEMM path autograd
    keeps the shard, not the gathered input (:mod:`.gather_linear`). ``stride`` > 1 keeps
    ``stride`` fused blocks (e.g. SwiGLU's ``[gate; up]``) split block-wise. ``weight=False`` uses
    a weight passed to forward (tied output layer).
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True, gather_output: bool = False,
                 sequence_parallel: bool = False, init_std: float = 0.02, stride: int = 1, skip_bias_add: bool = False,
                 own_weight: bool = True, valid_rows: int | None = None, dtype=None, device=None) -> None:
        super().__init__()
        self.group, self.gather_output, self.sequence_parallel = group, gather_output, sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.fp8 = None
        self.out_local = _divide(out_features, group.size, "output features")
        kw = dict(dtype=dtype, device=device)
        self.weight = None
        if own_weight:
            self.weight = set_attributes(nn.Parameter(torch.empty(self.out_local, in_features, **kw)), parallel=True,
                                         dim=0, stride=stride, init=("normal", init_std), valid_rows=valid_rows)
        self.bias = None
        if bias:
            self.bias = set_attributes(nn.Parameter(torch.empty(self.out_local, **kw)), parallel=True, dim=0,
                                       stride=stride, init=("zeros",))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None):
        weight = self.weight if weight is None else weight
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.fp8 is None and self.group.size > 1:  # gathered inside, the shard saved
            y = gather_linear(x, weight, bias, self.group)  # [s, b, out/tp]
        else:
            if self.sequence_parallel:  # the FP8 GEMM saves its own FP8 copy of the gathered input
                x = M.gather_from_sp(x, self.group)  # [s/tp, b, h] -> [s, b, h]
            else:
                x = M.copy_to_tp(x, self.group)
            y = self._gemm(x, weight, bias)  # [s, b, out/tp]
        if self.gather_output:
            y = M.gather_from_tp(y, self.group)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(_ParallelLinear):
    """``Y = X A^T + b`` with ``A`` split by input columns: partial products summed over tp.

    The input is already split (``input_is_parallel``) or scattered here. The sum is an all-reduce,
    or a reduce-scatter into sequence shards with ``sequence_parallel``. The bias is replicated and
    added after the reduction (returned separately with ``skip_bias_add`` for fused bias-dropout-add).
    """

    def __init__(self, in_features: int, out_features: int, *, group, bias: bool = True, input_is_parallel: bool = True,
                 sequence_parallel: bool = False, init_std: float = 0.02, skip_bias_add: bool = False,
                 dtype=None, device=None) -> None:
        super().__init__()
        self.group, self.input_is_parallel, self.sequence_parallel = group, input_is_parallel, sequence_parallel
        self.skip_bias_add = skip_bias_add
        self.fp8 = None
        in_local = _divide(in_features, group.size, "input features")
        kw = dict(dtype=dtype, device=device)
        self.weight = set_attributes(nn.Parameter(torch.empty(out_features, in_local, **kw)), parallel=True, dim=1,
                                     init=("normal", init_std))
        self.bias = None
        if bias:
            self.bias = set_attributes(nn.Parameter(torch.empty(out_features, **kw)), parallel=False, init=("zeros",))
            self.bias.sequence_parallel = sequence_parallel and group.size > 1

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = M.scatter_to_tp(x, self.group)
        if self.group.size == 1 and not self.skip_bias_add:
            return self._gemm(x, self.weight, self.bias)  # nothing to reduce: the GEMM adds the bias
        y = self._gemm(x, self.weight, None)  # partial sum [s, b, out]
        y = M.reduce_scatter_to_sp(y, self.group) if self.sequence_parallel else M.reduce_from_tp(y, self.group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose (padded) vocabulary rows are split over tp.

    Each rank looks up the tokens in its row range (zeros elsewhere) and the partial results are
    summed: all-reduce, or reduce-scatter into sequence shards when ``reduce_scatter`` (input
    ``[s, b]`` then gives ``[s/tp, b, h]``). Rows past ``vocab_size`` are padding and never used.
    """

    def __init__(self, padded_vocab: int, hidden: int, *, group, vocab_size: int, init_std: float = 0.02,
                 dtype=None, device=None) -> None:
        super().__init__()
        self.group = group
        self.rows = _divide(padded_vocab, group.size, "padded vocabulary size")
        self.start = M.local_rank(group) * self.rows
        self.weight = set_attributes(nn.Parameter(torch.empty(self.rows, hidden, dtype=dtype, device=device)),
                                     parallel=True, dim=0, init=("normal", init_std), valid_rows=vocab_size)

    def forward(self, ids: torch.Tensor, reduce_scatter: bool = False) -> torch.Tensor:
        return embedding_lookup(ids, self.weight, self.group, reduce_scatter=reduce_scatter)


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor, group, *, reduce_scatter: bool = False) -> torch.Tensor:
    """A vocab-parallel lookup in ``weight`` (this tp rank's rows of the padded vocabulary, in rank order): each
    rank looks up the ids in its rows, zeros elsewhere, and the partial results are summed over ``group``
    (reduce-scattered into sequence shards when ``reduce_scatter``)."""
    if group.size == 1:
        return F.embedding(ids, weight)
    rows = weight.shape[0]
    start = M.local_rank(group) * rows
    outside = (ids < start) | (ids >= start + rows)
    local = (ids - start).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return M.reduce_scatter_to_sp(out, group) if reduce_scatter else M.reduce_from_tp(out, group)
