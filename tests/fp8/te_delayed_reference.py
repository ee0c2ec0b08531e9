"""Transformer Engine's delayed scaling as Megatron drives it, transcribed in float64 from TE's source (mirror
commit d0067d0da; paths under transformer_engine/) to replay a log of observed amaxes. Not omnitron's code.

When TE (in Megatron) reduces amaxes, rolls the history and updates the scale:

* State per quantized tensor: ``scale`` (ones) and ``amax_history`` [L] (zeros) (pytorch/quantization.py:1436-1440).
  A delayed-scaling quantizer's amax pointer is ``amax_history[0]`` (quantization.py:1449), into which every cast
  max-accumulates its tensor's amax (common/cast/fp8/quantize_fp8.cuh:223, ``atomicMaxFloat``); an empty tensor
  writes nothing (pytorch/csrc/quantizer.cpp:634). So slot 0 holds the max of every use since the last update.
* Forward tensors (input, weight): updated when the outermost ``fp8_autocast`` exits with grad enabled
  (quantization.py:779-782; Megatron enters it around each transformer block's forward under the delayed recipe,
  core/transformer/transformer_block.py:626-629): once per training micro-batch forward, per pipeline stage.
  Evaluation runs under ``torch.no_grad()`` (training/training.py:5175): its forwards accumulate into slot 0 and
  no update follows, so they fold into the next training micro-batch's forward update.
* Backward tensors (output gradient): updated in the backward of the first FP8 module of the autocast
  (pytorch/module/linear.py:1442, 1467-1469): once per micro-batch backward, after all its layers.
* The weight is quantized only when ``is_first_microbatch`` is None or True (linear.py:479; Megatron passes True
  for the first micro-batch of a step and of an evaluation, core/pipeline_parallel/schedules.py:496, 826): the
  later micro-batches leave its slot 0 at zero.
* An update (quantization.py:656-712 -> common/recipe/delayed_scaling.cu ``kernel_bulk``, 162-250): the packed
  slot-0 amaxes MAX-reduced over the amax group (676, 684); for each tensor, with ``a`` the reduced amax, if ``a``
  is 0 nothing rolls and the scale stays (186; MAX then sees 0: 206-219, 238); else the history rolls
  (``h[i] <- h[i+1]``, ``h[L-1] <- a``, ``h[0] <- 0``: 187-197), ``A = a`` (most_recent, 203-205) or the max of
  ``a`` and ``h[1:]`` before the roll (max), and ``scale = fp8_max * 2**-margin / A`` in float32 when A is finite
  and positive, else the previous scale, and the largest float32 where the quotient overflows (238-249).
"""
from __future__ import annotations

import numpy as np

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
F32_MAX = float(np.finfo(np.float32).max)


def te_scale(amax: float, fp8_max: float, margin: int, previous: float) -> float:
    """delayed_scaling.cu:238-249. A float64 quotient of two float32 numbers rounded once to float32 is the float32
    division (53 >= 2 * 24 + 2 bits: double rounding is innocuous for division), so this is TE's value exactly."""
    if not (np.isfinite(amax) and amax > 0):
        return previous
    with np.errstate(over="ignore"):  # the overflow is the case TE maps to the largest float32
        q = np.float32(np.float64(np.float32(fp8_max * 2.0 ** -margin)) / np.float64(amax))
    return F32_MAX if np.isinf(q) else float(q)


class Slot:
    """One quantized tensor's TE state: history in TE's layout (slot 0 accumulating) and scale."""

    def __init__(self, fmt: str, length: int, algo: str, margin: int) -> None:
        self.fp8_max, self.algo, self.margin = FP8_MAX[fmt], algo, margin
        self.h, self.scale = [0.0] * length, 1.0
        self.window = [0.0] * length
        """The last L amaxes the last update saw, newest first (slot 0, then h[L-1] down to h[1])."""

    def observe(self, amax: float) -> None:
        self.h[0] = max(self.h[0], amax)  # atomicMaxFloat into amax_history[0]

    def update(self) -> None:
        """kernel_bulk for one tensor (one rank: the reduction is the identity)."""
        a = self.h[0]
        if a == 0.0:  # delayed_scaling.cu:186: no roll; the scale below keeps the previous one
            return
        window = [a] + self.h[1:][::-1]
        big = a if self.algo == "most_recent" else max(window)
        self.scale = te_scale(big, self.fp8_max, self.margin, self.scale)
        self.h = [0.0] + self.h[2:] + [a] if len(self.h) > 1 else [0.0]
        self.window = window


def replay(log: list, slots: dict) -> list[dict]:
    """Run TE's schedule over omnitron's log: ``("obs", key, kind, amax, scale_used)`` with kind ``fwd`` (training
    forward), ``eval`` (forward without grad) or ``bwd`` (output gradient), and ``("step", snapshot)`` markers.
    A run of ``fwd`` observations is one micro-batch's forward (updated when it ends: autocast exit), a run of
    ``bwd`` one micro-batch's backward (updated when it ends); ``eval`` never updates. Returns, per step marker,
    {key: (window, scale)} and, per observation, the scale TE had in force (``scale_used`` column replaced)."""
    out, used, prev = [], [], None
    fwd = [k for k, s in slots.items() if k[1] != "grad_output"]
    bwd = [k for k, s in slots.items() if k[1] == "grad_output"]

    def close(kind):
        for k in (fwd if kind == "fwd" else bwd if kind == "bwd" else ()):
            slots[k].update()

    for entry in log:
        kind = entry[2] if entry[0] == "obs" else "step"
        if prev is not None and kind != prev:
            close(prev)
        if entry[0] == "obs":
            _, key, _, amax, _ = entry
            used.append(slots[key].scale)
            slots[key].observe(amax)
        else:
            out.append({k: (list(s.window), s.scale) for k, s in slots.items()})
        prev = kind
    return out, used
