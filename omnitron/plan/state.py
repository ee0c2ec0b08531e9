"""Parameter, gradient and optimizer-state bytes of one rank, counted on a meta-device skeleton.

The stage's model chunks are built exactly as training builds them (the family's ``build_chunks``
through :func:`omnitron.core.checkpoint.reshard.skeleton_chunks`) but on the meta device: shapes,
dtypes and sharding attributes without storage. The gradient buffers are laid out by the
data-parallel wrapper's own :class:`GradBuffer` on those meta parameters, so bucket padding (to a
multiple of the replica group) and the tied embedding's isolated bucket are the run's exactly.

- parameters: every local parameter's bytes (tp-sharded ones at their shard shape; MoE experts
  at ep rank 0's share); with the distributed optimizer the model lives in flat buffers padded
  like the gradient buckets, so the padded size counts.
- gradients: the ``main_grad`` buffers (fp32 with ``--accumulate-allreduce-grads-in-fp32``,
  which ``--bf16`` implies; else the parameter's dtype).
- optimizer: fp32 masters for bf16 / fp16 parameters (bf16 ones' as int16 remainders with ``store_param_remainders``,
  Megatron's precision-aware optimizer under --bf16) plus Adam's two moments (fp32, or --exp-avg-dtype /
  --exp-avg-sq-dtype's bf16 / fp16, an fp16 one with an fp32 scale per tensor) (SGD: one with momentum; Muon:
  one, its momentum, for the matrices it orthogonalises); with ``--use-distributed-optimizer`` only the slices
  this data x context rank owns of every bucket (the largest over the replica group's ranks is reported).
  A float64 parameter is its own master and its gradient and fp32-named moments are float64 (the optimizer's
  ``master_dtype`` / ``keeps_master``: a float64 run stays float64).
- ``--use-torch-fsdp2``: every parameter, its gradient and its moments are fp32 (float64 for a float64 model)
  shards of ceil(rows / (dp x cp)) rows (FSDP2's dim-0 sharding, padded storage; the shards are the masters: no
  second copy). FSDP2's
  transients inside a step (all-gathered layers, gradients accumulated unsharded before the step's
  reduce-scatter) are not in these counts (``BENCHMARKS.md`` measures them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnitron.core.parallel.pipeline.schedules import schedule_style


@dataclass(frozen=True)
class StateBytes:
    params: int
    grads: int
    optimizer: int
    step: int = 0
    """The optimizer step's own temporaries (:mod:`.optimizer_step`; held only during the step)."""


def skeleton(model_cfg, parallel, pp_rank: int, style: str = "loop") -> list[torch.nn.Module]:
    """This pipeline rank's chunks (tp rank 0, ep rank 0) on the meta device; ``style``: the chunks' placement
    (``v`` for the V-shaped schedules)."""
    from omnitron.core.checkpoint.reshard import Layout, skeleton_chunks

    layout = Layout(tp=parallel.tensor_model_parallel_size, pp=parallel.pipeline_model_parallel_size,
                    vp=parallel.virtual_pipeline_model_parallel_size, cp=parallel.context_parallel_size,
                    first=parallel.decoder_first_pipeline_num_layers, last=parallel.decoder_last_pipeline_num_layers,
                    embedding=parallel.account_for_embedding_in_pipeline_split,
                    loss=parallel.account_for_loss_in_pipeline_split, ep=parallel.expert_model_parallel_size,
                    style=style)
    etp = parallel.etp if getattr(model_cfg, "num_experts", None) else 1
    key = f"{_structure(model_cfg)}/{layout!r}/etp{etp}"
    if key not in _SKELETON:  # every stage's chunks are built at once: kept for the next ranks and layouts
        if len(_SKELETON) >= 8:
            _SKELETON.pop(next(iter(_SKELETON)))
        with _CheapMeta(), torch.device("meta"):
            _SKELETON[key] = skeleton_chunks(model_cfg, layout, etp=etp)
    chunks = _SKELETON[key]
    return [m for (r, _), m in sorted(chunks.items()) if r == pp_rank or layout.pp == 1]


