"""``--use-torch-fsdp2``: parameters, gradients and optimizer state sharded over data x context parallel
ranks (ZeRO-3) by PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), as Megatron-Core and torchtitan do.

:func:`apply_fsdp2` shards one model chunk in place, in this order:

1. every parameter is made fp32 (the sharded parameters are the optimizer's masters: no second copy); a float64
   model's stay float64, and it reduces in float64 (its run is float64 end to end);
2. every replica is made to start from dp x cp rank 0's values (a broadcast, as the DDP wrapper does);
3. ``fully_shard`` on each transformer layer (one all-gather / reduce-scatter unit per layer; FSDP2
   prefetches the next layer's all-gather implicitly), then on the chunk itself (the root unit: embedding,
   final norm, output layer, and the tied embedding when the head reads it);
4. omnitron's parameter attributes (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``,
   ``shared_embedding``, ``init_name``, ...) copied onto FSDP's new DTensor parameters, so the gradient
   norm, the finalize step and the checkpoint see them as before.

Tensor parallelism composes underneath: FSDP shards each rank's local tensor-parallel shard along dim 0 over
``groups.dp_cp`` (a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` built from that process group), so
a parameter's DTensor is the tp-local tensor and ``to_local()`` is rows ``[r * ceil(n / dp), ...)`` of it.
Pipeline parallelism: each model chunk is its own FSDP root. Gradients are reduce-scattered once per step,
on the last micro-batch (:attr:`FullyShardedDataParallel.is_last_microbatch`, which the pipeline runtime
sets before each weight-gradient pass, maps to ``set_requires_gradient_sync``): the earlier micro-batches
accumulate unsharded gradients in ``reduce_dtype`` (4 bytes per parameter of the chunk, held through the
step's backwards). ``--fsdp2-reduce-every-microbatch`` instead reduce-scatters after every micro-batch's
backward and accumulates the sharded gradients: ZeRO-3's memory during the step, for one reduce-scatter per
micro-batch (``benchmarks/fsdp2.py`` measures both). Mixed precision: ``MixedPrecisionPolicy(param_dtype=
the run's --bf16 / --fp16 dtype, reduce_dtype=float32)``; the reduction is FSDP's mean over dp x cp. The layers'
units do not cast their inputs (``cast_forward_inputs=False``): the hidden states already are in the compute
dtype, and the rotary angles stay fp32 as in the unsharded model. With FP8
(tensorwise), the FP8 linears' weights are all-gathered in e4m3 instead (:mod:`omnitron.core.precision.fp8.fsdp`).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from omnitron.core.parallel.data.wrapper import ChunkWrapper


def dp_mesh(groups, device_type: str):
    """The 1-D device mesh of ``groups.dp_cp`` (FSDP's sharding group)."""
    from torch.distributed.device_mesh import DeviceMesh

    if groups.dp_cp.handle is None:
        raise ValueError("--use-torch-fsdp2 shards over data x context parallel ranks, and this layout has one; "
                         "drop --use-torch-fsdp2 or use more data-parallel ranks")
    return DeviceMesh.from_group(groups.dp_cp.handle, device_type)


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The modules that get an FSDP unit of their own before the root: each transformer layer."""
    layers = getattr(getattr(module, "decoder", None), "layers", None)
    if layers is None:
        raise ValueError(f"--use-torch-fsdp2 shards GPT-style chunks (decoder.layers); {type(module).__name__} "
                         f"has none; drop --use-torch-fsdp2 for this model family")
    return list(layers.values())


@torch.no_grad()
def apply_fsdp2(module: nn.Module, groups, *, compute_dtype: torch.dtype, device_type: str,
                collectives, fp8_scales=None) -> nn.Module:
    """Shard ``module`` over ``groups.dp_cp`` in place (see the module docstring); returns it. ``fp8_scales``: a
    :class:`~omnitron.core.precision.fp8.fsdp.WeightScales` whose FP8 linears' weights are all-gathered in FP8."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = dp_mesh(groups, device_type)
    # NOTE: the last stage returns its per-token loss as ``loss.t()``, a view, and FSDP2 warns that an in-place
    # op on a view would skip its pre-backward hook; nothing modifies a chunk's output in place (the pipeline
    # runtime's loss function and p2p sends read it, backward takes it as is), so the warning is noise here
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    attrs = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    wide = any(p.dtype == torch.float64 for p in module.parameters())
    master = torch.float64 if wide else torch.float32
    for p in module.parameters():
        if p.dtype != master:
            p.data = p.data.to(master)  # exact: every bf16 / fp16 value is an fp32 value
        collectives.broadcast(p.data, src=groups.dp_cp.global_rank(0), group=groups.dp_cp.handle)
    if fp8_scales is not None:  # after the broadcast: the wrapped masters are the replicas' common values
        fp8_scales.wrap(module)
        attrs = {name: dict(p.__dict__) for name, p in module.named_parameters()}
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=master)
    # a layer's inputs are already in the compute dtype but for the fp32 rotary angles, which FSDP's default
    # input cast would round to bf16 (up to position x 2^-8 radians of rotation, 8 at position 2056): no cast there
    layer_policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=master,
                                        cast_forward_inputs=False)
    for unit in shard_units(module):
        fully_shard(unit, mesh=mesh, mp_policy=layer_policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    for name, p in module.named_parameters():
        p.__dict__.update(attrs[name])
    if fp8_scales is not None:
        fp8_scales.collect(module)
    return module


class FullyShardedDataParallel(ChunkWrapper):
    """One FSDP2-sharded model chunk, as the pipeline runtime drives it; ``forward`` is the chunk's and unknown
    attributes fall through to it (like :class:`~omnitron.core.parallel.data.DistributedDataParallel`)."""

    def __init__(self, module: nn.Module, groups, *, compute_dtype: torch.dtype, device_type: str,
                 collectives, reduce_every_microbatch: bool = False, fp8_scales=None) -> None:
        super().__init__(apply_fsdp2(module, groups, compute_dtype=compute_dtype, device_type=device_type,
                                     collectives=collectives, fp8_scales=fp8_scales))
        self._last, self.reduce_every_microbatch = True, reduce_every_microbatch
        self.fp8_scales = fp8_scales

    def reshard(self) -> None:
        """Free every all-gathered parameter and register the sharded ones again. NOTE: FSDP2 keeps the root
        unit's parameters all-gathered after a forward (backward would gather them again at once), also after
        a forward-only pass, which has no backward: call this after validation, so what reads the parameters
        next (the checkpoint, the norms, the optimizer's view) sees the shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @property
    def is_last_microbatch(self) -> bool:
        """Set by the pipeline runtime before each weight-gradient pass: gradients are reduce-scattered on the
        last micro-batch only (the earlier ones accumulate unsharded)."""
        return self._last

    @is_last_microbatch.setter
    def is_last_microbatch(self, flag: bool) -> None:
        self._last = bool(flag)
        if self.reduce_every_microbatch:  # every backward reduce-scatters and accumulates sharded gradients
            return
        self.module.set_requires_gradient_sync(self._last)
        self.module.set_is_last_backward(self._last)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view of its storage), else ``t``; the fp32 master
    inside an FP8-gathered weight's shard (:mod:`omnitron.core.precision.fp8.fsdp`)."""
    from torch.distributed.tensor import DTensor

    from omnitron.core.precision.fp8.fsdp import master_of

    return master_of(t.to_local() if isinstance(t, DTensor) else t)


def shard_offset(p: torch.Tensor) -> int:
    """The dim-0 row where DTensor ``p``'s local shard starts within its (tp-local) full tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) if offset else 0
