"""Optimizers and learning-rate schedules.

* :class:`MixedPrecisionOptimizer` — fp32 masters, AdamW (the registry's fused ``adamw_step``) or
  SGD, fp16 loss-scale skipping, global-norm clipping; ``step(lr) -> StepResult``.
* :class:`DistributedOptimizer` — the same, with masters and states sharded over data x context
  parallel ranks (ZeRO-1, ``--use-distributed-optimizer``); same checkpoint format.
* :class:`~omnitron.core.optim.fsdp.FSDP2Optimizer` — the same step on FSDP2's sharded fp32 parameters,
  which are their own masters (``--use-torch-fsdp2``; torch_dist checkpoints only).
* :class:`LRScheduler` — Megatron's warmup + constant/linear/cosine/inverse-square-root/WSD; ``lr(progress)``.
* :func:`global_grad_norm` — the single-process-equal norm over tp/pp/cp ranks.
"""
from omnitron.core.optim.clip import global_grad_norm
from omnitron.core.optim.distributed import DistributedOptimizer
from omnitron.core.optim.optimizer import MixedPrecisionOptimizer, StepResult
from omnitron.core.optim.schedules import LRScheduler

__all__ = ["DistributedOptimizer", "LRScheduler", "MixedPrecisionOptimizer", "StepResult", "global_grad_norm"]
