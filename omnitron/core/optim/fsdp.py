"""The optimizer of ``--use-torch-fsdp2`` runs: it steps FSDP2's sharded parameters directly.

FSDP2 (:mod:`omnitron.core.parallel.data.fsdp`) keeps every parameter as an fp32 (a float64 model's: float64)
DTensor sharded over ``groups.dp_cp``, its gradient as a DTensor of the same sharding (reduce-scattered, the mean
over dp x cp).
The local shard of each parameter is its own fp32 master -- no second copy -- and the optimizer states are
shaped like it, so each rank holds 1/(dp x cp) of the weights, gradients and states. The step is
:class:`~omnitron.core.optim.optimizer.MixedPrecisionOptimizer`'s (unscale, skip on inf, clip by the global
norm, the fused AdamW or SGD update) on the local shards; the inf check, norm and zero count run over the
whole world with each shard counted once (:class:`~omnitron.core.optim.optimizer.ShardedOverDataParallel`).
FSDP all-gathers (and casts to the compute dtype) in the next forward: nothing is copied back here.

Checkpoints: ``--ckpt-format torch_dist`` only, each rank writing and reading its own shards as boxes of the
global tensors (:mod:`omnitron.core.checkpoint.dist`); :meth:`state_dict` (the torch format's per-parameter
gather) is refused.
"""
from __future__ import annotations

import torch

from omnitron.core.optim.optimizer import (MixedPrecisionOptimizer, ShardedOverDataParallel, _decays, _decoupled,
                                           keeps_master)
from omnitron.core.parallel.data.fsdp import local_shard


class FSDP2Optimizer(ShardedOverDataParallel, MixedPrecisionOptimizer):
    """:class:`MixedPrecisionOptimizer` over FSDP2's sharded fp32 parameters (see the module docstring)."""

    def _build_masters(self) -> None:
        self.decay = [_decays(n, p, self.config.apply_wd_to_qk_layernorm) for n, p in zip(self.names, self.params)]
        self.decoupled = [_decoupled(p) for p in self.params]
        low = [(n, p.dtype) for n, p in zip(self.names, self.params) if keeps_master(p.dtype)]
        if low:
            raise ValueError(f"FSDP2's sharded parameters are the fp32 (float64) masters, but {low[0][0]} is "
                             f"{low[0][1]}; "
                             f"shard the chunks with omnitron.core.parallel.data.fsdp.apply_fsdp2 first")
        self.masters = [local_shard(p.detach()) for p in self.params]  # views of the sharded parameters

    def _owners(self) -> list[torch.nn.Parameter]:
        return self.params

    def _fp32_grads(self) -> list[torch.Tensor]:
        """The local shards of the (fp32, reduce-scattered) gradients; zeros for a parameter without one."""
        return [self._scratch(i, m).zero_() if p.grad is None else local_shard(p.grad)
                for i, (p, m) in enumerate(zip(self.params, self.masters))]

    def _copy_to_model(self) -> None:
        """Nothing: the masters are the model's sharded parameters."""

    def reload_masters(self) -> None:
        """Nothing: the masters are the model's sharded parameters (loading wrote into them)."""

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer states (the masters are the model's own sharded parameters)."""
        return sum(t.untyped_storage().nbytes() for bufs in self.state.values() for t in bufs)

    def state_dict(self) -> dict:
        raise ValueError("--use-torch-fsdp2 checkpoints through --ckpt-format torch_dist (each rank its own "
                         "shards); drop --ckpt-format torch")
