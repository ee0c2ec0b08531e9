"""The backend's kernel table picks the fast implementations and falls back, with the reason,
when a call breaks a precondition (never by dropping an argument)."""
from __future__ import annotations

import logging

import os

import pytest
import torch

from omnitron.kernels import implementations

CPP_OPS = ("rms_norm", "layer_norm", "swiglu", "geglu", "rope", "softmax_cross_entropy", "adamw_step", "grad_norm_sq")


def test_cpu_table_prefers_cpp(backend):
    if backend.name != "cpu":
        pytest.skip("CPU preference order")
    if os.environ.get("OMNITRON_KERNELS"):
        pytest.skip("OMNITRON_KERNELS overrides the preference order")
    ok, why = implementations("rms_norm")["cpp"].available()
    if not ok:
        pytest.skip(f"C++ kernels unavailable: {why}")
    for op in CPP_OPS:
        assert backend.kernels.resolved(op) == "cpp", op
    assert backend.kernels.resolved("fp8_cast_transpose_amax") == "reference"  # no CPU version: reference


def test_declined_call_falls_back_with_reason(backend, caplog):
    """GeGLU with exact (erf) GeLU is not what the fused kernels compute: the reference must run."""
    x = torch.randn(3, 10, device=backend.current_device())
    backend.kernels.get("geglu")._said.clear()  # logged once per reason: the conformance suite may have logged it
    with caplog.at_level(logging.INFO, logger="omnitron.kernels"):
        got = backend.kernels.geglu(x, None, approximate="none")
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(got, torch.nn.functional.gelu(a) * b)
    if backend.kernels.resolved("geglu") != "reference":
        assert "approximate='none'" in caplog.text


def test_swiglu_bias_is_applied(backend):
    """A bias must change the result on every implementation (the MUSA-port pitfall)."""
    x = torch.randn(4, 16, device=backend.current_device())
    bias = torch.randn(16, device=backend.current_device())
    a, b = (x + bias).chunk(2, -1)
    torch.testing.assert_close(backend.kernels.swiglu(x, bias), torch.nn.functional.silu(a) * b)


def test_bad_target_is_a_clear_error(backend):
    logits = torch.randn(2, 5, device=backend.current_device())
    with pytest.raises((IndexError, RuntimeError), match=r"(?i)target|index|out of bounds"):
        backend.kernels.softmax_cross_entropy(logits, torch.tensor([1, 7], device=logits.device), 0.0)


def test_rope_with_trainable_freqs_falls_back(backend):
    """The fused ropes differentiate w.r.t. t only; trainable angles must reach the reference."""
    device = backend.current_device()
    t = torch.randn(4, 2, 3, 8, device=device, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 4, device=device, requires_grad=True)
    out = backend.kernels.rope(t, freqs)
    (g,) = torch.autograd.grad(out.square().sum(), freqs)
    assert g is not None and g.abs().sum() > 0


def _cpu_table(monkeypatch, preference):
    """A fresh CPU kernel table (its own dispatchers, nothing logged yet) under ``preference``, the C++ kernels
    required."""
    from omnitron.kernels.registry import KernelTable

    monkeypatch.delenv("OMNITRON_KERNELS", raising=False)
    ok, why = implementations("rms_norm")["cpp"].available()
    if not ok:
        pytest.skip(f"C++ kernels unavailable: {why}")
    return KernelTable("cpu", preference)


def test_reference_in_the_order_ends_the_search(monkeypatch):
    """A preference order with the reference before cpp (``OMNITRON_KERNELS=reference,cpp``): every op resolves to
    its reference, the names after it are never tried, and a call runs the reference."""
    from omnitron.kernels.registry import ops

    table = _cpu_table(monkeypatch, ("reference", "cpp"))
    assert {op: table.resolved(op) for op in ops()} == {op: "reference" for op in ops()}
    x, w = torch.randn(3, 8), torch.randn(8)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-5), x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * w)
    assert table.get("rms_norm").ran == {"reference": 1}


def test_a_declined_call_is_logged_once_per_reason(monkeypatch, caplog):
    """Three calls the C++ GeGLU declines for one reason (exact GeLU) log one line; a call declined for another
    reason (float64) logs its own; each runs the reference."""
    table = _cpu_table(monkeypatch, ("cpp", "reference"))
    with caplog.at_level(logging.INFO, logger="omnitron.kernels"):
        for _ in range(3):
            table.geglu(torch.randn(2, 6), None, approximate="none")
        table.geglu(torch.randn(2, 6, dtype=torch.float64), None)
    said = [r.getMessage() for r in caplog.records if "declined" in r.getMessage()]
    assert len(said) == 2 and "approximate='none'" in said[0] and "float64" in said[1], said
    assert table.get("geglu").ran == {"reference": 4}


@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm"])
def test_a_residual_of_another_dtype_goes_to_the_reference(monkeypatch, op):
    """The C++ fused residual norms take a residual of x's dtype only: a bf16 x with an fp32 residual (an fp32
    residual stream) is declined to the reference instead of raising in C++. ``h`` is the promoted sum (exact:
    bf16 widens to fp32 exactly, one fp32 rounding in the add, as torch's own ``x + residual``); the norm of h
    against float64: fp32 statistics over 64 elements err by ~64 u ~ 4e-6 relatively, 1e-4 leaves 25x."""
    table = _cpu_table(monkeypatch, ("cpp", "reference"))
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64)
    w, b = torch.randn(64), torch.randn(64)
    args = (x, residual, w) if op == "add_rms_norm" else (x, residual, w, b)
    y, h = getattr(table, op)(*args, 1e-5)
    assert torch.equal(h, x + residual)
    hd = h.double()
    if op == "add_rms_norm":
        want = hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + 1e-5) * w.double()
    else:
        want = (hd - hd.mean(-1, keepdim=True)) / torch.sqrt(hd.var(-1, unbiased=False, keepdim=True) + 1e-5)
        want = want * w.double() + b.double()
    torch.testing.assert_close(y.double(), want, atol=1e-4, rtol=1e-4)
    assert table.get(op).ran == {"reference": 1}
