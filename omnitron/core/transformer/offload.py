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

Host buffers (Megatron's ``cpu_offloading_retain_pinned_cpu_buffers``): by default each offload allocates its host
copy and the copy is dropped once its tensor is back; with ``retain`` the buffer goes to a pool when its tensor is
unpacked and the next offload of the same dtype and size (the next micro-batch's, the next step's) copies into it,
so after the first step no host memory is allocated or pinned. Reuse is safe without a host wait: the copy back out
of the buffer and the next copy into it are both on the side stream, in that order (plain host copies without
streams).
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
    reused: int = 0
    """Offloads copied into a retained host buffer (``retain``) instead of a new one."""


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

    __slots__ = ("host", "device_copy", "device", "landed", "buffer")

    def __init__(self, host: torch.Tensor, device: torch.device, landed=None, buffer=None) -> None:
        self.host, self.device_copy, self.device, self.landed = host, None, device, landed
        self.buffer = buffer
        """The whole host buffer ``host`` views, returned to the offloader's pool when unpacked (``retain``)."""


@dataclass
class _LayerGroup:
    """What one layer's forward offloaded for one micro-batch (brought back together)."""

    held: list[_Held] = field(default_factory=list)


class ActivationOffloader:
    """Offloads the tensors layers save for backward (see the module docstring). ``backend``: the model's
    (streams, events, pinned memory); ``activations`` / ``weights``: which saved tensors move;
    a saved tensor sharing storage with a parameter of the layer is a weight; ``retain``: host buffers are kept and
    reused (module docstring)."""

    def __init__(self, backend, *, activations: bool = True, weights: bool = False, retain: bool = False) -> None:
        self.backend, self.activations, self.weights = backend, activations, weights
        self.device_type = backend.current_device().type
        self.streams = backend.capabilities().streams
        self._side = None
        self.stats = OffloadStats()
        self.pool: dict[tuple[torch.dtype, int], list[torch.Tensor]] | None = {} if retain else None
        """Free retained host buffers by (dtype, elements); None without ``retain``."""

    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer of ``t``'s dtype and size: a free retained one, else a new one (pinned where there are
        streams)."""
        free = self.pool.get((t.dtype, t.numel())) if self.pool is not None else None
        if free:
            self.stats.reused += 1
            return free.pop()
        return host_buffer(t.numel(), t.dtype, pin=self.streams)

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
        buffer = self._host_buffer(t)
        host = buffer.as_strided(t.shape, _dense_strides(t))
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
        held = _Held(host, t.device, landed, buffer if self.pool is not None else None)
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
        if held.buffer is not None:  # free for the next offload of its size (its copy back is ordered before)
            self.pool.setdefault((held.buffer.dtype, held.buffer.numel()), []).append(held.buffer)
            held.buffer = None
        return held.device_copy

    def prefetch_hook(self, group: _LayerGroup, output: torch.Tensor) -> None:
        """On the backward: bring ``group`` back when the gradient of ``output`` (the next layer's output)
        is computed, i.e. as that layer's backward starts."""
        if output.requires_grad:
            output.register_hook(lambda grad: self.prefetch(group))
