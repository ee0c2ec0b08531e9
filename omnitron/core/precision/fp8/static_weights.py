"""FP8 weights quantized once per optimizer step for compiled and captured layers.

Eager FP8 linears quantize a weight once per optimizer step (:meth:`FP8Linear.quantize_weight`'s cache). A
compiled or captured layer cannot consult that cache (no Python runs inside its graph), so it re-quantized every
weight inside its graph on every call: per layer and micro-batch, an amax pass, a cast and a transposed cast of
each of its four weights (on the 1.3B H200 step, 12 of the 47 forward kernels of an FP8 layer and ~7 ms a step of
device time, BENCHMARKS.md). :func:`hold_static_weights` gives each such linear tensors that hold its weight's FP8
form for the run (:attr:`FP8Linear.static`) and a forward pre-hook on each compiled or captured layer (a graph
region, :func:`omnitron.core.graph_state.is_region`) that, before the layer's graph runs, re-quantizes a weight of
the layer only when it changed (the eager cache's key) and copies the result into those tensors in place. The
graphs take them as inputs: a compiled graph finds tensors of the same shapes (no recompilation), a captured graph
the same addresses with the new values. Linears outside the regions run eagerly and keep the eager cache.

Exact: within a step the weight and (delayed recipe) its scale are fixed, so the held form is the one an in-graph
quantization would compute; under ``delayed`` the weight's amax is observed once per step, as the eager cache does.
With ``--overlap-param-gather`` the layer's hook runs after the data-parallel wrapper's wait for the layer's
parameter all-gathers (that wait is prepended to the layer's pre-hooks, :mod:`omnitron.core.parallel.data.ddp`), so
each layer refreshes from its gathered weights while the later layers' gathers are still in flight; the optimizer
bumps every parameter's version after launching the gathers, so the refresh sees the change.
Memory: the FP8 form (2 bytes a parameter per-tensor, 1 and the block scales block-wise) is held the whole run, as
the eager cache holds it (priced so by :mod:`omnitron.plan.fp8_memory`).

Not used where the layer's weight is not current before the layer runs (FSDP2 gathers it in the module's hook,
with FP8 all-gathers quantized: :func:`omnitron.core.training.components.holds_fp8_weights`) or a recipe updates
per use (``delayed`` outside training).
``OMNITRON_FP8_WEIGHT_IN_GRAPH=1`` keeps the in-graph quantization (the A/B of ``scripts/device_bench.sh``).
"""
from __future__ import annotations

import functools
import os

from torch import nn

from omnitron.core.graph_state import outer_regions
from omnitron.core.precision.fp8.enable import linear_modules
from omnitron.core.precision.fp8.linear import FP8Linear

IN_GRAPH_ENV = "OMNITRON_FP8_WEIGHT_IN_GRAPH"


def _refresh(pairs: list[tuple[nn.Module, FP8Linear]], module: nn.Module, args) -> None:
    for linear, ex in pairs:
        ex.refresh_static(linear.weight)


def hold_static_weights(modules: list[nn.Module]) -> int:
    """Install the refresh on each graph region (compiled or captured layer) of ``modules``; returns how many FP8
    linears hold static weights (0 with ``OMNITRON_FP8_WEIGHT_IN_GRAPH=1``)."""
    if os.environ.get(IN_GRAPH_ENV, "") == "1":
        return 0
    held = 0
    for region in (r for chunk in modules for r in outer_regions(chunk)):
        pairs = [(m, m.fp8) for _, m in linear_modules(region)
                 if isinstance(getattr(m, "fp8", None), FP8Linear) and m.fp8.caches_weight]
        if pairs:
            region.register_forward_pre_hook(functools.partial(_refresh, pairs))
            held += len(pairs)
    return held
