"""Every fast implementation given float64 inputs either declines them (the reference runs) or computes in float64.

A float64 model is the suite's exact reference (DESIGN rule 5: ~1e-12 between layouts, and against an independent
float64 model such as ``transformers``' with its float32 steps made float64); a fast kernel that takes float64
tensors but computes a step in float32 puts float32 rounding (~1e-7 relative) into every float64 result. Found by
comparing generation logits with ``transformers`` in float64: 7e-7 apart until the C++ rope (float32 cos/sin) was
pinned to the reference, then 4e-15. test_conformance.py checks the float32, bf16 and fp16 inputs only.

Bound: the conformance suite's fp32 derivation with float64's unit roundoff u = 2**-53 = 1.1e-16: sums of
n <= 5000 terms (sqrt(n) u = 70 u), ~2 ulp of a vectorised exp/tanh, a condition factor <= ~4 where signed terms
cancel: 335 u = 3.7e-14, as atol and rtol. A float32 step is off by ~6e-8 relative (a float32 constant: ~1e-9),
10^5 times the bound.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.kernels import get_impl, implementations
from omnitron.kernels.cases import OPS, cases

TOL = 335 * 2.0**-53
FAST = [pytest.param(op, name, id=f"{op}-{name}") for op, spec in OPS.items() if spec.float64
        for name in sorted(implementations(op)) if name != "reference"]


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _close(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float64, f"{label}: {got.dtype}, not float64"
    err = (got - want).abs()
    bad = ~(err <= TOL * (1 + want.abs()))
    assert not bad.any(), f"{label}: {int(bad.sum())}/{bad.numel()} off; worst {float(err.max()):.3g} (bound {TOL:.2g})"


@pytest.mark.parametrize("op,name", FAST)
def test_float64_is_declined_or_computed_in_float64(op, name):
    impl = implementations(op)[name]
    ok, why = impl.available()
    if not ok or (impl.backends is not None and "cpu" not in impl.backends):
        pytest.skip(f"{op}/{name} does not run on CPU tensors here: {why or impl.backends}")
    fn, ref = get_impl(op, name), get_impl(op, "reference")
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    ran = 0
    for case in cases(op, torch.device("cpu"), torch.float64):
        args, kwargs = case.args, case.mark_grad().kwargs
        if impl.supports is not None and impl.supports(*args, **kwargs) is not None:
            continue  # declined: the table runs the float64 reference
        leaves = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        outs, want = _tuple(fn(*args, **kwargs)), _tuple(ref(*args, **kwargs))
        for k, (o, w) in enumerate(zip(outs, want, strict=True)):
            if o.is_floating_point():
                _close(f"{op}/{name} [{case.label}] output {k}", o, w)
        ran += 1
        if not leaves:
            continue
        gos = [torch.randn_like(w) for w in want]
        got_g = torch.autograd.grad(outs, leaves, gos, allow_unused=True)
        want_g = torch.autograd.grad(want, leaves, gos, allow_unused=True)
        for i, (g, w) in enumerate(zip(got_g, want_g)):
            if w is not None:
                _close(f"{op}/{name} [{case.label}] grad {i}", g, w)
    if not ran:
        pytest.skip(f"{op}/{name} declines every float64 case (the reference runs them)")
