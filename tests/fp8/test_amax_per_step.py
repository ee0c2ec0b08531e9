"""Delayed scaling with one packed amax reduction per optimizer step (``AmaxReducer(per_step=True)``).

Reference, independent of the reducer: every use's local amax is taken by the test itself (``max |x|`` of the
input and the weight it passes, ``max |g|`` of the output gradient caught by a hook); a role's step amax is the
max over the step's uses and over the ranks; its history after step k is ``[a_k, ..., a_1, 0, ...]`` and the
scale ``fp8_max / max(history)``, in float32 (the one rounding of a float32 division: compared to 1 ulp).
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.precision.fp8 import FP8Config, FP8Linear
from omnitron.core.precision.fp8.scaling import AmaxReducer
from omnitron.testing.distributed import run_distributed

STEPS, MICRO, HIST = 3, 2, 4
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
ROLE_FMT = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}  # hybrid


class _Pair:
    """A stand-in for a two-rank group: reduce_amax issues one collective on it."""

    handle, size = object(), 2


class _Counting:
    """Collectives that count MAX all-reduces; over one process's values the identity, else delegated."""

    def __init__(self, inner=None) -> None:
        self.calls, self.inner = 0, inner

    def all_reduce(self, tensor, op=None, group=None):
        self.calls += 1
        if self.inner is not None:
            self.inner.all_reduce(tensor, op=op, group=group)


def _train(layers: int, groups: tuple, coll, seed: int) -> tuple[list[int], list[dict], list[list[dict]]]:
    """(collectives per step, each layer's local step amaxes per step, each layer's scales after each step)."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=HIST, fp8_amax_compute_algo="max")
    be = get_backend("cpu")
    reducer = AmaxReducer(groups, coll, per_step=True)
    exs = [FP8Linear(cfg, be.fp8, amax_groups=groups, collectives=coll, reducer=reducer) for _ in range(layers)]
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(16, 16, generator=g) * 0.2).requires_grad_() for _ in range(layers)]
    counts, amaxes, scales = [], [], []
    for step in range(STEPS):
        before, seen = coll.calls, [{r: 0.0 for r in ROLE_FMT} for _ in exs]
        for mb in range(MICRO):
            h = torch.randn(8, 16, generator=g) * (1 + step + 2 * mb)
            for i, (ex, w) in enumerate(zip(exs, ws)):
                seen[i]["input"] = max(seen[i]["input"], h.abs().max().item())
                seen[i]["weight"] = max(seen[i]["weight"], w.abs().max().item())
                y = ex(h, w, None)
                y.register_hook(lambda gy, i=i: seen[i].__setitem__(
                    "grad_output", max(seen[i]["grad_output"], gy.abs().max().item())))
                h = torch.tanh(y)
            h.square().sum().backward()
        reducer.step()
        with torch.no_grad():
            for w in ws:
                w -= 0.05 * w.grad
                w.grad = None
        counts.append(coll.calls - before)
        amaxes.append(seen)
        scales.append([{r: ex.states[r].scale.item() for r in ROLE_FMT} for ex in exs])
    return counts, amaxes, scales


def _reference_scales(per_rank_amaxes: list[list[dict]]) -> list[list[dict]]:
    """Scales after each step from the ranks' local step amaxes ([rank][step][layer][role])."""
    steps, layers = len(per_rank_amaxes[0]), len(per_rank_amaxes[0][0])
    out, history = [], [{r: [] for r in ROLE_FMT} for _ in range(layers)]
    for k in range(steps):
        row = []
        for i in range(layers):
            row.append({})
            for r, fmt in ROLE_FMT.items():
                a = max(ranks[k][i][r] for ranks in per_rank_amaxes)
                history[i][r] = ([a] + history[i][r])[:HIST]
                amax = torch.tensor(max(history[i][r]), dtype=torch.float32)
                row[i][r] = (torch.tensor(FP8_MAX[fmt], dtype=torch.float32) / amax).item()
        out.append(row)
    return out


def _assert_scales(got: list[list[dict]], want: list[list[dict]]) -> None:
    for k, (g_step, w_step) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_step, w_step)):
            for r in ROLE_FMT:
                assert g[r] == pytest.approx(w[r], rel=2 ** -23), (k, i, r)


