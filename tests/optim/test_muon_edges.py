"""Muon's per-parameter switches against test_muon.py's float64 reference, a float64 model in one process:
a matrix marked ``use_muon = False`` takes the AdamW step (the reference's AdamW branch for that matrix), and
``--muon-extra-scale-factor`` multiplies every orthogonalised update (the reference's scale times the factor).

Bound: test_muon.py's LAYOUT_ATOL analysis (the engine and the reference differ in the order of float64 sums only,
~1.2e-11 over four steps at scale factor 1); the factor 2.5 here scales the Muon steps and so that figure to 3e-11,
and the AdamW steps of a plain matrix add no more than the other AdamW parameters do: LAYOUT_ATOL (1e-10) holds.
"""
from __future__ import annotations

import math

import pytest
import torch

import test_muon as tm


def _run(**cfg) -> list[dict]:
    """STEPS float64 steps of the plain Muon on the toy of test_muon.py."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups

    groups, be = ParallelGroups.single(), get_backend("cpu")
    ddp, opt = tm.build(groups, be, distributed=False, init=tm.full_init(), dtype=torch.float64, **cfg)
    history = []
    for s in range(tm.STEPS):
        tm.step(ddp, opt, groups, s)
        history.append(tm.full_params(ddp.module, groups))
    return history


def test_a_matrix_marked_use_muon_false_takes_the_adamw_step(monkeypatch):
    monkeypatch.setitem(tm.PARAMS, "dense", ((6, 8), -1, 1, "adamw"))  # the reference's AdamW branch (2-D: decayed)
    real = tm.Toy

    def toy(*args, **kwargs):
        model = real(*args, **kwargs)
        model.dense.use_muon = False
        return model

    monkeypatch.setattr(tm, "Toy", toy)
    got = _run()
    tm._compare(got, tm.reference(tm.full_init(), tm._mean_grads(1)), "use_muon False", tm.LAYOUT_ATOL)


def test_the_extra_scale_factor_multiplies_every_orthogonalised_update(monkeypatch):
    factor = 2.5
    monkeypatch.setitem(tm.SCALES, "spectral", lambda m, n: factor * math.sqrt(max(m, n)))
    got = _run(muon_extra_scale_factor=factor)
    tm._compare(got, tm.reference(tm.full_init(), tm._mean_grads(1)), "extra scale", tm.LAYOUT_ATOL)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)], ids=["tall", "wide"])
@pytest.mark.parametrize("dtype, bf16", [(torch.float32, False), (torch.float64, False), (torch.float32, True)])
def test_a_zero_matrix_orthogonalises_to_zero(shape, dtype, bf16):
    """A matrix whose momentum is all zero (no gradient yet, a frozen row block's share) gets a zero update, not
    NaN: the norm it is divided by is floored (NORM_EPS, 1e-7). A tiny one (norm below the floor) is divided by the
    floor, so it stays tiny and finite (five quintic steps grow it by at most ~4^5), not blown up to unit norm."""
    from omnitron.core.optim.newton_schulz import coefficient_schedule, orthogonalize

    coeffs = coefficient_schedule("quintic", 5)
    out = orthogonalize(torch.zeros(shape, dtype=dtype), coeffs, bf16=bf16)
    assert out.dtype == dtype and out.shape == shape and torch.equal(out, torch.zeros(shape, dtype=dtype))
    tiny = orthogonalize(torch.full(shape, 1e-30, dtype=dtype), coeffs, bf16=bf16)
    assert torch.isfinite(tiny).all() and tiny.abs().max() < 1e-15  # 1e-30 / 1e-7 x O(1) polynomial
