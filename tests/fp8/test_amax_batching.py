"""Delayed scaling's amax reductions are batched over layers: a constant number of collectives per step.

One process with a stand-in amax group of size 2 (its "all-reduce" is counted and, over one process's
values, the identity), so the counts are exact and the numbers can be compared bit for bit with the
reference: the same layers reducing each amax when taken (``reducer=None``, the per-use path).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.precision.fp8 import FP8Config, FP8Linear
from omnitron.core.precision.fp8.scaling import AmaxReducer

STEPS, MICRO = 3, 2


class _Pair:
    """A stand-in for a two-rank ``Group``: reduce_amax issues one collective on it."""

    handle, size = object(), 2


class _Counting:
    """Collectives that count MAX all-reduces (over one process's values: the identity)."""

    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, tensor, op=None, group=None):
        self.calls += 1


def _run(layers: int, batched: bool) -> tuple[list[int], list, list]:
    """Collectives issued in each step, the final weights' gradients and every amax history."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=4)
    be, coll, groups = get_backend("cpu"), _Counting(), (_Pair(),)
    reducer = AmaxReducer(groups, coll) if batched else None
    exs = [FP8Linear(cfg, be.fp8, amax_groups=groups, collectives=coll, reducer=reducer) for _ in range(layers)]
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(16, 16, generator=g) * 0.2).requires_grad_() for _ in range(layers)]
    per_step = []
    for step in range(STEPS):
        before = coll.calls
        for mb in range(MICRO):
            h = torch.randn(8, 16, generator=g) * (1 + step + mb)
            for ex, w in zip(exs, ws):
                h = torch.tanh(ex(h, w, None))
            h.square().sum().backward()
        per_step.append(coll.calls - before)
    hist = [ex.states[r].amax_history.clone() for ex in exs for r in ex.states]
    return per_step, [w.grad for w in ws], hist


@pytest.mark.parametrize("layers", [2, 6])
def test_amax_collectives_per_step_do_not_depend_on_the_layer_count(layers):
    """After the first step (whose first uses scale from their own amax, one reduction each): one batched
    reduction per micro-batch, taken where its backward first needs the previous use's amaxes -- MICRO per
    step at any depth, where reducing each amax when taken costs 3 per layer and micro-batch. Gradients and
    amax histories equal the per-use path's bit for bit (the max of a stack is the stack of the maxes)."""
    counts, grads, hist = _run(layers, batched=True)
    ref_counts, ref_grads, ref_hist = _run(layers, batched=False)
    assert counts[1:] == [MICRO] * (STEPS - 1), counts
    assert ref_counts[1:] == [3 * layers * MICRO] * (STEPS - 1), ref_counts
    for a, b in zip(grads + hist, ref_grads + ref_hist):
        assert torch.equal(a, b)