@pytest.mark.parametrize("layers", [2, 6])
def test_one_amax_collective_per_step_whatever_the_layers_and_micro_batches(layers):
    """Every step, step 1 included, issues exactly one (packed) reduction: step 1's first uses scale from their
    own local amaxes without a collective. Scales equal the reference from the local amaxes."""
    coll = _Counting()
    counts, amaxes, scales = _train(layers, (_Pair(),), coll, seed=0)
    assert counts == [1] * STEPS, counts
    _assert_scales(scales, _reference_scales([amaxes]))


def _rank(layers: int) -> tuple[list[int], list, list]:
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend("cpu")
    groups = ParallelGroups.build(ParallelConfig(), backend=be)  # dp2: the amax group is the data-parallel one
    coll = _Counting(be.collectives)
    return _train(layers, (groups.dp,), coll, seed=groups.rank)  # each rank sees different data and weights


def test_two_ranks_scale_from_the_max_of_both_ranks_amaxes():
    """Over gloo (dp2, different inputs per rank): one all-reduce per step from step 1 on, and every rank's
    scales equal the reference computed from both ranks' local step amaxes (step 1's local scales included)."""
    results = run_distributed(_rank, 2, 2)
    want = _reference_scales([amaxes for _, amaxes, _ in results])
    for counts, _, scales in results:
        assert counts == [1] * STEPS, counts
        _assert_scales(scales, want)


def test_a_role_unused_in_a_step_keeps_its_history_and_scale():
    """The step pushes every registered role's history on the device (no host sync to ask which were used): one
    left unused in a step keeps its history and scale bit for bit, a used one takes the step's amax (exact: a max
    of floats) and its scale follows."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=HIST, fp8_amax_compute_algo="max")
    be = get_backend("cpu")
    reducer = AmaxReducer((), None, per_step=True)
    used, unused = (FP8Linear(cfg, be.fp8, reducer=reducer) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(16, 16, generator=g).requires_grad_(), torch.randn(8, 16, generator=g)
    for ex in (used, unused):
        ex(x, w, None).sum().backward()
    reducer.step()
    before = {r: (s.amax_history.clone(), s.scale.clone()) for r, s in unused.states.items()}
    x2 = torch.randn(8, 16, generator=g) * 3
    used(x2, w, None).sum().backward()
    reducer.step()
    for r, s in unused.states.items():
        assert torch.equal(s.amax_history, before[r][0]) and torch.equal(s.scale, before[r][1]), r
    hist = used.states["input"].amax_history
    assert hist[0].item() == x2.abs().max().item() and hist[1].item() == x.abs().max().item()
    assert used.states["input"].scale.item() == pytest.approx(448.0 / hist.max().item(), rel=2 ** -23)


def test_a_nan_step_amax_is_pushed_as_a_per_use_push_does():
    """A NaN step amax (a NaN in a tensor) enters the history, as the per-use update (``fp8_amax_history_push``)
    pushes it, and the scale stays (a NaN amax gives no scale): hand-derived, ``history' = [nan, h0, .., h(L-2)]``,
    ``scale' = scale``. The step's other role, with a finite amax, is pushed beside it as usual."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=HIST, fp8_amax_compute_algo="max")
    reducer = AmaxReducer((), None, per_step=True)
    ex = FP8Linear(cfg, get_backend("cpu").fp8, reducer=reducer)
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    w = torch.randn(16, 16, generator=g).requires_grad_()
    x = torch.randn(8, 16, generator=g)
    ex(x, w, None).sum().backward()
    reducer.step()
    s = ex.states["input"]
    hist, scale = s.amax_history.clone(), s.scale.clone()
    x2 = torch.randn(8, 16, generator=g)
    x2[1, 2] = float("nan")
    ex(x2, w, None).sum().backward()
    reducer.step()
    assert math.isnan(s.amax_history[0].item()) and torch.equal(s.amax_history[1:], hist[:-1])
    assert torch.equal(s.scale, scale) and torch.equal(s.scale_inv, scale.reciprocal())
    from omnitron.kernels.reference.fp8 import fp8_amax_history_push

    h1, s1, _ = fp8_amax_history_push(hist, torch.tensor(float("nan")), scale, "e4m3", 0, "max")
    assert torch.equal(h1.isnan(), s.amax_history.isnan()) and torch.equal(h1[1:], s.amax_history[1:])
    assert torch.equal(s1, s.scale)
    wh = ex.states["weight"].amax_history
    assert wh[0].item() == w.abs().max().item() and wh[1].item() == w.abs().max().item()
