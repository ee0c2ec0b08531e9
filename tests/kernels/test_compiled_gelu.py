"""The tanh-approximated GeLU as a compiled layer runs it (:func:`omnitron.kernels.reference.activations.gelu_tanh`):
written as ``x sigmoid(2 k (x + 0.044715 x^3))`` under ``torch.compile``, it is still GeLU's tanh approximation,
value and gradients, against that formula in float64."""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.kernels.reference.activations import bias_gelu

EPS = torch.finfo(torch.float32).eps
TINY = torch.finfo(torch.float32).tiny
K = math.sqrt(2.0 / math.pi)


def _reference(y: torch.Tensor):
    """float64: the value ``0.5 y (1 + tanh z)``, ``z = k (y + 0.044715 y^3)``, its derivative's two terms
    ``s = sigmoid(2 z)`` and ``y s (1 - s) 2 dz/dy`` (the derivative is their sum), and ``z``. ``1 + tanh z``
    is evaluated as ``2 / (1 + exp(-2 z))``, its value without the cancellation: in the negative tail (``y < -6``)
    float64's ``1 + tanh z`` rounds to 0 where fp32 still holds the true value."""
    z = K * (y + 0.044715 * y ** 3)
    s = 1 / (1 + torch.exp(-2 * z))
    assert torch.allclose(1 + torch.tanh(z[z > -5]), 2 * s[z > -5], rtol=1e-12)  # the identity, where both hold
    return y * s, s, y * s * (1 - s) * 2 * K * (1 + 3 * 0.044715 * y ** 2), z


def _compiled(compiler: str, seen: list[str]):
    """``bias_gelu`` through ``torch.compile`` with ``compiler`` (``inductor``: the C++ code a compiled layer runs on
    cpu; ``aot_eager``: the same traced graph run by eager ops), recording the traced graph's ops in ``seen``."""
    from torch._dynamo.backends.registry import lookup_backend

    def record(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return lookup_backend(compiler)(gm, example_inputs)

    return torch.compile(bias_gelu, backend=record, fullgraph=True)


@pytest.mark.parametrize("compiler", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_bias_gelu_is_the_tanh_approximation(compiler):
    """Error analysis, fp32 (unit roundoff ``EPS / 2``):
    - ``z`` is ``y`` through about four roundings: ``|dz| <= 4 EPS |z|``; ``sigmoid(2 z)`` moves by
      ``(1 - s) 2 |dz|`` relatively, plus its own exp, add and divide (3 EPS); the product with ``y`` one more.
      Value: ``|err| <= EPS (4 + 8 |z|) |ref|``.
    - the derivative is ``s + y s (1 - s) 2 z'``; each term carries at most ``EPS (8 + 8 |z|)`` relative error
      (the second is a product of the first's factors and ``z'``), so the absolute error is bounded by that times
      the sum of the terms' magnitudes (they cancel near ``y = -0.75``, where a relative bound means nothing);
      times the incoming gradient ``g``, one more rounding.
    - the bias gradient sums ``n`` such products over the rows: plus ``n EPS`` times the sum of their magnitudes
      (recursive summation's bound).
    - fp32's range: past ``-2 z = 88.7`` the exp overflows and ``sigmoid(2 z)`` is 0 where the true value is below
      ``TINY = 2^-126`` (fp32's least normal): ``TINY |y|`` more on the value, ``TINY (1 + 2 |y z'|)`` times ``g``
      on the derivative.
    Inputs span where GeLU is curved and its tails (``|y|`` up to 12), on fresh random values. ``inductor`` (the
    code a compiled layer runs on cpu; its C++ build takes 8-18 s on 2 cores) is slow-marked; ``aot_eager`` checks
    the traced graph with eager ops."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    n, f = 256, 96
    x = (torch.randn(n, f, generator=gen) * 4).clamp(-12, 12).requires_grad_()
    b = (torch.randn(f, generator=gen) * 0.5).requires_grad_()
    g = torch.randn(n, f, generator=gen)
    seen: list[str] = []
    out = _compiled(compiler, seen)(x, b)
    out.backward(g)
    assert any("sigmoid" in t for t in seen) and not any("gelu" in t or "tanh" in t for t in seen), seen

    y = x.detach().double() + b.detach().double()
    ref, s, second, z = _reference(y)
    assert ((out.detach().double() - ref).abs() <= EPS * (4 + 8 * z.abs()) * ref.abs() + TINY * y.abs()).all()
    d, gd, dz = s + second, g.double(), K * (1 + 3 * 0.044715 * y ** 2)
    bound = (EPS * (8 + 8 * z.abs()) * (s.abs() + second.abs()) * gd.abs() + EPS * (d * gd).abs()
             + TINY * (1 + 2 * (y * dz).abs()) * gd.abs())
    assert ((x.grad.double() - d * gd).abs() <= bound).all()
    bias_bound = bound.sum(0) + n * EPS * (d * gd).abs().sum(0)
    assert ((b.grad.double() - (d * gd).sum(0)).abs() <= bias_bound).all()


def test_eager_bias_gelu_is_one_kernel():
    """Outside the compiler the activation stays ``F.gelu``: one kernel and one tensor saved for the backward,
    where the sigmoid form would run and save several."""
    x = torch.randn(64, 32, requires_grad=True)
    out = bias_gelu(x, None)
    assert "Gelu" in type(out.grad_fn).__name__