class _CheapMeta(torch.overrides.TorchFunctionMode):
    """The two ops of a model build whose meta versions are Python references that import the compiler stack
    (dynamo, sympy) on first use, 1.5-3 s of every rank's fit check: ``normal_`` on a meta tensor returns it
    untouched (it has no values), ``arange`` (the rotary frequencies' maths) is made on the host and left there
    (buffers that are no parameter: not counted)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "normal_":  # Tensor.normal_ and torch.nn.init.normal_
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        if func is torch.arange and torch.device(kwargs.get("device") or "cpu").type == "meta":
            return func(*args, **{**kwargs, "device": "cpu"})
        return func(*args, **kwargs)


_SKELETON: dict = {}
"""The last 8 layouts' meta chunks, oldest first (a search revisits the few (tp, pp, vpp) of a model often)."""
_STATE: dict = {}
""":func:`state_bytes` by everything it depends on (a search prices many layouts sharing tp / pp / dp)."""


def _structure(model_cfg) -> str:
    """The model config's repr without its recomputation settings (they change no parameter)."""
    from dataclasses import fields, replace

    names = {f.name for f in fields(model_cfg)} & {"recompute_granularity", "recompute_method", "recompute_num_layers"}
    return repr(replace(model_cfg, **dict.fromkeys(names)))


def _buffers(module, ddp, dp_cp: int, edp: int, bucketing: bool = True):
    """The wrapper's gradient buffers for ``module`` (meta storage), with each one's replica-group size;
    ``bucketing``: the wrapper's (the first chunk of the first pipeline stage)."""
    from omnitron.core.parallel.data.buffers import GradBuffer
    from omnitron.core.parallel.data.config import bucket_elements

    fp32 = bool(ddp and ddp.accumulate_allreduce_grads_in_fp32)
    dist = bool(ddp and ddp.use_distributed_optimizer)
    bucket = bucket_elements(ddp, dp_cp, bucketing=bucketing)
    by: dict[tuple, list] = {}
    for p in [p for p in module.parameters() if p.requires_grad][::-1]:
        ex = bool(getattr(p, "expert", False))
        wide = torch.promote_types(p.dtype, torch.float32) if fp32 else p.dtype  # float64 stays float64
        by.setdefault((wide, ex, p.dtype if dist else None), []).append(p)
    scatter = dist or bool(ddp and ddp.reduce_scatter)
    shared = getattr(module, "shared_embedding_parameters", None)
    isolate = frozenset(id(p) for p in shared()) if scatter and shared is not None else frozenset()
    return [(GradBuffer(ps, dt, bucket, edp if ex else dp_cp, isolate, sharded=scatter), edp if ex else dp_cp)
            for (dt, ex, _), ps in by.items()]


