"""Distributed optimizer (ZeRO-1, Megatron's ``--use-distributed-optimizer``).

The fp32 master weights and the optimizer states are sharded over the ranks that hold replicas of
the parameters: dense parameters over the data x context parallel group (``groups.dp_cp``), MoE
expert parameters (``param.expert``) over the expert-data-parallel group (``groups.edp``). The
shard layout is the data-parallel wrapper's: every bucket of every gradient buffer is cut into as
many equal contiguous slices as its group has ranks (``Bucket.shard``) and group rank ``r`` owns
slice ``r`` of each. The wrapper reduce-scatters each bucket over its group (overlapped with
backward when asked), so after ``finalize_model_grads`` this rank's slices hold the averaged
gradients; the step unscales, checks for inf, clips by the global norm and updates only the owned
slices, then all-gathers each bucket's updated parameters (in the model's dtype) over its group.

The wrapper keeps the parameters in flat buffers laid out like the gradient buckets
(``GradBuffer.allocate_param_buffer``), so the step writes its slices into the model's own storage and
each bucket's all-gather runs in place: no temporary copy of any parameter. With
``--overlap-param-gather`` the gathers are left pending (the first layers' bucket launched first) and
each is waited on by the forward pre-hook of the first module using one of its parameters.

A parameter may straddle two ranks' slices; each rank then holds the part it owns (one
contiguous element range of the flattened parameter), so weight decay (never on 1-D params or
biases) is decided per parameter and applies to each range of it.

Checkpoints use :class:`MixedPrecisionOptimizer`'s format exactly (per parameter name, tensors
at the parameter's local tp-sharded shape): ``state_dict`` all-gathers the slices and
``load_state_dict`` takes its own slice, so either optimizer, at any data-parallel size, resumes
from either's checkpoint. The training checkpoint writes each entry once per replica group
(``omnitron.core.training.checkpointing``: data x context parallel rank 0, edp rank 0 for experts).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim.moments import state_dtype
from omnitron.core.optim.optimizer import (MixedPrecisionOptimizer, ShardedOverDataParallel, _decays, _decoupled,
                                           keeps_master, master_dtype)
from omnitron.core.parallel.data.ddp import DistributedDataParallel


@dataclass
class _Slice:
    """The part of one parameter this rank owns: flattened elements ``[lo, hi)``."""

    param: int
    """Index into ``optimizer.params``."""
    lo: int
    hi: int
    grad: torch.Tensor
    """The owned gradient elements, a view into the wrapper's buffer."""


@dataclass
class _BucketPlan:
    """How to rebuild a bucket's full contents from every rank's slice."""

    size: int
    """Elements in the (padded) bucket."""
    group: object
    """The group the bucket is sharded over (``dp_cp``, or ``edp`` for expert buckets)."""
    shard_start: int
    """Where this rank's slice starts, relative to the bucket."""
    slices: list[tuple[int, int]]
    """(slice index, offset relative to the bucket) of the owned slices in this bucket."""
    params: list[tuple[int, int]]
    """(param index, offset relative to the bucket) of every parameter in the bucket."""
    bucket: object
    """The wrapper's bucket (its ``param_data`` is gathered in place)."""
    chunk: int
    """Index of the model chunk the bucket belongs to (gathers launch in forward order)."""
    overlap: bool
    """--overlap-param-gather: leave the gather pending for the forward pre-hooks."""


