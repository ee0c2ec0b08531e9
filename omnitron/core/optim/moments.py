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

Master remainders (TE's ``store_param_remainders``, which Megatron's precision-aware optimizer turns on under --bf16):
a bf16 parameter's fp32 master is kept as the parameter itself plus the low 16 bits of the master (an int16), 2
bytes instead of 4. TE's kernel splits the master's bits into its high half ``hi`` and low half ``lo`` and stores
``hi + 1`` as the parameter when ``lo``'s top bit is set (the master rounded to bf16, ties away from zero), ``lo``
as the remainder; reading undoes the increment when the remainder is negative (top bit set) and joins the halves.
For a finite master the pair determines it exactly, so the step on the joined master is the fp32-master step bit for
bit, and the parameter differs from a round-to-nearest-even copy only where ``lo`` is exactly 0x8000 and ``hi``
even (a master beyond bf16's largest value rounds to inf, as round to nearest even does). NaN and inf masters: an
inf (``lo`` 0) is stored as it is. TE's increment wraps the int16 for the NaNs whose high half is 0x7FFF or 0xFFFF
(0x7FFFFFFF is the NaN GPUs write), storing -0.0 or +0.0 -- a finite parameter for a NaN master; here such a high
half is never incremented (any other's increment stays within the NaNs), so a NaN master's parameter is NaN too (or,
as in TE, +-inf when the high half is 0x7F80 / 0xFF80 and the low half below 0x8000: the NaN's set mantissa bits are
all in the dropped half), and it joins back to a NaN (not always the same payload). The master's finiteness is read
from the joined value (:func:`master_finite`): a parameter rounded up to inf may belong to a finite master.
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


def absmax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of fp32 ``x`` (non-empty), a one-element tensor (NaN if ``x`` holds one)."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(-lo, hi).reshape(1)


def new_scale(amax: torch.Tensor, scale: torch.Tensor) -> None:
    """TE's fp16 scale for a moment whose largest magnitude is ``amax``, written into ``scale``: amax / 32752 in
    fp32."""
    torch.div(amax, torch.full_like(scale, FP16_RANGE), out=scale)


def store(t: torch.Tensor, x: torch.Tensor, scale: torch.Tensor | None, *, rescale: bool = True) -> None:
    """Write fp32 ``x`` into moment ``t`` (``x`` may be scaled in place): nothing when ``x`` is ``t``; bf16
    rounded to nearest; fp16 by TE's rule, ``scale`` first set from ``x``'s absmax (unless not ``rescale``: then
    ``scale`` is already the whole tensor's new one and ``x`` is a piece of it)."""
    if x.data_ptr() == t.data_ptr():
        return
    if t.dtype == torch.float16 and x.numel():
        if rescale:
            new_scale(absmax(x), scale)
        x.mul_(torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale)))
    t.copy_(x)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master of flat bf16 ``param`` and its int16 ``remainder`` (TE's reconstruction; a new tensor)."""
    # NOTE: arithmetic on the contiguous halves, then one strided copy each (strided int16 arithmetic is slow on CPU)
    halves = torch.empty((param.numel(), 2), dtype=torch.int16, device=param.device)
    halves[:, 0] = remainder  # NOTE: little-endian: the low half of an fp32 word comes first
    halves[:, 1] = param.view(torch.int16) - (remainder < 0).to(torch.int16)  # undo the rounding up
    return halves.view(torch.float32).view(-1)


def split_master(x: torch.Tensor, param: torch.Tensor, remainder: torch.Tensor) -> None:
    """Store fp32 master ``x`` (flat, consumed) as bf16 ``param`` (rounded, ties away from zero) and its int16
    ``remainder``: TE's split, exactly undone by :func:`join_master` for every non-NaN master; a NaN master's
    parameter is NaN or inf (TE's wraps to a zero for some, see the module docstring) and joins back to a NaN."""
    halves = x.view(torch.int16).view(-1, 2)
    remainder.copy_(halves[:, 0])
    hi = param.view(torch.int16)
    hi.copy_(halves[:, 1])  # NOTE: the arithmetic below runs on the contiguous copies (strided is slow on CPU)
    # round up where the dropped half is >= 0x8000, except where the high half's magnitude bits are all ones (a NaN,
    # whose increment would wrap to a signed zero)
    hi += ((remainder < 0) & ((hi & 0x7FFF) != 0x7FFF)).to(torch.int16)


def master_finite(param: torch.Tensor, remainder: torch.Tensor, chunk: int) -> torch.Tensor:
    """Whether every fp32 master joined from flat bf16 ``param`` and ``remainder`` is finite, a 0-dim bool tensor
    on their device; joined ``chunk`` elements at a time (a bounded temporary, not an fp32 copy of the whole)."""
    flags = [torch.isfinite(join_master(param[a:a + chunk], remainder[a:a + chunk])).all()
             for a in range(0, param.numel(), chunk)]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=param.device)
