"""Contiguous gradient buffers split into buckets, laid out as megatron-core lays out its param-and-grad buffers.

Parameters are laid out in reverse registration order (roughly the order backward produces
their gradients), so buckets fill one after another during backward; a bucket closes as soon as it
holds at least ``bucket_size`` elements. Without sharding (gradients all-reduced) nothing is padded:
Megatron's ``_compute_default_per_buffer_param_layout``. Cut into shards (reduce-scatter, the distributed
optimizer) the layout is Megatron's distributed optimizer's (``_compute_per_buffer_param_layout``): every
parameter starts at a multiple of 64 elements and every bucket ends at a multiple of lcm(shards, 128), so each
rank owns one equal contiguous shard of each bucket at the same offsets as in Megatron (its
``distrib_optim.pt`` is laid out this way). Parameters passed as ``isolate`` (the tied word embedding's copies on
the first and last pipeline stage: Megatron's ``shared_embedding``) get a bucket of their own, so both copies are
cut into the same shards and their gradients can be summed shard by shard after the scatter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PARAM_ALIGN = 64
"""Sharded layouts start every parameter at a multiple of this many elements (Megatron's ``pad_param_start``)."""
BUCKET_ALIGN = 128
"""Sharded layouts end every bucket at a multiple of lcm(shards, this) (Megatron's ``pad_bucket_end``)."""


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
    numel_unpadded: int = -1
    """Elements up to the end of the bucket's last parameter (Megatron's ``numel_unpadded``: without the bucket
    end's padding, with the parameters' alignment gaps); -1 when not given."""

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

    def __init__(self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, bucket_size: int | None,
                 shards: int, isolate: frozenset[int] = frozenset(), *, sharded: bool = True) -> None:
        """``params`` in backward order; ``sharded``: the distributed optimizer's (reduce-scatter's) layout, else
        the all-reduce layout (no padding, nothing isolated); ``bucket_size`` None: one bucket."""
        self.params, self.grad_dtype, self.shards = params, grad_dtype, shards
        ranges, bounds = layout([p.numel() for p in params], bucket_size, shards, sharded=sharded,
                                isolate=[id(p) in isolate for p in params])
        index = {id(p): (s0, s1 - s0) for p, (s0, s1, _) in zip(params, ranges)}
        start = bounds[-1][1] if bounds else 0
        device = params[0].device if params else torch.device("cpu")
        self.data = torch.zeros(start, dtype=grad_dtype, device=device)
        members: list[list[torch.nn.Parameter]] = [[] for _ in bounds]
        for p, (_, _, k) in zip(params, ranges):
            members[k].append(p)
        self.buckets = [Bucket(ps, self.data[b0:b1], b0, shards, numel_unpadded=u)
                        for ps, (b0, b1, u) in zip(members, bounds)]
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


def layout(numels: list[int], bucket_size: int | None, shards: int, *, sharded: bool,
           isolate: list[bool] | None = None) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Megatron-core's buffer layout of parameters of ``numels`` elements, given in backward order.

    Returns each parameter's ``(start, end, bucket)`` and each bucket's ``(start, end, numel_unpadded)`` in
    elements. ``sharded`` (the distributed optimizer): parameters start at multiples of :data:`PARAM_ALIGN`,
    buckets end at multiples of lcm(``shards``, :data:`BUCKET_ALIGN`), and a parameter flagged in ``isolate``
    closes the bucket before it (if not empty) and its own; else no padding at all. A bucket closes once it holds
    at least ``bucket_size`` elements (None: never, one bucket)."""
    isolate = isolate if sharded and isolate is not None else [False] * len(numels)
    end_align = math.lcm(shards, BUCKET_ALIGN) if sharded else 1
    start_align = PARAM_ALIGN if sharded else 1
    ranges: list[tuple[int, int, int]] = []
    bounds: list[tuple[int, int, int]] = []
    lo = nxt = 0  # the open bucket's start; where the next parameter may start
    holds = False  # the open bucket holds a parameter

    def close(at: int) -> int:
        bounds.append((lo, _pad(at, end_align), at - lo))
        return bounds[-1][1]

    for n, alone in zip(numels, isolate):
        s0 = _pad(nxt, start_align)
        if alone and holds:  # NOTE: Megatron counts the alignment gap before it in the closed bucket's numel_unpadded
            lo = nxt = s0 = close(s0)
        ranges.append((s0, s0 + n, len(bounds)))
        holds, nxt = True, s0 + n
        if alone or (bucket_size is not None and nxt - lo >= bucket_size):
            lo = nxt = close(nxt)
            holds = False
    if holds:
        close(nxt)
    return ranges, bounds


def _pad(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple
