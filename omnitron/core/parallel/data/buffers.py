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
    param_data: torch.Tensor | None = None
    """The bucket's parameters (same offsets and padding as ``data``), a view into the buffer's
    ``param_data``; None unless :meth:`GradBuffer.allocate_param_buffer` ran."""
    param_handle: object | None = None
    """A pending asynchronous all-gather into ``param_data`` (``--overlap-param-gather``)."""

    def shard(self, index: int) -> torch.Tensor:
        """The ``index``-th of ``shards`` equal contiguous slices of ``data``."""
        n = self.data.numel() // self.shards
        return self.data[index * n:(index + 1) * n]

    def wait_param_gather(self) -> None:
        """Wait for the pending all-gather into ``param_data``, if any."""
        if self.param_handle is not None:
            self.param_handle.wait()
            self.param_handle = None

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

    def allocate_param_buffer(self) -> None:
        """Move the parameters into one flat tensor laid out like ``data`` (same offsets, same padding):
        ``param.data`` becomes a view of ``param_data`` and every bucket's ``param_data`` is its slice, so a
        distributed optimizer all-gathers updated parameters straight into the model, with no temporary."""
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"one gradient buffer holds parameters of dtypes {sorted(map(str, dtypes))}; a flat "
                             f"parameter buffer needs one dtype (group the buffers by parameter dtype)")
        dtype = dtypes.pop() if dtypes else self.grad_dtype
        self.param_data = torch.zeros(self.data.numel(), dtype=dtype, device=self.data.device)
        with torch.no_grad():
            for p in self.params:
                s, n = self._range[id(p)]
                view = self.param_data[s:s + n].view(p.shape)
                view.copy_(p)
                p.data = view
        for b in self.buckets:
            b.param_data = self.param_data[b.offset:b.offset + b.data.numel()]

    def param_range(self, param: torch.nn.Parameter) -> tuple[int, int]:
        """(start, numel) of ``param.main_grad`` inside ``data`` (for a distributed optimizer's shard maps)."""
        return self._range[id(param)]

    def zero(self) -> None:
        self.data.zero_()
        for b in self.buckets:
            b.reset()


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