class DistributedOptimizer(ShardedOverDataParallel, MixedPrecisionOptimizer):
    """:class:`MixedPrecisionOptimizer` with masters and states for this rank's slices only.

    ``chunks``: this rank's model chunks wrapped in ``DistributedDataParallel`` (their gradient
    buffers define the slices); every optimized parameter must live in one of their buffers, cut
    into as many shards as the buffer's group (``dp_cp``, or ``edp`` for experts) has ranks.
    ``masters``, ``state`` and ``decay`` are per owned slice.
    """

    def __init__(self, named_params, config: OptimizerConfig, groups, *, backend, chunks, loss_scaler=None,
                 duplicates=()) -> None:
        self.chunks = list(chunks)
        super().__init__(named_params, config, groups, backend=backend, loss_scaler=loss_scaler,
                         duplicates=duplicates)
        self.copy_timer = "params-all-gather"

    def _build_masters(self) -> None:
        """Masters, decay flags (and, through them, states) for this rank's slices only."""
        self.slices, self.plans = _plan_slices(self.params, self.chunks)
        qk = self.config.apply_wd_to_qk_layernorm
        self.decay = [_decays(self.names[s.param], self.params[s.param], qk) for s in self.slices]
        self.decoupled = [_decoupled(self.params[s.param]) for s in self.slices]
        self.masters = []
        for s in self.slices:
            # fp32 parameters (and bf16 ones with remainders) are their own masters: a view, the update lands in
            # the model directly; other low-precision parameters: an fp32 copy (the only one)
            self._add_master(self.params[s.param].detach().view(-1)[s.lo:s.hi])

    # ---- the step's pieces (MixedPrecisionOptimizer.step calls them) -----------------------
    def _fp32_grads(self) -> list[torch.Tensor]:
        """The owned slices' gradients in their masters' dtype (fp32; float64 for a float64 model) -- or, for the
        precision-aware step (moments below fp32 or master remainders), as the buffers hold them: TE's kernel reads
        bf16 main grads (--main-grads-dtype bf16) as they are, and Megatron unscales and clips them in place, so an
        fp32 copy of every slice (4 bytes an owned element, kept between steps) would only cost memory. A rank owning
        no element (a tiny model over many ranks) gets one empty gradient on the backend's device, so its step's list
        ops and collectives still run."""
        keep = self._steps_low()
        grads = [s.grad if s.grad.dtype == master_dtype(m.dtype) or keep else self._scratch(i, m).copy_(s.grad)
                 for i, (s, m) in enumerate(zip(self.slices, self.masters))]
        return grads or [torch.zeros(0, device=self.backend.current_device())]

    def _owners(self) -> list[torch.nn.Parameter]:
        return [self.params[s.param] for s in self.slices]

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        """Write the updated slices into the flat parameter buffers, then all-gather every bucket in place.

        Buckets are in backward order, so each chunk's are launched last-first: the next forward needs the
        first layers first. Without --overlap-param-gather every gather is waited on here."""
        self.finish_param_gather()  # a gather still pending from the previous step (no forward in between)
        for s, m in zip(self.slices, self.masters):
            flat = self.params[s.param].detach().view(-1)[s.lo:s.hi]
            if flat.data_ptr() != m.data_ptr():  # fp32 / float64 parameters (and remainders') are their own masters
                flat.copy_(m)
        self._gather_params()

    def _gather_params(self) -> None:
        """All-gather every bucket's parameters in place (waited on here unless --overlap-param-gather)."""
        order = sorted(range(len(self.plans)), key=lambda k: (self.plans[k].chunk, -k))
        for k in order:
            plan = self.plans[k]
            if plan.group.handle is not None:
                plan.bucket.param_handle = self.backend.collectives.all_gather_in_place(
                    plan.bucket.param_data, group=plan.group.handle, async_op=True)
        for plan in self.plans:
            if not plan.overlap:
                plan.bucket.wait_param_gather()

    def finish_param_gather(self) -> None:
        """Wait for every pending parameter all-gather (the parameters are then current everywhere)."""
        for plan in self.plans:
            plan.bucket.wait_param_gather()

    @torch.no_grad()
    def reload_masters(self) -> None:
        self.finish_param_gather()
        for s, m in zip(self.slices, self.masters):
            flat = self.params[s.param].detach().view(-1)[s.lo:s.hi]
            if m.data_ptr() != flat.data_ptr():
                m.copy_(flat)
        self._zero_remainders()

    def _after_master_load(self) -> None:
        """Remainders: splitting a loaded master wrote this rank's slices of the parameters (a checkpoint rounded
        to nearest even differs from TE's rounding at ties), so every replica gathers them (collective)."""
        if any(r is not None for r in self.remainders):
            self.finish_param_gather()
            self._gather_params()
            self.finish_param_gather()

    # ---- collectives -----------------------------------------------------------------------
    def _gather(self, values: list[torch.Tensor], dtype: torch.dtype, sink) -> None:
        """All-gather per-slice ``values`` (as ``dtype``) into whole flat parameters; calls
        ``sink(param index, flat)``. For checkpoints: each bucket goes through a temporary. All buckets'
        gathers are started before the first is waited on.
        """
        coll = self.backend.collectives
        pending = []
        for plan in self.plans:
            group, dt = plan.group, dtype
            n = plan.size // max(group.size, 1)
            local = torch.zeros(n, dtype=dt, device=self.backend.current_device())
            for j, off in plan.slices:
                local[off - plan.shard_start:off - plan.shard_start + values[j].numel()].copy_(values[j])
            if group.handle is None:
                pending.append((plan, local, None))
                continue
            full = torch.empty(plan.size, dtype=dt, device=local.device)
            pending.append((plan, full, coll.all_gather(full, local, group=group.handle, async_op=True)))
        for plan, full, handle in pending:
            if handle is not None:
                handle.wait()
            for i, off in plan.params:
                sink(i, full[off:off + self.params[i].numel()])

    # ---- state: the plain optimizer's per-parameter format ---------------------------------
    def state_dict(self) -> dict:
        """Exactly :meth:`MixedPrecisionOptimizer.state_dict`'s format (collective over ``dp_cp`` and ``edp``)."""
        full: dict[str, dict[int, torch.Tensor]] = {}
        keys = list(self.state) + (["master"] if any(keeps_master(p.dtype) for p in self.params) else [])
        state = self.saved_state()
        for key in keys:
            values = self.saved_masters() if key == "master" else state[key]
            out: dict[int, torch.Tensor] = {}
            dtype = self._saved_dtype(key)
            self._gather(values, dtype, lambda i, flat, out=out: out.__setitem__(
                i, flat.clone().view(self.params[i].shape)))
            full[key] = out
        tensors = {}
        for i, name in enumerate(self.names):
            entry = {k: full[k][i] for k in self.state if self.keeps(k, i)}
            if keeps_master(self.params[i].dtype):
                entry["master"] = full["master"][i]
            tensors[name] = entry
        out = {"step": self.step_count, "optimizer": self.config.optimizer, "tensors": tensors}
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    def _saved_dtype(self, key: str) -> torch.dtype:
        """The dtype state ``key`` (or ``master``) is gathered and saved in: fp32 for a master and an fp16 moment
        (unscaled), a bf16 moment's own; a moment stored at fp32 in the masters' dtype (float64 for a float64
        model). From the config and the parameters: the same on every replica, also one owning no element."""
        dt = torch.float32 if key == "master" else state_dtype(self.config, key)
        if key == "master" or dt == torch.float16:
            return torch.float32
        return torch.float64 if dt == torch.float32 and self._norm_dtype() == torch.float64 else dt

    def load_state_dict(self, state: dict) -> None:
        """Take this rank's slices of a per-parameter state (saved by either optimizer, any dp size)."""
        self._check_loadable(state)
        with torch.no_grad():
            for j, s in enumerate(self.slices):
                entry = state["tensors"][self.names[s.param]]
                for key in self.state:
                    if self.keeps(key, s.param):
                        self.put(key, j, entry[key].reshape(-1)[s.lo:s.hi].to(self.compute_dtype(key, j), copy=True))
                if "master" in entry and keeps_master(self.params[s.param].dtype):
                    self.set_master(j, entry["master"].reshape(-1)[s.lo:s.hi])
        self._after_master_load()
        self.load_counters(state)


