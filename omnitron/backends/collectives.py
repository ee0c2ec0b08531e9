"""A thin layer over ``torch.distributed`` that owns the process-group backend and its dtype gaps.

Every collective the engine issues goes through :class:`Collectives`, so a backend whose
transport lacks a dtype (gloo has no float8; MCCL has) is handled in one place:
reductions up-cast, data movement travels as a same-size ``uint8`` view. Each call is also
recorded in the flight recorder and, with ``OMNITRON_STRICT_COLLECTIVES=1``, checked against
the other members of its group (``backends/flight.py``; :func:`flight_recorder_dump` reads it).
"""
from __future__ import annotations

import datetime
import functools
import gc
import inspect
import math
import os
from typing import Sequence

import torch
import torch.distributed as dist

from omnitron.backends import flight, group_agreement
from omnitron.backends.flight import flight_recorder_dump, strict_enabled  # noqa: F401 - the public API

ReduceOp = dist.ReduceOp
# torch >= 2.13 renames the tensor-form collectives; both spellings do the same work
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


_NO_BACKEND = "No backend type associated with device type "


def _device_checked(method):
    """Turn torch's "No backend type associated with device type X" (a tensor on a device ``group`` has no
    backend for: a host tensor on an NCCL / simccl group, or the reverse) into one line that names the
    operation, the group's backend and the fix. Only a raised error is inspected: no check per call."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as err:
            if _NO_BACKEND not in str(err):
                raise
            got = str(err).split(_NO_BACKEND, 1)[1].split()[0]
            bound = inspect.signature(method).bind(self, *args, **kwargs)  # the group, however it was passed
            group = bound.arguments.get("group")
            raise ValueError(f"{method.__name__}: a {got!r} tensor on a {dist.get_backend(group)!r} process group, "
                             f"which has no {got!r} transport: move the tensor to the device the group serves "
                             f"(the job's groups: backend.device(); ParallelGroups.build(..., backend=be) gives "
                             f"modules that device)") from err
    return call


class _Handle:
    """Async handle that finishes a dtype round-trip (view or cast back) after ``wait``.

    In strict mode ``wait`` is bounded by the strict timeout (``flight.timed_wait``)."""

    def __init__(self, work, finish=None, group=None, what: str = "") -> None:
        self._work, self._finish, self._group, self._what = work, finish, group, what

    def wait(self) -> None:
        if self._work is not None:
            if strict_enabled():
                flight.timed_wait(self._work, lambda: [self._what], self._group)
            else:
                self._work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def watchdog_env(prefix: str, trace_entries: int = 2000) -> dict[str, str]:
    """Settings for a device library whose process group is a port of torch's ProcessGroupNCCL (its variables
    are ``<prefix>TRACE_BUFFER_SIZE``, ...): keep a flight-recorder ring of ``trace_entries`` events (the
    library's own recorder is off while this is 0), dump it when a collective times out (which needs the
    monitor thread on), and tear the process down on an asynchronous error (3: without clean-up, which can
    hang). The settings that depend on the job are :func:`job_watchdog_env`'s."""
    return {f"{prefix}TRACE_BUFFER_SIZE": str(trace_entries), f"{prefix}DUMP_ON_TIMEOUT": "1",
            f"{prefix}ENABLE_MONITORING": "1", f"{prefix}ASYNC_ERROR_HANDLING": "3"}


HEARTBEAT_DEFAULT_S = 480
"""ProcessGroupNCCL's heartbeat timeout when ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` is unset (8 minutes)."""
HEARTBEAT_MARGIN_S = 60
"""How much later than the job's collective timeout the library's monitor may abort the process."""


def job_watchdog_env(prefix: str, timeout_s: float, nan_check: bool) -> dict[str, str]:
    """The settings of a ProcessGroupNCCL port that follow the job. The library's monitor thread aborts the
    process, with its own terse message, when its watchdog thread has not beaten for
    ``<prefix>HEARTBEAT_TIMEOUT_SEC``; omnitron's watchdog must speak first, so the heartbeat timeout is the
    job's collective timeout plus a margin (never below the library's default). ``nan_check`` (strict mode,
    a debugging run) turns on ``<prefix>NAN_CHECK``: every collective's input is checked for NaN on the
    device, which names the first collective that carries one at the cost of a kernel per call."""
    heartbeat = max(HEARTBEAT_DEFAULT_S, math.ceil(timeout_s) + HEARTBEAT_MARGIN_S)
    env = {f"{prefix}HEARTBEAT_TIMEOUT_SEC": str(heartbeat)}
    if nan_check:
        env[f"{prefix}NAN_CHECK"] = "1"
    return env


