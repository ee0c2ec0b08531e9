"""Contiguous gradient buffers split into buckets.

Parameters are laid out in reverse registration order (roughly the order backward produces
their gradients), so buckets fill one after another during backward. Each bucket is padded to
a multiple of the data-parallel size: a distributed optimizer can reduce-scatter exactly the
same buckets and own one contiguous shard of each. Parameters passed as ``isolate`` (the tied word
embedding's copies on the first and last pipeline stage) get a bucket of their own, so both copies
are cut into the same shards and their gradients can be summed shard by shard after the scatter.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """A contiguous slice of a :class:`GradBuffer` reduced by one collective."""

    params: list[torch.nn.Parameter]
    data: torch.Tensor
    """The bucket's gradient elements (padded), a view into the buffer."""
    offset: int
    """Start of ``data`` in the buffer, in elements."""
    shards: int
    """Number of equal shards (the data-parallel size)."""
    ready: set[int] = field(default_factory=set)
    handle: object | None = None
    launched: bool = False

    def shard(self, index: int) -> torch.Tensor:
        """The ``index``-th of ``shards`` equal contiguous slices of ``data``."""
        n = self.data.numel() // self.shards
        return self.data[index * n:(index + 1) * n]

    def reset(self) -> None:
        self.ready.clear()
        self.handle, self.launched = None, False


class GradBuffer:
    """One flat tensor holding ``main_grad`` for a list of parameters, in ``grad_dtype``."""

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, bucket_size: int,
                 shards: int, isolate: frozenset[int] = frozenset()) -> None:
        self.params, self.grad_dtype, self.shards = params, grad_dtype, shards
        plan: list[tuple[list, int, int]] = []  # (params, start, padded size)
        index: dict[int, tuple[int, int]] = {}  # id(param) -> (start, numel)
        start, cur, cur_start = 0, [], 0

        def close() -> None:
            nonlocal start, cur, cur_start
            if cur:
                start = cur_start + _pad(start - cur_start, shards)
                plan.append((cur, cur_start, start - cur_start))
                cur, cur_start = [], start

        for p in params:  # already in backward order
            if id(p) in isolate:
                close()
            index[id(p)] = (start, p.numel())
            cur.append(p)
            start += p.numel()
            if start - cur_start >= bucket_size or id(p) in isolate:
                close()
        close()
        device = params[0].device if params else torch.device("cpu")
        self.data = torch.zeros(start, dtype=grad_dtype, device=device)
        self.buckets = [Bucket(ps, self.data[s:s + n], s, shards) for ps, s, n in plan]
        self.bucket_of: dict[int, Bucket] = {}
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[id(p)] = b
        self._range = index
        for p in params:
            s, n = index[id(p)]
            p.main_grad = self.data[s:s + n].view(p.shape)

    def param_range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """(start, numel) of ``param.main_grad`` inside ``data`` (for a distributed optimizer's shard maps)."""
        return self._range[id(param)]

    def zero(self) -> None:
        self.data.zero_()
        for b in self.buckets:
            b.reset()


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