def _owned(buf, size: int, weight=lambda p: 1, per_piece: int = 0):
    """The parameter elements each rank of ``size`` owns in ``buf`` (distributed optimizer slices; an int64 array
    by rank: the caller sums a rank's over its buffers and chunks before taking the most), each
    element of parameter ``p`` counted ``weight(p)`` times: per bucket the weights' running sum at the parameters'
    edges (a piecewise-linear function of the offset), read at every rank's slice ends at once; plus
    ``per_piece`` for each parameter a rank owns part of (fp16 moments' scales: one per owned slice)."""
    import numpy as np

    total = np.zeros(size, dtype=np.int64)
    for b in buf.buckets:
        spans = sorted((buf.param_range(p)[0], buf.param_range(p)[1], weight(p)) for p in b.params)
        edges, below, rate, acc, end = [], [], [], 0, None
        for s0, c, w in spans:
            if end is not None and s0 > end:  # a gap (padding) between parameters weighs nothing
                edges.append(end), below.append(acc), rate.append(0)
            edges.append(s0), below.append(acc), rate.append(w)
            acc, end = acc + w * c, s0 + c
        if end is None:
            continue
        edges.append(end), below.append(acc), rate.append(0)
        e, lo, w = (np.array(v, dtype=np.int64) for v in (edges, below, rate))
        x = b.offset + np.arange(size + 1, dtype=np.int64) * (b.data.numel() // size)  # the slices' ends
        i = np.searchsorted(e, x, side="right") - 1
        j = np.maximum(i, 0)
        upto = np.where(i < 0, 0, lo[j] + w[j] * (x - e[j]))
        total += np.diff(upto)
        n = b.data.numel() // size
        for s0, c, _ in spans if per_piece and n else ():
            if c:  # the ranks whose slice [offset + r n, offset + (r + 1) n) meets [s0, s0 + c)
                total[(s0 - b.offset) // n:(s0 + c - 1 - b.offset) // n + 1] += per_piece
    return total


def _moments(optim, p=None) -> int:
    """fp32 optimizer buffers per element of parameter ``p``: Adam's two moments (Muon: its momentum alone for
    the matrices it orthogonalises), SGD's momentum, 1-bit Adam's two moments and worker error (its server error,
    1/dp of a word, is :func:`_onebit_server_bytes`)."""
    if optim.optimizer == "onebit_adam":
        return 3
    if optim.optimizer == "muon" and p is not None:
        from omnitron.core.optim.muon import uses_muon

        return 1 if uses_muon(p) else 2
    if optim.optimizer in ("adam", "adamw", "muon"):
        return 2
    return 1 if optim.sgd_momentum else 0


def moment_bytes(optim, p=None, dtype: torch.dtype | None = None) -> int:
    """Bytes of optimizer buffers per element of parameter ``p`` (or of a ``dtype`` one; default fp32):
    :func:`_moments`' words in the master's dtype (fp32; float64 for a float64 parameter), but Adam's two moments
    in --exp-avg-dtype / --exp-avg-sq-dtype (2 bytes each in bf16: the precision-aware optimizer)."""
    from omnitron.core.optim.optimizer import master_dtype

    dtype = dtype or (p.dtype if p is not None else torch.float32)
    word = master_dtype(dtype).itemsize
    if optim.optimizer in ("adam", "adamw"):
        from omnitron.core.optim.moments import MOMENT_DTYPES

        return sum(word if name == "fp32" else MOMENT_DTYPES[name].itemsize
                   for name in (optim.exp_avg_dtype, optim.exp_avg_sq_dtype))
    return word * _moments(optim, p)


def least_moment_bytes(optim, dtype: torch.dtype = torch.float32) -> int:
    """The fewest optimizer bytes any ``dtype`` parameter takes per element (Muon: its momentum alone, one word in
    the master's dtype, for the matrices it orthogonalises; the others keep AdamW's two moments): what a lower
    bound may count for every element. A float64 model's words are float64 (:func:`moment_bytes`)."""
    if optim.optimizer == "muon":
        from omnitron.core.optim.optimizer import master_dtype

        return master_dtype(dtype).itemsize
    return moment_bytes(optim, dtype=dtype)


def scale_bytes(optim) -> int:
    """Bytes of fp16 moments' scales per optimizer tensor (one fp32 each: :mod:`omnitron.core.optim.moments`)."""
    if optim.optimizer not in ("adam", "adamw"):
        return 0
    return 4 * [optim.exp_avg_dtype, optim.exp_avg_sq_dtype].count("fp16")


def master_bytes(optim, dtype: torch.dtype) -> int:
    """Bytes of a parameter of ``dtype``'s master per element: none for fp32 or float64 (their own masters:
    ``keeps_master``), 2 for a bf16 one kept as its int16 remainder (``store_param_remainders``), else an fp32
    copy."""
    from omnitron.core.optim.optimizer import keeps_master

    if not keeps_master(dtype):
        return 0
    return 2 if optim.store_param_remainders and dtype == torch.bfloat16 else 4


def _opt_bytes(numel: int, dtype: torch.dtype, optim) -> int:
    """Masters (bf16 / fp16 parameters) plus the optimizer's moments for ``numel`` elements of ``dtype``."""
    return numel * (moment_bytes(optim, dtype=dtype) + master_bytes(optim, dtype))


def expert_data_parallel_size(settings) -> int:
    """The replica group of expert gradients: world / (pp x ep x etp) (the rank grid's edp)."""
    pc = settings.parallel
    return max(1, settings.world_size // (pc.pipeline_model_parallel_size * pc.expert_model_parallel_size * pc.etp))


def state_bytes(settings, model_cfg, pp_rank: int) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state on one rank of pipeline stage ``pp_rank`` (kept per
    model structure, layout, replica groups, data-parallel and optimizer settings)."""
    pc = settings.parallel
    key = (_structure(model_cfg), pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size,
           pc.virtual_pipeline_model_parallel_size, pc.context_parallel_size, pc.decoder_first_pipeline_num_layers,
           pc.decoder_last_pipeline_num_layers, pc.account_for_embedding_in_pipeline_split,
           pc.account_for_loss_in_pipeline_split, pc.expert_model_parallel_size, pc.etp, pp_rank,
           settings.dp * pc.context_parallel_size, expert_data_parallel_size(settings), repr(settings.ddp),
           repr(settings.optim))
    if key not in _STATE:
        if len(_STATE) > 4096:
            _STATE.clear()
        _STATE[key] = _state_bytes(settings, model_cfg, pp_rank)
    return _STATE[key]


def _state_bytes(settings, model_cfg, pp_rank: int) -> StateBytes:
    pc = settings.parallel
    dp_cp = settings.dp * pc.context_parallel_size
    edp = expert_data_parallel_size(settings)
    ddp, dist = settings.ddp, bool(settings.ddp and settings.ddp.use_distributed_optimizer)
    chunks = skeleton(model_cfg, pc, pp_rank, schedule_style(settings.training.pipeline_schedule))
    if getattr(ddp, "use_torch_fsdp2", False):
        return _fsdp2_bytes(chunks, dp_cp, settings.optim)
    from omnitron.plan.optimizer_step import step_bytes

    params = grads = opt = step = 0
    owned: dict = {}  # replica-group size: bytes each of its ranks owns
    for c, module in enumerate(chunks):
        buffers = _buffers(module, ddp, dp_cp, edp, c == 0 and pp_rank == 0)
        step = max(step, step_bytes(settings, buffers, dist))
        for buf, size in buffers:
            dtype = buf.params[0].dtype
            total = sum(p.numel() for p in buf.params)
            grads += buf.data.numel() * buf.data.element_size()
            params += (buf.data.numel() if dist else total) * dtype.itemsize
            def per(p, master=master_bytes(settings.optim, dtype)) -> int:  # bytes per element: master, moments
                return moment_bytes(settings.optim, p) + master

            scales = scale_bytes(settings.optim)
            if dist:  # NOTE: rank r owns slice r of every bucket of every chunk: the most of its sum, not the sum of
                # each buffer's most (they differ once chunks are bucketed differently: Megatron's rule)
                owned[size] = owned.get(size, 0) + _owned(buf, size, per, scales)
            else:
                opt += sum(per(p) * p.numel() + scales for p in buf.params)
    opt += sum(int(v.max()) for v in owned.values())
    opt += _onebit_server_bytes(settings.optim, [p for module in chunks for p in module.parameters()], dp_cp)
    return StateBytes(params, grads, opt, step)


def _onebit_server_bytes(optim, params: list, dp_cp: int) -> int:
    """1-bit Adam's server error feedback (DeepSpeed keeps one beside the worker's): each data-parallel rank owns
    1/dp_cp of every compressed buffer's elements, an fp32 word each (unpadded, as the worker error in
    :func:`_moments`; 1-bit Adam refuses the distributed optimizer, FSDP2, experts and float64). 0 for other
    optimizers."""
    if optim.optimizer != "onebit_adam":
        return 0
    return 4 * -(-sum(p.numel() for p in params) // dp_cp)


def _fsdp2_bytes(chunks, dp_cp: int, optim) -> StateBytes:
    """FSDP2's shards (rank 0's, the largest: ceil(rows / dp_cp) rows of every parameter), fp32, or float64 for a
    float64 model (``apply_fsdp2`` keeps it float64)."""
    params = [p for m in chunks for p in m.parameters() if p.requires_grad]
    n = sum(math.ceil(p.shape[0] / dp_cp) * math.prod(p.shape[1:]) for p in params)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    return StateBytes(dtype.itemsize * n, dtype.itemsize * n, _opt_bytes(n, dtype, optim))
