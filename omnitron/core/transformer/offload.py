"""Activation offloading (Megatron's ``--cpu-offloading-num-layers``): what the first N layers of the stack
save for backward goes to host memory during forward and comes back before their backward.

Mechanism: the layer's forward runs under ``torch.autograd.graph.saved_tensors_hooks``. The pack hook
copies each selected tensor into (pinned) host memory on a side stream, after that stream waits for the
compute stream that produced it; ``record_stream`` keeps the device block from reuse until the copy has
read it, and the pack hook's result holds only the host copy, so the device memory is freed as soon as
the forward no longer needs the tensor. When the backward reaches layer i + 1 (a hook on its output's
gradient), layer i's tensors are copied back on the side stream into blocks allocated on the compute
stream (``record_stream`` again: the side stream wrote them); the unpack hook makes the compute stream
wait for the side stream before the backward node reads the tensor. A tensor the prefetch missed is
brought back in the unpack hook itself. On a backend without streams (cpu) the copies are plain
host copies: the selection and the counts are the same, the memory is the same memory.

Selection (Megatron's ``cpu_offloading_activations`` / ``cpu_offloading_weights``): a saved tensor is a
*weight* when it shares storage with one of the model's parameters (the parameter itself, a view or a
transpose of it), else an *activation*; the flags choose which kinds move. Offloading a weight frees
nothing while the parameter stays on the device (Megatron's switch is for transient weight copies);
it is counted like the rest. Tensors already on the host stay.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from omnitron.backends.host_memory import host_buffer


@dataclass
class OffloadStats:
    """What was offloaded since the offloader was built (host bytes as copied, per kind)."""

    activation_bytes: int = 0
    weight_bytes: int = 0
    tensors: int = 0
    reloaded: int = 0
    """Tensors brought back (by the prefetch or, when it missed them, in the unpack hook)."""
    reloaded_late: int = 0
    """Of those, brought back in the unpack hook: the prefetch had not started them."""


def _dense_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides when they lay its elements out densely without overlap (a permuted contiguous tensor,
    e.g. a transposed weight), else the contiguous strides: the copies keep the layout the backward kernels
    saw, so they take the same paths and round the same way."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d)))
    expected = 1
    for d in order:
        if t.size(d) != 1 and t.stride(d) != expected:
            return torch.empty(t.shape, device="meta").stride()
        expected *= t.size(d)
    return t.stride()


class _Held:
    """One offloaded tensor: its host copy until it is brought back, then its device copy."""

    __slots__ = ("host", "device_copy", "device", "landed")

    def __init__(self, host: torch.Tensor, device: torch.device, landed=None) -> None:
        self.host, self.device_copy, self.device, self.landed = host, None, device, landed


@dataclass
class _LayerGroup:
    """What one layer's forward offloaded for one micro-batch (brought back together)."""

    held: list[_Held] = field(default_factory=list)


class ActivationOffloader:
    """Offloads the tensors layers save for backward (see the module docstring). ``backend``: the model's
    (streams, events, pinned memory); ``activations`` / ``weights``: which saved tensors move;
    a saved tensor sharing storage with a parameter of the layer is a weight."""

    def __init__(self, backend, *, activations: bool = True, weights: bool = False) -> None:
        self.backend, self.activations, self.weights = backend, activations, weights
        self.device_type = backend.current_device().type
        self.streams = backend.capabilities().streams
        self._side = None
        self.stats = OffloadStats()

    @property
    def side_stream(self):
        """The copy stream (made at first use, on the then current device)."""
        if self._side is None:
            self._side = self.backend.Stream()
        return self._side

    @contextlib.contextmanager
    def layer(self, module: torch.nn.Module):
        """Run ``module``'s forward under this: yields the group whose :meth:`prefetch` brings it back.
        (Parameter storages are read per forward, not once: data-parallel wrappers move parameters into buffers;
        and at the first saved tensor, not on entry: FSDP2's layer holds sharded DTensors, which have no storage,
        until its forward hook swaps in the gathered parameters the forward saves.)"""
        group, storages = _LayerGroup(), []

        def pack(t: torch.Tensor):
            if not storages:
                storages.append({p.untyped_storage().data_ptr() for p in module.parameters()
                                 if type(p).__name__ != "DTensor"})
            return self._pack(t, group, storages[0])

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield group

    def _pack(self, t: torch.Tensor, group: _LayerGroup, param_storages: set[int]):
        if t.device.type != self.device_type or not t.numel():
            return t
        weight = t.untyped_storage().data_ptr() in param_storages
        if not (self.weights if weight else self.activations):
            return t
        host = host_buffer(t.numel(), t.dtype, pin=self.streams).as_strided(t.shape, _dense_strides(t))
        if self.streams:
            side = self.side_stream
            side.wait_stream(self.backend.current_stream())  # t is written on the compute stream
            with self.backend.stream(side):
                host.copy_(t, non_blocking=True)
            t.record_stream(side)  # the block is not reused before the copy has read it
            landed = self.backend.Event()
            landed.record(side)
        else:
            host.copy_(t)
            landed = None
        if weight:
            self.stats.weight_bytes += host.nbytes
        else:
            self.stats.activation_bytes += host.nbytes
        self.stats.tensors += 1
        held = _Held(host, t.device, landed)
        group.held.append(held)
        return held

    def _reload(self, held: _Held) -> None:
        """Start bringing ``held`` back (on the side stream where there are streams)."""
        dev = torch.empty_strided(held.host.shape, held.host.stride(), dtype=held.host.dtype,
                                  device=held.device)  # on the compute stream
        if self.streams:
            # NOTE: the host waits for the copy out (long done by this backward) before the copy back reads the
            # buffer: stream order alone does not cover a host buffer where a runtime stages from it at issue
            held.landed.synchronize()
            side = self.side_stream
            side.wait_stream(self.backend.current_stream())  # the block's previous use on the compute stream
            with self.backend.stream(side):
                dev.copy_(held.host, non_blocking=True)
            dev.record_stream(side)
        else:
            dev.copy_(held.host)
        held.device_copy = dev
        self.stats.reloaded += 1

    def prefetch(self, group: _LayerGroup) -> None:
        """Bring back every tensor of ``group`` not brought back yet (called as the backward reaches the layer
        after it); the group forgets them (the backward nodes hold them now)."""
        for held in group.held:
            if held.device_copy is None and held.host is not None:
                self._reload(held)
        group.held = []

    def _unpack(self, held):
        if not isinstance(held, _Held):
            return held
        if held.device_copy is None:
            self.stats.reloaded_late += 1
            self._reload(held)
        if self.streams:
            self.backend.current_stream().wait_stream(self.side_stream)
        held.host = None
        return held.device_copy

    def prefetch_hook(self, group: _LayerGroup, output: torch.Tensor) -> None:
        """On the backward: bring ``group`` back when the gradient of ``output`` (the next layer's output)
        is computed, i.e. as that layer's backward starts."""
        if output.requires_grad:
            output.register_hook(lambda grad: self.prefetch(group))
