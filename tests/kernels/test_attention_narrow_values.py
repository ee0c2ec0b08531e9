"""The reference attention kernel with a value head narrower than the query/key head (MLA's shape): on the CPU it
zero-pads the values to run SDPA's flash kernel and trims the output. Output and every gradient against a direct
float64 softmax(q k^T * scale) v on fresh random inputs, causal and not, with and without grouped-query heads."""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.kernels.reference.attention import attention


def direct(q, k, v, causal: bool, scale: float):
    """float64 attention written out: scores, causal mask, softmax, weighted sum (GQA by repeating kv heads)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_narrow_values_equal_direct_float64(causal, hq, hkv):
    torch.manual_seed(torch.seed() % 2**31)
    b, s, dqk, dv = 2, 67, 48, 32
    q = torch.randn(b, hq, s, dqk, requires_grad=True)
    k = torch.randn(b, hkv, s, dqk, requires_grad=True)
    v = torch.randn(b, hkv, s, dv, requires_grad=True)
    scale = 1 / math.sqrt(dqk)
    out = attention(q, k, v, causal=causal, scale=scale)
    assert out.shape == (b, hq, s, dv)
    grad = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = direct(*ref_in, causal, scale)
    rq, rk, rv = torch.autograd.grad(ref, ref_in, grad.double())
    # Error analysis (fp32, eps = 6e-8): a score is a 48-term dot product of N(0,1) entries times 1/sqrt(48), so
    # |score| < ~6 and its rounding error ~48 eps |q||k| scale ~ 2e-5 at worst; softmax carries it as a relative
    # error of the weights, and each output (a weighted mean of |v| < ~5) moves by < 5 * 2e-5 = 1e-4 plus the sum's
    # own rounding (s eps |v| ~ 2e-5). Gradients go through the same weights times |grad| < ~5 and sums over s
    # (67) terms: < 67 * 5 * 2e-5 * 5 / sqrt(67) ~ 4e-3 absolute, relative to their scale (~10) 4e-4. A wrong pad
    # (values shifted into the trimmed columns, a mask dropped) moves them by O(1).
    assert (out.double() - ref).abs().max() < 1.5e-4
    for got, want in ((gq, rq), (gk, rk), (gv, rv)):
        assert ((got.double() - want).abs().max() / want.abs().max()) < 5e-4