def _plan_slices(params: list[torch.nn.Parameter], chunks) -> tuple[list[_Slice], list[_BucketPlan]]:
    """This rank's owned slices (in buffer order) and one gather plan per bucket."""
    index = {id(p): i for i, p in enumerate(params)}
    slices: list[_Slice] = []
    plans: list[_BucketPlan] = []
    for c, chunk in enumerate(chunks):
        if isinstance(chunk, DistributedDataParallel):
            for buf, group in zip(chunk.buffers, chunk.buffer_groups):
                _plan_buffer(buf, group, params, index, slices, plans, c, chunk.config.overlap_param_gather)
    covered = {i for plan in plans for i, _ in plan.params}
    missing = [i for i in range(len(params)) if i not in covered]
    if missing:
        raise ValueError(f"{len(missing)} parameters (first of shape {tuple(params[missing[0]].shape)}) are in no "
                         f"data-parallel gradient buffer; wrap every model chunk in DistributedDataParallel "
                         f"before building the DistributedOptimizer (--use-distributed-optimizer)")
    return slices, plans


def _plan_buffer(buf, group, params, index: dict[int, int], slices: list[_Slice], plans: list[_BucketPlan],
                 chunk: int, overlap: bool) -> None:
    """Append the slices this rank owns in ``buf`` (sharded over ``group``) and one plan per bucket of
    model chunk ``chunk``."""
    rank, size = (group.rank, group.size) if group.size > 1 else (0, 1)
    if buf.shards != size:
        raise ValueError(f"a gradient buffer is cut into {buf.shards} shards but its group ({group.name}) has {size} "
                         f"ranks; build the data-parallel wrapper with the same groups as the optimizer")
    if any(b.param_data is None for b in buf.buckets):
        raise ValueError("the data-parallel wrapper keeps no flat parameter buffers; build it with "
                         "DataParallelConfig(use_distributed_optimizer=True) (--use-distributed-optimizer)")
    for bucket in buf.buckets:
        n = bucket.data.numel() // size
        lo_own, hi_own = bucket.offset + rank * n, bucket.offset + (rank + 1) * n
        plan = _BucketPlan(bucket.data.numel(), group, rank * n, [], [], bucket, chunk, overlap)
        for p in bucket.params:
            if id(p) not in index:
                continue
            if not p.is_contiguous():
                raise ValueError(f"parameter of shape {tuple(p.shape)} is not contiguous; the distributed "
                                 f"optimizer writes it as a flat range")
            i = index[id(p)]
            start, numel = buf.param_range(p)
            plan.params.append((i, start - bucket.offset))
            lo, hi = max(start, lo_own), min(start + numel, hi_own)
            if hi > lo:
                plan.slices.append((len(slices), lo - bucket.offset))
                slices.append(_Slice(i, lo - start, hi - start, buf.data[lo:hi]))
        plans.append(plan)
