"""The FP8 weight FSDP2 all-gathers (:mod:`omnitron.core.precision.fp8.fsdp`) as the FP8 linear reads it.

Its own module, below both: the linear recognises it (``operands``) and the FSDP2 extension makes it, so neither
imports the other for it.
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten


class FP8GatheredWeight(torch.Tensor):
    """An all-gathered FP8 weight posing as a ``param_dtype`` tensor: e4m3 codes and ``1 / scale``. The FP8
    linear reads them directly (:meth:`operands`); any other op sees the dequantized weight."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> None:
        self._data, self._scale_inv = data, scale_inv

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        w = args[0]
        if func is aten.detach.default:
            return cls(w._data, w._scale_inv, w.dtype)
        if func in (aten.as_strided.default, aten.view.default, aten.slice.Tensor) and isinstance(w, cls):
            return cls(func(w._data, *args[1:], **(kwargs or {})), w._scale_inv, w.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], inner["_scale_inv"], dtype)

    def __repr__(self) -> str:
        return f"FP8GatheredWeight({tuple(self.shape)}, {self.dtype}, scale_inv={self._scale_inv})"

    def dequantize(self) -> torch.Tensor:
        """``codes / scale`` in this tensor's dtype."""
        return (self._data.float() * self._scale_inv).to(self.dtype)

    def operands(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, q.t() contiguous, 1 / scale)``: what the FP8 linear's per-tensor weight cast returns."""
        return self._data, self._data.t().contiguous(), self._scale_inv
