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
