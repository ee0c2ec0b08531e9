"""Conformance: every kernel implementation a backend resolves matches the reference, forward and
backward, on fresh random inputs (the seed is printed on failure), in fp32 and bf16.

bf16 results are compared with the reference run in fp32 on the same (bf16-valued) inputs, so a
shared rounding mistake cannot hide. Each implementation must accept at least one case: an
implementation that declines everything would otherwise pass untested.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.kernels.cases import Case, cases
from omnitron.kernels.registry import REFERENCE, get_impl, implementations, ops

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
GRAD_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=8e-2, rtol=8e-2)}


def resolved_impls(be, op: str) -> list:
    """Non-reference implementations of ``op`` this backend would try, usable here, best first."""
    be.kernels  # building the table registers the backend's own implementations
    impls, found = implementations(op), []
    for name in be.kernel_preference():
        if name == REFERENCE:
            break
        impl = impls.get(name)
        if impl is None or (impl.backends is not None and be.name not in impl.backends):
            continue
        if impl.available()[0]:
            found.append(impl)
    return found


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _run(fn, case: Case, upcast: bool = False):
    """``fn`` on fresh copies of the case's inputs (float32 copies if ``upcast``): (args, kwargs, out)."""
    args, kwargs = case.copy(_upcast if upcast else None)
    return args, kwargs, fn(*args, **kwargs)


def _grad_of(args: tuple, kwargs: dict, key):
    return (args[key] if isinstance(key, int) else kwargs[key]).grad


def _compare(impl, case: Case, dtype: torch.dtype, where: str) -> None:
    ref = get_impl(impl.op, REFERENCE)
    got_args, got_kw, got = _run(impl.fn, case)
    ref_args, ref_kw, want = _run(ref, case, upcast=dtype != torch.float32)
    tol, gtol = TOL[dtype], GRAD_TOL[dtype]
    for i in case.inplace:
        for g, w in zip(got_args[i], ref_args[i]):
            torch.testing.assert_close(g.float(), w.float(), **tol, msg=lambda m: f"{where}: arg {i} in place: {m}")
    if case.inplace:
        return
    _, _, same_dtype = _run(ref, case)
    outs, wants, dts = _as_tuple(got), _as_tuple(want), _as_tuple(same_dtype)
    assert len(outs) == len(wants), f"{where}: {len(outs)} outputs, reference gives {len(wants)}"
    for i, (g, w, d) in enumerate(zip(outs, wants, dts)):
        assert g.dtype == d.dtype, f"{where}: output {i} dtype {g.dtype}, reference gives {d.dtype}"
        exact = g.dtype.itemsize == 1 and g.is_floating_point()  # FP8 casts round the same values the same way
        ftol = dict(atol=0, rtol=0) if exact else dict(tol, atol=tol["atol"] + case.sum_atol)
        torch.testing.assert_close(g.float(), w.float(), **ftol,
                                   equal_nan=True, msg=lambda m: f"{where}: forward output {i}: {m}")
    if not case.grad:
        return
    cots = [torch.randn(g.shape, device=g.device, dtype=torch.float32) for g in outs]
    sum((g.float() * c).sum() for g, c in zip(outs, cots)).backward()
    sum((w.float() * c).sum() for w, c in zip(wants, cots)).backward()
    for i in case.grad:
        g, w = _grad_of(got_args, got_kw, i), _grad_of(ref_args, ref_kw, i)
        assert g is not None, f"{where}: no gradient for argument {i}"
        torch.testing.assert_close(g.float(), w.float(), **gtol, msg=lambda m: f"{where}: grad of arg {i}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("op", ops())
def test_kernel_implementations_match_reference(suite_backend, op, dtype):
    be = suite_backend
    impls = resolved_impls(be, op)
    if not impls:
        pytest.skip(f"{be.name} resolves {op} to the reference only")
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    made = cases(op, be.device(), dtype)
    assert made, (f"{be.name} resolves {op} to {[i.name for i in impls]} but there are no input cases: add them "
                  "to omnitron/kernels/cases.py (OPS)")
    for impl in impls:
        for case in made:
            if case.long_sums and dtype != torch.float32:
                continue  # a fixed GRAD_TOL cannot judge a bf16 sum of 300 rows; test_conformance.py bounds it
            if impl.supports is None or impl.supports(*case.args, **case.kwargs) is None:
                _compare(impl, case, dtype, f"{be.name}/{op}/{impl.name}/{case.label}/{dtype} (seed {seed})")


def test_each_implementation_accepts_some_case(suite_backend):
    """An implementation that declines every case would pass the comparison untested."""
    be = suite_backend
    for op in ops():
        for impl in resolved_impls(be, op):
            reasons = []
            for dtype in (torch.float32, torch.bfloat16):
                for case in cases(op, be.device(), dtype) or []:
                    why = impl.supports(*case.args, **case.kwargs) if impl.supports is not None else None
                    if why is None:
                        break
                    reasons.append(f"{case.label}/{dtype}: {why}")
                else:
                    continue
                break
            else:
                raise AssertionError(f"{be.name}: {op}/{impl.name} declined every case: {reasons}")


@pytest.mark.parametrize("op", ops())
def test_dispatch_runs_the_resolved_table(suite_backend, op):
    """``backend.kernels.<op>`` runs the first accepting implementation correctly (against the
    reference). Where the table runs the reference itself the comparison would be of the reference
    with itself: skipped, the reference's accuracy is tests/kernels/test_conformance.py's (against float64)."""
    be = suite_backend
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    chosen = be.kernels.resolved(op)
    assert chosen == REFERENCE or chosen in be.kernel_preference(), (op, chosen)
    made = cases(op, be.device(), torch.float32)
    if not made:
        pytest.skip(f"no input cases for {op} (test_kernel_implementations_match_reference reports it when it matters)")
    case = made[0]
    runs = next((c for c in be.kernels.get(op).candidates
                 if c.supports is None or c.supports(*case.args, **case.kwargs) is None), None)
    if runs is None:
        pytest.skip(f"{be.name} runs the reference for {op} ({case.label}): it would be compared with itself")
    args, kwargs = case.copy(grad=False)
    out = getattr(be.kernels, op)(*args, **kwargs)
    ref_args, ref_kwargs = case.copy(grad=False)
    want = get_impl(op, REFERENCE)(*ref_args, **ref_kwargs)
    if case.inplace:  # compare the first updated tensor
        out, want = args[case.inplace[0]][0], ref_args[case.inplace[0]][0]
    for o, w in zip(_as_tuple(out), _as_tuple(want)):
        tol = TOL[torch.float32]
        torch.testing.assert_close(o.float(), w.float(), rtol=tol["rtol"], atol=tol["atol"] + case.sum_atol,
                                   msg=lambda m: f"{be.name}/{op} ({runs.name}): {m}")
