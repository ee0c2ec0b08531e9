"""DistributedDataParallel: bucketed, optionally overlapped gradient reduction over ``groups.dp_cp``.

``param.main_grad`` is a view into a contiguous buffer (float32 with
``accumulate_allreduce_grads_in_fp32``, float64 for a float64 parameter, else the parameter's dtype). A
post-accumulate hook moves each ``.grad`` into ``main_grad`` (and frees ``.grad``); on the last micro-batch, with
``overlap_grad_reduce``, it marks the parameter ready and starts the bucket's asynchronous
reduction as soon as every parameter of the bucket is ready. ``finish_grad_sync`` starts what is
left and waits. Gradients are pre-divided by dp x cp, then summed: the result is the mean over
replicas, as one process on the whole global batch would compute it. ``reduce_over_dp = False`` (1-bit
Adam's compressed stage) skips both: ``main_grad`` keeps this rank's own gradient.

For the distributed optimizer (``use_distributed_optimizer``) the parameters move into flat buffers
laid out like the gradient buckets (``param.data`` is a view), so updated shards are all-gathered in
place; with ``overlap_param_gather`` forward pre-hooks wait for a bucket's pending gather just before
the first module using one of its parameters runs (a compiled or captured layer as one module, outside its graph).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from omnitron.core.graph_state import is_region
from omnitron.core.parallel.data.buffers import Bucket, GradBuffer
from omnitron.core.parallel.data.config import DataParallelConfig, bucket_elements
from omnitron.core.parallel.data.wrapper import ChunkWrapper


class DistributedDataParallel(ChunkWrapper):
    """Wrap one model chunk; ``forward`` is the chunk's. Unknown attributes fall through to it."""

    def __init__(self, module: torch.nn.Module, groups, config: DataParallelConfig | None = None,
                 collectives=None, *, bucketing: bool = True) -> None:
        """``bucketing`` False: one bucket per buffer (Megatron's ``disable_bucketing``: a model chunk after the
        first, a pipeline stage after the first; :func:`~omnitron.core.parallel.data.config.bucket_elements`)."""
        super().__init__(module)
        self.config = config or DataParallelConfig()
        self.group = groups.dp_cp
        self._expert_group = groups.edp
        self.coll = collectives or groups.collectives  # None: a one-process layout, nothing to reduce
        self.is_last_microbatch = True
        self.reduce_over_dp = True
        """False: leave each rank's local gradient in ``main_grad`` (no pre-division, no collective): 1-bit
        Adam's compressed stage, which averages the momentum instead (set by the step, from the optimizer)."""
        size = self.group.size
        bucket_size = bucket_elements(self.config, size, bucketing=bucketing)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # backward order
        by_dtype: dict[tuple, list] = {}
        for p in params:
            # NOTE: "in fp32" widens bf16 / fp16 only: a float64 model's gradients stay float64
            dt = torch.promote_types(p.dtype, torch.float32) if self.config.accumulate_allreduce_grads_in_fp32 \
                else p.dtype
            # NOTE: the distributed optimizer's flat parameter buffers need one parameter dtype per buffer
            pdt = p.dtype if self.config.use_distributed_optimizer else None
            by_dtype.setdefault((dt, _is_expert(p), pdt), []).append(p)
        self.reduce_scatter = self.config.reduce_scatter or self.config.use_distributed_optimizer
        # NOTE: with reduce-scatter the tied embedding's copies need identical shards (see buffers.py)
        shared = getattr(module, "shared_embedding_parameters", None)
        isolate = frozenset(id(p) for p in shared()) if self.reduce_scatter and shared is not None else frozenset()
        # NOTE: MoE expert parameters (``p.expert``) are replicated over groups.edp only: they get buffers
        # of their own, pre-divided by dp x cp like the rest (each rank's tokens are a 1/(dp x cp) share of
        # the batch) and summed over edp
        self.buffer_groups = [groups.edp if ex else self.group for _, ex, _ in by_dtype]
        self.buffers = [GradBuffer(ps, dt, bucket_size, g.size, isolate, sharded=self.reduce_scatter)
                        for ((dt, _, _), ps), g in zip(by_dtype.items(), self.buffer_groups)]
        self._group_of = {id(b): g for buf, g in zip(self.buffers, self.buffer_groups) for b in buf.buckets}
        # NOTE: an expert that got no tokens on this rank gets no gradient (its hooks never fire) while its edp
        # peers' copies do, so expert buckets would become ready in a different order per rank: they are
        # reduced in finish_grad_sync, in bucket order, never early
        self._late = {id(b) for buf, (_, ex, _) in zip(self.buffers, by_dtype) if ex for b in buf.buckets}
        self._bucket_of = {k: v for buf in self.buffers for k, v in buf.bucket_of.items()}
        self._hooks = [p.register_post_accumulate_grad_hook(_weak_hook(self)) for p in params]
        if self.config.use_distributed_optimizer:  # params become views of flat buffers (in-place all-gather)
            for buf in self.buffers:
                buf.allocate_param_buffer()
        if self.config.overlap_param_gather:
            self._hooks += _param_gather_hooks(module, self._bucket_of)
        self.broadcast_params()

    @property
    def buckets(self) -> list[Bucket]:
        return [b for buf in self.buffers for b in buf.buckets]

    # ---- hooks and synchronisation ---------------------------------------------------------
    def _hook(self, param: torch.nn.Parameter) -> None:
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.config.overlap_grad_reduce and self.is_last_microbatch and self.group.size > 1:
            bucket = self._bucket_of[id(param)]
            if id(bucket) in self._late:
                return
            if bucket.launched:
                raise RuntimeError(f"a gradient of shape {tuple(param.shape)} arrived after its bucket's reduction "
                                   f"started; the parameter is used twice in one micro-batch's backward")
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params):
                self._launch(bucket, async_op=True)

    def _launch(self, bucket: Bucket, async_op: bool) -> None:
        bucket.launched = True
        if not self.reduce_over_dp:
            return
        group = self._group_of[id(bucket)]  # dp x cp, or edp for expert buckets
        if self.group.size > 1:
            bucket.data.mul_(1.0 / self.group.size)
        if group.size == 1:
            return
        if self.reduce_scatter:
            out = torch.empty_like(bucket.shard(0))
            handle = self.coll.reduce_scatter(out, bucket.data, group=group.handle, async_op=True)
            bucket.handle = _ShardCopy(handle, out, bucket.shard(group.rank))
        else:
            bucket.handle = self.coll.all_reduce(bucket.data, group=group.handle, async_op=True)
        if not async_op:
            bucket.handle.wait()
            bucket.handle = None

    def start_grad_sync(self) -> None:
        """Start the reduction of every bucket not yet started."""
        for b in self.buckets:
            if not b.launched:
                self._launch(b, async_op=True)

    def finish_grad_sync(self) -> None:
        """Start what is left and wait for every bucket's reduction."""
        self.start_grad_sync()
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            b.reset()

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (``--overlap-param-gather``): before reading the
        parameters outside a forward (checkpoint save, inspection)."""
        for b in self.buckets:
            b.wait_param_gather()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (call before each step's first micro-batch)."""
        for buf in self.buffers:
            buf.zero()
        for p in self.module.parameters():
            p.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without starting reductions (micro-batches before the last)."""
        prev, self.is_last_microbatch = self.is_last_microbatch, False
        try:
            yield
        finally:
            self.is_last_microbatch = prev

    def broadcast_params(self) -> None:
        """Make every replica start from data-parallel rank 0's parameters (expert-data-parallel rank 0's
        for expert parameters)."""
        for p in self.module.parameters():
            group = self._expert_group if _is_expert(p) else self.group
            if group.size > 1:
                with torch.no_grad():
                    self.coll.broadcast(p.data, src=group.global_rank(0), group=group.handle)


class _ShardCopy:
    """Wait for a reduce-scatter into a temporary, then copy the shard into the bucket."""

    def __init__(self, handle, out: torch.Tensor, dst: torch.Tensor) -> None:
        self.handle, self.out, self.dst = handle, out, dst

    def wait(self) -> None:
        self.handle.wait()
        self.dst.copy_(self.out)


def _param_gather_hooks(module: torch.nn.Module, bucket_of: dict[int, Bucket]) -> list:
    """Forward pre-hooks that wait, before a module runs, for the pending all-gathers of the buckets holding its
    parameters. The first module to touch a bucket waits; later ones (and later micro-batches) find no handle left.

    Eager code: one on every submodule that owns parameters directly. A graph region (a compiled or captured
    transformer layer, :func:`omnitron.core.graph_state.is_region`): one on the region for every parameter under
    it and none inside, so the waits run eagerly just before its graph (a wait inside would break a compiled graph
    and be skipped by a replayed one) and a layer still waits for its own buckets only, the later layers' gathers
    overlapping it. Prepended: another pre-hook that reads the parameters (the FP8 weight refresh of a region,
    :mod:`omnitron.core.precision.fp8.static_weights`) runs after the wait, whenever it was registered."""
    hooks, inside = [], set()
    for m in module.modules():  # pre-order: a region comes before what it holds
        if id(m) in inside:
            continue
        region = is_region(m)
        if region:
            inside.update(id(s) for s in m.modules())
        buckets = list({id(b): b for p in m.parameters(recurse=region) if (b := bucket_of.get(id(p)))}.values())
        if buckets:
            hooks.append(m.register_forward_pre_hook(_waiter(buckets), prepend=True))
    return hooks


def _waiter(buckets: list[Bucket]):
    def hook(_module, _args) -> None:
        for b in buckets:
            b.wait_param_gather()
    return hook


def _is_expert(p: torch.nn.Parameter) -> bool:
    """An MoE expert parameter (replicated over groups.edp, not over data parallelism)."""
    return bool(getattr(p, "expert", False))


def _weak_hook(ddp: DistributedDataParallel):
    """The gradient hook of ``ddp`` for its parameters, holding ``ddp`` weakly. NOTE: a hook holding the wrapper
    made a cycle through the parameters (parameter -> hook -> wrapper -> module -> parameter) that the garbage
    collector does not free (torch's tensors hide such references), so the wrapper and its process groups lived
    until the interpreter's finalization: a gloo group's worker threads with them, one of which could still be
    dropping a finished all-reduce's tensors (it takes the GIL) and died in ``pthread_exit`` inside a destructor,
    "terminate called without an active exception", SIGABRT after the rank's work was done."""
    ref = weakref.ref(ddp)

    def hook(param: torch.nn.Parameter) -> None:
        wrapper = ref()
        if wrapper is not None:
            wrapper._hook(param)

    return hook
