"""Activation recomputation whose recomputed tensors serve every backward pass over the graph, the two halves
of a split backward included (:mod:`omnitron.core.parallel.pipeline.wgrad`).

torch's non-reentrant checkpoint recomputes once per graph task: W of a split backward runs one task per weight
boundary, so a checkpointed GPT layer's forward ran 1 + 1 (B) + 6 (W) times a micro-batch, and each W task's
recomputed tensors that it did not read stayed until the graph was freed (``BENCHMARKS.md``, pipeline memory).
Here each tensor the checkpointed forward saves is a :class:`_Saved` slot on the graph; the first read of an
empty slot reruns the forward once and fills every live slot still owed to a later read. A read empties its slot
(the tensor's last use) except in B of a split backward at a weight boundary (:func:`split_backward.keeps_saved`),
whose node W runs again: that slot keeps its value for W, so W reruns nothing. A slot read in B by a node on the
input path alone is never read again (``done``) and is not refilled.

As torch's checkpoint, a slot read twice in one graph task is an error (a second read would rerun the layer, its
collectives and RNG replay included), only a new task (W, a second ``retain_graph`` backward) may rerun, and a
rerun must save tensors of the forward's shapes, dtypes and devices. Both torch APIs used are private: without
``_current_graph_task_id`` a second read reruns unchecked; without ``_current_autograd_node`` no read is taken as
a weight boundary's, so W reruns each layer once more (gradients unchanged).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
import torch.utils.checkpoint

from omnitron.core.parallel import split_backward


class _Saved:
    """One tensor the checkpointed forward saved: its recomputed value while one is held."""

    __slots__ = ("frame", "index", "value", "done", "task", "__weakref__")

    def __init__(self, frame: "_Frame", index: int) -> None:
        self.frame, self.index, self.value, self.done = frame, index, None, False
        self.task: int | None = None  # the graph task of the last read


def _graph_task() -> int | None:
    """The graph task running this backward; None outside one or where torch lacks the (private) API."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    task = current() if current is not None else -1
    return None if task == -1 else task


def _autograd_node():
    """The node whose backward reads a saved tensor; None where torch lacks the (private) API: no read is then a
    weight boundary's, and W reruns the forward (the gradients the same, one layer forward more)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def _meta(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.device


def _describe(meta: tuple) -> str:
    shape, dtype, device = meta
    return f"shape {list(shape)} {str(dtype).removeprefix('torch.')} on {device}"


_TENSOR = object()  # a tensor argument's place in a frame's arguments


class _SaveInputs(torch.autograd.Function):
    """Keeps the checkpointed call's tensor inputs as saved tensors of a node of its own (output unused)."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.count = len(tensors)
        return dummy.new_empty((0,))

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        return (None,) * (1 + ctx.count)


class _Frame:
    """A checkpointed call: its function, its inputs and weak references to its slots in the order saved."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict) -> None:
        self.fn, self.kwargs, self.args = fn, kwargs, tuple(_TENSOR if isinstance(a, torch.Tensor) else a for a in args)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self.grads = [a.requires_grad for a in tensors]
        # the inputs are autograd saved tensors, as torch's checkpoint keeps them: a count of saved bytes sees them
        # and the node's (empty) output is held: on torch 2.9 ``grad_fn`` of a custom function is its context, which
        # loses the node and the saved tensors once the output is freed (the rerun then failed at the first read)
        self.held = _SaveInputs.apply(torch.empty((0,), requires_grad=True), *tensors)
        self.saver = self.held.grad_fn
        self.slots: list[weakref.ref] = []
        self.metas: list[tuple] = []  # each saved tensor's shape, dtype and device, for the rerun's to match
        devices = {"cpu"} | {a.device.type for a in args if isinstance(a, torch.Tensor)}
        self.autocast = [(d, torch.get_autocast_dtype(d)) for d in sorted(devices) if torch.is_autocast_enabled(d)]

    def _inputs(self) -> tuple:
        """The call's arguments, tensors detached with ``requires_grad`` as given (the rerun saves what the forward
        saved)."""
        tensors = iter(t.detach().requires_grad_(g) for t, g in zip(self.saver.saved_tensors, self.grads))
        return tuple(next(tensors) if a is _TENSOR else a for a in self.args)

    def pack(self, tensor: torch.Tensor) -> _Saved:
        slot = _Saved(self, len(self.slots))
        self.slots.append(weakref.ref(slot))
        self.metas.append(_meta(tensor))
        return slot

    def _check(self, index: int, tensor: torch.Tensor) -> None:
        """Raise unless the rerun's ``index``-th saved tensor matches the forward's in shape, dtype and device."""
        if index >= len(self.metas):
            raise torch.utils.checkpoint.CheckpointError(
                f"recomputation saved more than the {len(self.metas)} tensors the forward saved: a checkpointed "
                f"function must save the same tensors when run again")
        if _meta(tensor) != self.metas[index]:
            raise torch.utils.checkpoint.CheckpointError(
                f"recomputation saved tensor {index} with {_describe(_meta(tensor))} where the forward saved "
                f"{_describe(self.metas[index])}: a checkpointed function must save the same tensors when run again")

    def recompute(self, refill_done: bool) -> None:
        """Rerun the forward once; fill each live empty slot (those read and done as well if ``refill_done``)."""
        want = {}
        for i, ref in enumerate(self.slots):
            slot = ref()
            if slot is not None and slot.value is None and (refill_done or not slot.done):
                want[i] = slot
        seen = [0]

        def pack(t: torch.Tensor) -> None:
            self._check(seen[0], t)
            slot = want.get(seen[0])
            seen[0] += 1
            if slot is not None:
                slot.value = t.detach()

        def unpack(_):
            raise RuntimeError("a recomputed forward's own graph is never run backward")

        with contextlib.ExitStack() as stack:  # the forward's autocast state (backward runs outside it)
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            stack.enter_context(torch.enable_grad())
            self.fn(*self._inputs(), **self.kwargs)
        if seen[0] != len(self.slots):
            raise torch.utils.checkpoint.CheckpointError(
                f"recomputation saved {seen[0]} tensors where the forward saved {len(self.slots)}: "
                f"a checkpointed function must save the same tensors when run again")


def _unpack(slot: _Saved) -> torch.Tensor:
    task = _graph_task()
    if task is not None and slot.task == task:  # before any rerun: it would run the layer (collectives) again
        raise torch.utils.checkpoint.CheckpointError(
            "a recomputed saved tensor was read twice in one backward pass (e.g. ctx.saved_tensors read twice in a "
            "custom autograd Function's backward): read it once and keep the value")
    slot.task = task
    if slot.value is None:
        slot.frame.recompute(refill_done=slot.done)
    value = slot.value
    if not split_backward.keeps_saved(_autograd_node()):
        slot.value = None  # the last read of this slot, unless W reads it again
        slot.done = split_backward.splitting()  # read in B off the weight boundaries: W never reads it
    return value


def checkpoint(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` keeping none of the tensors it saves for backward; the first backward read reruns
    ``fn`` on the same inputs (the caller replays its random state) and every backward pass shares that rerun."""
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack):
        return fn(*args, **kwargs)