class Collectives:
    """Collectives over the process-group backend ``dist_backend``.

    ``fp8_native`` says whether the transport carries float8; when False, float8 tensors are
    sent as ``uint8`` views and reduced in float32. ``device_type`` is where tensors of calls that
    carry none (barrier, gather_object) live for the strict check: a device library such as NCCL
    takes no host tensors. ``env``: environment variables the library reads when a process group is
    created (:func:`watchdog_env`), set before the first one unless the user set them; ``env_prefix``: the
    library's variable prefix, for the settings that follow the job (:func:`job_watchdog_env`).
    ``p2p_groups_in_order``: the library runs a communicator's ``batch_isend_irecv`` groups one after another,
    each until all its operations ran (the device libraries); strict mode then posts each batch as one group
    (``flight._fused_batch``), where a host transport (gloo) gets each payload receive checked before it is posted.
    """

    def __init__(self, dist_backend: str, fp8_native: bool = False, device_type: str = "cpu",
                 env: dict[str, str] | None = None, env_prefix: str | None = None,
                 p2p_groups_in_order: bool = False) -> None:
        self.dist_backend, self.p2p_groups_in_order = dist_backend, p2p_groups_in_order
        self.fp8_native = fp8_native
        self.device_type = device_type
        self.env = dict(env or {})
        self.env_prefix = env_prefix

    def prepare_env(self, timeout_s: float | None = None) -> dict[str, str]:
        """Set ``env`` (and, given the job's collective ``timeout_s`` and an ``env_prefix``, the settings
        that follow the job) in ``os.environ`` where the user has not; returns the values now in effect."""
        env = dict(self.env)
        if self.env_prefix is not None and timeout_s is not None:
            env.update(job_watchdog_env(self.env_prefix, timeout_s, nan_check=strict_enabled()))
        for name, value in env.items():
            os.environ.setdefault(name, value)
        return {name: os.environ[name] for name in env}

    def _no_tensor(self, group=None) -> torch.Tensor:
        """An empty tensor for the records and checks of tensor-less calls on ``group``: on the device, or on
        the host for a host group (:meth:`new_host_group`: gloo takes no sim or MUSA tensor, so strict mode's
        fingerprint exchange of a background writer's barrier would fail there)."""
        host = dist.is_initialized() and dist.distributed_c10d._get_object_coll_device(group) == "cpu"
        return torch.zeros(0, device="cpu" if host else self.device_type)

    # ---- process groups -----------------------------------------------------------------
    def init_process_group(self, rank: int | None = None, world_size: int | None = None,
                           init_method: str | None = None, timeout_s: float = 300.0, store=None,
                           group_deadline_s: float | None = None) -> None:
        """Join the default process group (env:// unless ``init_method`` or a rendezvous ``store`` is given;
        ``timeout_s``: how long a collective may wait, on every group; ``group_deadline_s``: how long a rank
        waits for the others at a group's creation, default ``timeout_s`` (:mod:`group_agreement`))."""
        if dist.is_initialized():
            return
        self.prepare_env(timeout_s)
        kwargs = {}
        if rank is not None:
            kwargs.update(rank=rank, world_size=world_size)
        if store is not None:
            kwargs["store"] = store
        else:
            kwargs["init_method"] = init_method or "env://"
        dist.init_process_group(self.dist_backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        group_agreement.set_limits(timeout_s, group_deadline_s)

    def new_groups(self, specs: Sequence[tuple[str, Sequence[int]]], host: bool = False) -> list:
        """One subgroup per ``(name, ranks)`` of ``specs``, every process calling this with the same ``specs``;
        ``host``: gloo groups (:meth:`new_host_group`). First the ranks agree on ``specs`` through the store, with
        the job's deadline (:func:`group_agreement.agree`: a rank that does not come, or comes with other groups,
        stops every rank in one line naming them); each group gets the job's timeout, not torch's default."""
        group_agreement.agree(specs)
        backend = "gloo" if host else self.dist_backend
        return [dist.new_group(list(ranks), backend=backend, timeout=group_agreement.timeout()) for _, ranks in specs]

    def new_group(self, ranks: Sequence[int], name: str = "group"):
        """A subgroup over ``ranks`` (every process calls this with the same ranks, in order): :meth:`new_groups`."""
        return self.new_groups([(name, ranks)])[0]

    def new_host_group(self, ranks: Sequence[int], name: str = "host group"):
        """A subgroup over ``ranks`` whose collectives run on host tensors (gloo) and never touch the device's
        communicator: the group for collectives issued from a background thread. A device communicator
        used from two threads at once deadlocks when ranks order the threads' collectives differently
        (NCCL runs one at a time per device); a host group has no such order to agree on."""
        return self.new_groups([(name, ranks)], host=True)[0]

    @staticmethod
    def is_initialized() -> bool:
        return dist.is_available() and dist.is_initialized()

    @staticmethod
    def rank(group=None) -> int:
        return dist.get_rank(group) if dist.is_initialized() else 0

    @staticmethod
    def world_size(group=None) -> int:
        return dist.get_world_size(group) if dist.is_initialized() else 1

    @staticmethod
    def global_rank(group, group_rank: int) -> int:
        """The world rank of ``group_rank`` inside ``group``."""
        return dist.get_global_rank(group, group_rank)

    def destroy(self) -> None:
        """Destroy every process group and free the group objects now, while the interpreter is whole: a gloo
        group's worker threads are joined only when its object goes (:func:`flight.release_groups`)."""
        if dist.is_initialized():
            dist.destroy_process_group()
            flight.release_groups()
            group_agreement.release_groups()
            gc.collect()  # groups held in reference cycles (closures, parallel-group records) go too

    @staticmethod
    def flight_recorder_size() -> int:
        """How many calls the flight recorder keeps (``OMNITRON_FLIGHT_RECORDER_SIZE``)."""
        return flight.RECORDER.entries.maxlen

    # ---- dtype gaps ---------------------------------------------------------------------
    def _is_fp8_gap(self, t: torch.Tensor) -> bool:
        return (not self.fp8_native) and t.dtype in FP8_DTYPES

    # ---- the one entry point: record, and in strict mode check ---------------------------
    @staticmethod
    def _enter(op: str, tensor: torch.Tensor, group, extra: str = "", shape=None) -> None:
        """Record ``op`` in the flight recorder; in strict mode check the group agrees on it."""
        strict = strict_enabled()
        if not (strict or flight.RECORDER.on):
            return
        site = flight.call_site()
        shape = tuple(tensor.shape) if shape is None else shape
        flight.RECORDER.record(op, group, shape, tensor.dtype, extra, site)
        if strict and dist.is_initialized():
            flight.check_collective(op, flight.fingerprint(shape, tensor.dtype, extra), group, site, tensor.device)

    # ---- reductions ---------------------------------------------------------------------
    @_device_checked
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
        """In-place all-reduce of ``tensor`` over ``group``."""
        self._enter("all_reduce", tensor, group, f"op={op}")
        if self._is_fp8_gap(tensor):
            wide = tensor.float()
            work = dist.all_reduce(wide, op=op, group=group, async_op=async_op)
            return self._done(work, lambda: tensor.copy_(wide), async_op)
        return self._done(dist.all_reduce(tensor, op=op, group=group, async_op=async_op), None, async_op)

    @_device_checked
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                       async_op: bool = False):
        """``output`` (1/n of ``input`` along dim 0) receives the reduced shard of this rank."""
        self._enter("reduce_scatter", input, group, f"op={op}")
        if self._is_fp8_gap(input):
            wide_out, wide_in = output.float(), input.float()
            work = _reduce_scatter_tensor(wide_out, wide_in, op=op, group=group, async_op=async_op)
            return self._done(work, lambda: output.copy_(wide_out), async_op)
        work = _reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        return self._done(work, None, async_op)

    # ---- data movement ------------------------------------------------------------------
    def _wire(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if self._is_fp8_gap(t) else t

    @_device_checked
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
        """Concatenate every rank's ``input`` along dim 0 into ``output``."""
        self._enter("all_gather", input, group)
        work = _all_gather_tensor(self._wire(output), self._wire(input.contiguous()), group=group,
                                           async_op=async_op)
        return self._done(work, None, async_op)

    def all_gather_in_place(self, buffer: torch.Tensor, group=None, async_op: bool = False):
        """All-gather inside one flat ``buffer`` of ``n x k`` elements (``n`` ranks in ``group``): on entry
        slice ``rank`` (elements ``[rank*k, (rank+1)*k)``) holds this rank's part, on return every slice holds
        its rank's. No temporary: the input is that slice of the output (NCCL's documented in-place form;
        gloo and MCCL accept it too, checked by tests/optim/test_overlap_param_gather.py)."""
        n = self.world_size(group)
        if buffer.numel() % n:
            raise ValueError(f"in-place all-gather of {buffer.numel()} elements over {n} ranks: pad the buffer "
                             f"to a multiple of the group size")
        k, r = buffer.numel() // n, self.rank(group)
        return self.all_gather(buffer, buffer[r * k:(r + 1) * k], group=group, async_op=async_op)

    @_device_checked
    def all_gather_list(self, outputs: list[torch.Tensor], input: torch.Tensor, group=None):
        """Gather tensors of possibly different shapes (one per rank) into ``outputs``.

        Equal shapes go straight through; otherwise every rank pads its flattened input to the
        largest size (gloo requires equal sizes) and each output takes its own prefix.
        """
        self._enter("all_gather_list", input, group, f"outputs={[tuple(o.shape) for o in outputs]}", shape=("*",))
        if all(o.shape == input.shape for o in outputs):
            dist.all_gather([self._wire(o) for o in outputs], self._wire(input.contiguous()), group=group)
            return
        size = max(o.numel() for o in outputs)
        flat = input.reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(size - flat.numel())]) if flat.numel() < size else flat
        bufs = [torch.empty_like(padded) for _ in outputs]
        dist.all_gather([self._wire(b) for b in bufs], self._wire(padded.contiguous()), group=group)
        for o, b in zip(outputs, bufs):
            o.copy_(b[: o.numel()].view(o.shape))

    @_device_checked
    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
        """Broadcast from world rank ``src``."""
        self._enter("broadcast", tensor, group, f"src={src}")
        return self._done(dist.broadcast(self._wire(tensor), src=src, group=group, async_op=async_op),
                          None, async_op)

    @_device_checked
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                   input_split_sizes=None, group=None, async_op: bool = False):
        """Exchange dim-0 splits of ``input`` with every rank of ``group``."""
        self._enter("all_to_all", input, group, shape=("*",) + tuple(input.shape[1:]))  # splits differ per rank
        work = dist.all_to_all_single(self._wire(output), self._wire(input.contiguous()), output_split_sizes,
                                      input_split_sizes, group=group, async_op=async_op)
        return self._done(work, None, async_op)

    def send(self, tensor: torch.Tensor, dst: int, group=None) -> None:
        """Blocking send to world rank ``dst`` (a one-op batch: the same NCCL-order rules apply)."""
        for h in self.batch_p2p([("send", tensor, dst)], group=group):
            h.wait()

    def recv(self, tensor: torch.Tensor, src: int, group=None) -> None:
        """Blocking receive from world rank ``src`` into ``tensor``."""
        for h in self.batch_p2p([("recv", tensor, src)], group=group):
            h.wait()

    @_device_checked
    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]], group=None) -> list:
        """Issue ``("send"|"recv", tensor, peer_world_rank)`` operations as one group; returns handles to wait.

        One call is one NCCL group: under NCCL (and here in strict mode) a rank's batches on one
        communicator complete in the order posted, so a schedule must put each send in a batch
        that its peer posts with the matching receive before any batch that waits on the peer.
        """
        if not ops:
            return []
        site = flight.call_site() if flight.RECORDER.on or strict_enabled() else None
        for kind, tensor, peer in ops if flight.RECORDER.on else ():
            flight.RECORDER.record(kind, group, tuple(tensor.shape), tensor.dtype, f"peer={peer}", site)
        ops = [(k, t.contiguous() if k == "send" else t, peer) for k, t, peer in ops]
        wired = [(k, t, self._wire(t), peer) for k, t, peer in ops]
        if strict_enabled():
            return flight.strict_batch_p2p(wired, group, site, fused=self.p2p_groups_in_order)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if k == "send" else dist.irecv, w, peer, group)
                                        for k, _, w, peer in wired])
        if len(works) == 1:  # a coalescing backend (NCCL, simccl) returns one work for the batch: one per op here
            works = works * len(wired)
        return [_Handle(w) for w in works]

    def gather_object(self, obj, dst: int = 0, group=None) -> list | None:
        """Gather one picklable ``obj`` per rank on world rank ``dst`` (``None`` elsewhere).

        NOTE: the payload is unpickled on ``dst``: use only between ranks of one job, never for
        data from outside it."""
        self._enter("gather_object", self._no_tensor(group), group, f"dst={dst}")
        n = self.world_size(group)
        parts = [None] * n if self.rank() == dst else None
        dist.gather_object(obj, parts, dst=dst, group=group)
        return parts

    def barrier(self, group=None) -> None:
        """Wait for every member of ``group`` (checked like any collective in strict mode)."""
        if dist.is_initialized():
            self._enter("barrier", self._no_tensor(group), group)
            dist.barrier(group=group)

    @staticmethod
    def _done(work, finish, async_op: bool):
        if async_op:
            return _Handle(work, finish)
        if finish is not None:
            finish()
        return None


def default_master_env(port: int | None = None) -> None:
    """Fill MASTER_ADDR/MASTER_PORT for single-machine launches that did not set them."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if port is not None:
        os.environ.setdefault("MASTER_PORT", str(port))
