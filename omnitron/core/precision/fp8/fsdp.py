"""FP8 with ``--use-torch-fsdp2``: each FP8 linear's weight is all-gathered in FP8 (1 byte per element instead of
the compute dtype's 2 or 4), with every weight's scale precomputed once per step by one batched amax all-reduce.

The design is torchao's float8 FSDP2 all-gather (read for understanding; this is omnitron's own code over its
own FP8 linear). FSDP2 calls two methods of a parameter's local shard when the shard's tensor class has them:

* :class:`FP8ShardedWeight` wraps the fp32 master shard FSDP2 keeps (the optimizer steps the wrapped tensor, so
  the masters stay fp32 and unchanged). Its ``fsdp_pre_all_gather`` casts the shard to e4m3 with the weight's
  precomputed scale (the same formula as the one-process cast: ``fp8(clamp(w * scale))``) and hands FSDP2 the
  bytes; its ``fsdp_post_all_gather`` wraps the gathered bytes as an :class:`FP8GatheredWeight`, the unsharded
  parameter the linear's forward sees. :class:`~omnitron.core.precision.fp8.linear.FP8Linear` takes that
  weight's FP8 codes and ``1 / scale`` as they are (no second cast); its weight gradient is an ordinary dense
  tensor in the parameter's dtype, which FSDP2 reduce-scatters as before.
* :class:`WeightScales` computes every wrapped weight's scale: ``amax = max |w|`` of each local shard, stacked,
  MAX-reduced in one all-reduce over the amax reduction group (tensor x context x data parallel: the whole
  weight, every shard and tensor-parallel piece), ``scale = fp8_max / amax`` as the tensorwise recipe's. Run
  after each optimizer step (and once after loading), so a step issues one amax all-reduce for its weights
  whatever the layer count, where per-weight current scaling would issue one per weight.

A gathered weight is bit-identical to the one-process cast of the same weight: the scale comes from the same
amax (the max over shards is the max of the whole) and the cast is elementwise. A shard whose weight changed
since the last :meth:`WeightScales.refresh` (a write outside the training step: an in-place op on the parameter or
its ``.data``, an optimizer step not followed by the refresh) falls back to reducing its own amax in
``fsdp_pre_all_gather`` (one all-reduce for that weight; every rank does the same); a write is seen where it passes
through the wrapper, or moves the parameter's or the master's version counter (:meth:`_Cast.current`). Only the
tensorwise recipe (current per-tensor scaling) is supported, as in torchao; the others are refused.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from omnitron.backends.fp8 import cast_to_fp8, fp8_dtype, scale_from_amax
from omnitron.core.precision.fp8.gathered import FP8GatheredWeight
from omnitron.core.precision.fp8.linear import FP8Linear

aten = torch.ops.aten
WEIGHT_FORMAT = "e4m3"
"""Format of the gathered weights (the forward operand format of every FP8 recipe)."""

_PRESERVED = {aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default,
              aten.view.default, aten.as_strided.default, aten._to_copy.default, aten._pin_memory.default,
              aten.split.Tensor, aten.split_with_sizes.default, aten.clone.default, aten.alias.default}
"""Ops whose results stay wrapped: FSDP2 pads, chunks, views and copies the local shard with them when it
shards the parameter, and the padded buffer it all-gathers from must still cast itself."""


class _Cast:
    """What every piece of one wrapped weight shares: its scale (None before the first refresh), the weight's
    version when the scale was taken (:meth:`current`), the margin, and how to reduce one amax when the scale is
    stale."""

    def __init__(self, margin: int, reduce_one) -> None:
        self.margin, self.reduce_one = margin, reduce_one
        self.scale: torch.Tensor | None = None
        self.version: tuple = ()
        self.writes = 0
        """Ops that wrote a piece of the weight through :class:`FP8ShardedWeight` (its ``__torch_dispatch__``)."""
        self.param = None
        """A weak reference to the sharded parameter (:meth:`WeightScales.collect`)."""

    def current(self, shard: torch.Tensor) -> tuple:
        """The weight's version: the writes through the wrapper (in-place ops on the parameter or its ``.data``,
        optimizer steps, foreach or not), the sharded parameter's version counter (its ``DTensor``'s:
        ``torch.autograd.graph.increment_version``) and its fp32 master's (written directly:
        :meth:`FP8ShardedWeight.master`). The local shard's own counter is not enough: ``DTensor`` and the wrapper
        run an op on their inner tensors below autograd, which bumps no counter, and a foreach step on ``DTensor``
        parameters (the optimizers' default on an accelerator) bumps not even the parameter's. Before
        :meth:`WeightScales.collect`, ``shard``'s master stands for the parameter."""
        p = self.param() if self.param is not None else None
        if p is None:
            return self.writes, shard._tensor._version
        local = p.to_local() if hasattr(p, "to_local") else p
        return self.writes, p._version, local.master()._version


class FP8ShardedWeight(torch.Tensor):
    """The fp32 master shard of an FP8 linear's weight, casting itself to e4m3 for FSDP2's all-gather."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, cast: _Cast):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), strides=tensor.stride(),
                                                   storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
                                                   layout=tensor.layout, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, cast: _Cast) -> None:
        self._tensor, self._cast = tensor, cast

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is aten.detach.default:
            return cls(args[0]._tensor, args[0]._cast)
        cast = next(a._cast for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        for t in _written(func, args, kwargs or {}):
            t._cast.writes += 1  # the scale taken before is stale (_Cast.current)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, cast), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._cast

    @staticmethod
    def __tensor_unflatten__(inner, cast, outer_size, outer_stride):
        return FP8ShardedWeight(inner["_tensor"], cast)

    def __repr__(self) -> str:
        return f"FP8ShardedWeight({tuple(self.shape)}, scale={self._cast.scale})"

    def master(self) -> torch.Tensor:
        """The wrapped fp32 tensor (what the optimizer and checkpoints read and write)."""
        return self._tensor

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """(this shard's e4m3 codes as bytes, padded to FSDP2's even shard rows), (the scale)."""
        c = self._cast
        if c.scale is None or c.version != c.current(self):  # changed outside a step: reduce this one now
            c.scale = scale_from_amax(c.reduce_one(_amax(self._tensor)), WEIGHT_FORMAT, c.margin)
            c.version = c.current(self)
        q = cast_to_fp8(self._tensor, WEIGHT_FORMAT, c.scale).view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())
        if q.shape[0] < rows:  # FSDP2 gathers equal shards; the padding rows fall past the weight's last row
            q = torch.cat([q, q.new_zeros(rows - q.shape[0], *q.shape[1:])])
        return (q,), (c.scale,)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The gathered codes as an :class:`FP8GatheredWeight` of ``param_dtype`` (or ``out`` given the new
        scale: FSDP2 refills the same byte buffer on later all-gathers)."""
        (data,), (scale,) = outputs, metadata
        if out is not None:
            out._scale_inv = scale.reciprocal()
            return None
        return FP8GatheredWeight(data.view(fp8_dtype(WEIGHT_FORMAT)), scale.reciprocal(), param_dtype), (data,)


def _written(func, args: tuple, kwargs: dict) -> list[FP8ShardedWeight]:
    """The :class:`FP8ShardedWeight` arguments ``func`` writes (those its schema marks mutable)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            out += [t for t in pytree.tree_leaves(value) if isinstance(t, FP8ShardedWeight)]
    return out


def _amax(t: torch.Tensor) -> torch.Tensor:
    """max |t| as float32 (0 for an empty shard, which FSDP2 gives a rank past the last row)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.linalg.vector_norm(t.detach(), float("inf"), dtype=torch.float32)


def master_of(t: torch.Tensor) -> torch.Tensor:
    """The fp32 master inside ``t`` when it is an :class:`FP8ShardedWeight`, else ``t``."""
    return t.master() if isinstance(t, FP8ShardedWeight) else t


class WeightScales:
    """The FP8-gathered weights of some FSDP2 chunks and their once-per-step scale refresh (module docstring).

    ``group``: the amax reduction group (a ``Group``; None or one member: no collective); ``collectives``: the
    backend's. :meth:`wrap` is called before ``fully_shard``, :meth:`collect` after it."""

    def __init__(self, group, collectives, margin: int = 0) -> None:
        self.group, self.collectives, self.margin = group, collectives, margin
        self.casts: list[_Cast] = []
        self.params: list[torch.nn.Parameter] = []
        self.reductions = 0
        """Amax all-reduces issued by :meth:`refresh` (one per call)."""

    def _reduce(self, amax: torch.Tensor) -> torch.Tensor:
        from omnitron.core.precision.fp8.scaling import reduce_amax

        return reduce_amax(amax, (self.group,), self.collectives)

    @torch.no_grad()
    def wrap(self, module: torch.nn.Module) -> int:
        """Make the weight of every FP8 linear of ``module`` an :class:`FP8ShardedWeight` (its attributes kept);
        returns how many. The linears are those :func:`~omnitron.core.precision.fp8.enable_fp8` set up."""
        n = 0
        for m in module.modules():
            w = getattr(m, "weight", None)
            if not isinstance(getattr(m, "fp8", None), FP8Linear) or not isinstance(w, torch.nn.Parameter):
                continue
            cast = _Cast(self.margin, self._reduce)
            p = torch.nn.Parameter(FP8ShardedWeight(w.data, cast), requires_grad=w.requires_grad)
            p.__dict__.update({k: v for k, v in w.__dict__.items() if k != "_is_param"})
            m.weight = p
            self.casts.append(cast)
            n += 1
        return n

    def collect(self, module: torch.nn.Module) -> None:
        """After ``fully_shard``: remember the sharded parameters whose local shards :meth:`wrap` wrapped."""
        mine = {id(c) for c in self.casts}
        for p in module.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if isinstance(t, FP8ShardedWeight) and id(t._cast) in mine:
                self.params.append(p)
                t._cast.param = weakref.ref(p)

    @torch.no_grad()
    def refresh(self) -> None:
        """Every weight's scale from its current value: one stacked MAX all-reduce of the shards' amaxes."""
        if not self.params:
            return
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in self.params]
        amax = self._reduce(torch.stack([_amax(s.master()) for s in shards]))
        scales = scale_from_amax(amax, WEIGHT_FORMAT, self.margin)
        for s, scale in zip(shards, scales.unbind(0)):
            s._cast.scale, s._cast.version = scale, s._cast.current(s)
        self.reductions += 1


def fsdp_refusal(recipe) -> tuple[str, str] | None:
    """(the flag, why and the fix) when FSDP2 cannot all-gather ``recipe``'s weights in FP8; None when it can."""
    if recipe.fp8_recipe != "tensorwise":
        return (f"--fp8-recipe {recipe.fp8_recipe}", "FP8 weights are all-gathered under tensorwise scaling only "
                "(scales precomputed once per step); use --fp8-recipe tensorwise")
    if recipe.fp8_impl != "omnitron":
        return (f"--fp8-impl {recipe.fp8_impl}",
                "the FP8 all-gather feeds omnitron's FP8 linear; use --fp8-impl omnitron")
    return None


def sharded_weights(modules: Sequence[torch.nn.Module]) -> list[FP8ShardedWeight]:
    """The :class:`FP8ShardedWeight` local shards among ``modules``' parameters (tests, diagnostics)."""
    out = []
    for m in modules:
        for p in m.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if isinstance(t, FP8ShardedWeight):
                out.append(t)
    return out
