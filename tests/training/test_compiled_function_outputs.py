"""Compiled ``autograd.Function``s whose float32 forward ended in a no-op cast keep their gradients.

torch 2.11's dynamo gave a zero gradient to an ``autograd.Function`` output made by ``t.to(t.dtype)`` (an op that
returns its input; omnitron/kernels/function_output.py): compiled float32 FP8 GEMMs (the emulation) on 2-D inputs
and the blocked attention (cp1 with dropout, windows, sinks; every all-gather / all-to-all cp layout) returned
all-zero input gradients, eager and torch 2.13 the right ones. Each case here is traced with ``aot_eager`` (the
graphs dynamo and AOTAutograd build, run op by op) and its input gradients checked.
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.testing.parity import relative_error


def _grads(fn, compiled: bool, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Input gradients of ``fn(*inputs).square().sum()``, ``fn`` eager or compiled (aot_eager, one graph)."""
    torch._dynamo.reset()
    f = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    return list(torch.autograd.grad(f(*xs).square().sum(), xs))


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_compiled_fp8_linear_on_2d_input_has_the_eager_gradients(recipe):
    """A float32 FP8 linear on a 2-D input (no reshape after the GEMM), on the emulated GEMM path, compiled: the
    same quantizations and dequantized fp32 GEMMs as eager (tests/fp8 hold eager to float64 references), so only
    the order of fp32 sums may differ: ~sqrt(K) u = 16 x 6e-8 = 1e-6 relative, carried with condition ~1 through
    the square; 1e-5 leaves 10x. A lost tangent makes the gradients 0 (error 1)."""
    from omnitron.backends.fp8 import FP8Provider
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear

    be = get_backend()
    g = _seeded()
    x = torch.randn(128, 256, generator=g).to(be.device())
    w = (torch.randn(128, 256, generator=g) * 0.05).to(be.device())
    ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), FP8Provider(be))
    want = _grads(lambda x, w: ex(x, w, None), False, x, w)
    got = _grads(lambda x, w: ex(x, w, None), True, x, w)
    for gg, ww in zip(got, want):
        assert relative_error(gg, ww) < 1e-5


def _attention64(q, k, v, scale):
    """Causal softmax attention in float64, plain torch (the reference)."""
    s = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def test_compiled_blocked_attention_gradients_match_float64():
    """BlockedAttention (one causal tile, the reference kernel), float32, compiled: input gradients against plain
    causal attention in float64. fp32 rounding of scores, softmax and two GEMMs over s = 16, d = 8 gives ~1e-6
    relative (a few sqrt(n) u, u = 6e-8, condition of a softmax with O(1) scores ~ a few); 1e-4 leaves 100x.
    A lost tangent makes the gradients 0 (error 1)."""
    from omnitron.core.parallel.context.blocks import REFERENCE, BlockedAttention
    from omnitron.core.parallel.context.tiles import step_plan

    g = _seeded()
    q, k, v = (torch.randn(2, 2, 16, 8, generator=g) for _ in range(3))
    scale = 1 / math.sqrt(8)
    tiles = step_plan(0, 0, 1, 16, True, None, q.device)
    got = _grads(lambda q, k, v: BlockedAttention.apply(q, k, v, tiles, REFERENCE, scale, None, None), True, q, k, v)
    want = _grads(lambda q, k, v: _attention64(q, k, v, scale), False, q.double(), k.double(), v.double())
    for gg, ww in zip(got, want):
        assert relative_error(gg, ww) < 1e-4
