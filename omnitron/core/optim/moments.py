"""Adam moments stored below fp32: Megatron's precision-aware optimizer (--exp-avg-dtype / --exp-avg-sq-dtype),
whose Transformer Engine FusedAdam keeps each moment in its dtype and steps it in fp32.

- bf16: read as fp32, written back rounded to nearest.
- fp16: stored scaled, with one fp32 scale per tensor (each parameter's, or with the distributed optimizer each
  owned slice's, as TE's per optimizer parameter): read as ``fp16 * scale``; written back as TE's ``_apply_scale``
  does -- ``scale = absmax / (fp16 max / 2)``, the fp32 value times ``1 / scale`` (0 for a zero scale), rounded to
  fp16 -- so the largest element lands at half of fp16's range.
- fp32: the tensor itself.

Checkpoints hold bf16 moments as they are and fp16 moments unscaled, as fp32 (TE's ``state_dict``: what
``get_unscaled_state`` returns); loading an fp16 moment scales it afresh (TE's ``set_scaled_state``).
"""
from __future__ import annotations

import torch

MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""--exp-avg-dtype / --exp-avg-sq-dtype by name: the dtypes Adam's moments may be stored in."""
FP16_RANGE = torch.finfo(torch.float16).max / 2.0
"""TE's target for an fp16 moment's largest magnitude (32752)."""


def state_dtype(config, key: str) -> torch.dtype:
    """The dtype optimizer state ``key`` is stored in: Adam's moments as --exp-avg-dtype / --exp-avg-sq-dtype say,
    everything else fp32."""
    return MOMENT_DTYPES[{"exp_avg": config.exp_avg_dtype, "exp_avg_sq": config.exp_avg_sq_dtype}.get(key, "fp32")]


def new_scales(state: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """One fp32 scale (1, as TE starts it) per tensor of every fp16 state."""
    return {k: [torch.ones(1, device=t.device) for t in ts] for k, ts in state.items()
            if ts and ts[0].dtype == torch.float16}


def unscaled(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Moment ``t`` as fp32 (``t`` itself when it is fp32; a new tensor otherwise)."""
    x = t.float()
    return x.mul_(scale) if t.dtype == torch.float16 else x


def store(t: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Write fp32 ``x`` into moment ``t`` (``x`` may be scaled in place): nothing when ``x`` is ``t``; bf16
    rounded to nearest; fp16 by TE's rule, ``scale`` updated in place."""
    if x.data_ptr() == t.data_ptr():
        return
    if t.dtype == torch.float16 and x.numel():
        lo, hi = torch.aminmax(x)
        torch.div(torch.maximum(-lo, hi), torch.full_like(scale, FP16_RANGE), out=scale)
        x.mul_(torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)))
    t.copy_(x)
