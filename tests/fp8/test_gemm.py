"""Scaled FP8 GEMMs (forward, data-grad, weight-grad) against float64, per recipe, with outliers.

The bound is derived, not tuned: each quantized element is within ``max(u*|v|, d/scale)`` of its
value (``u`` half an ulp, ``d`` half the smallest subnormal, ``scale`` that element's tile scale), so
``|A'B' - AB| <= |A| E_B + E_A |B| + E_A E_B`` elementwise, plus fp32 accumulation slack.
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.backends.fp8 import FP8Provider
from omnitron.core.precision.fp8 import FP8Config, FP8Linear

REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}


def _tile_scale(t: torch.Tensor, fmt: str, block) -> torch.Tensor:
    """Per-element quantization scale (float64): one scale per ``block`` tile, or per tensor when None."""
    t = t.double()
    if block is None:
        return torch.full_like(t, FMAX[fmt] / t.abs().max().item())
    m, k = t.shape
    out = torch.empty_like(t)
    for i in range(0, m, block[0]):
        for j in range(0, k, block[1]):
            tile = t[i:i + block[0], j:j + block[1]]
            amax = tile.abs().max().item()
            out[i:i + block[0], j:j + block[1]] = FMAX[fmt] / amax if amax > 0 else 1.0
    return out


def _err(t, fmt, scale):
    return torch.maximum(REL[fmt] * t.double().abs(), SUB[fmt] / scale)


def _mm_bound(a, ea, b, eb):
    a, b = a.double().abs(), b.double().abs()
    k = a.shape[1]
    return a @ eb + ea @ b + ea @ eb + 4 * k * 2.0 ** -24 * (a + ea) @ (b + eb)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, 256, generator=g)          # [s, b, in]
    x.view(-1)[torch.randint(0, x.numel(), (6,), generator=g)] *= 300.0   # activation outliers
    w = torch.randn(384, 256, generator=g) * 0.02    # [out, in]
    w.view(-1)[torch.randint(0, w.numel(), (4,), generator=g)] *= 100.0
    gy = torch.randn(8, 4, 384, generator=g) * 1e-3
    gy.view(-1)[torch.randint(0, gy.numel(), (4,), generator=g)] *= 50.0
    return x, w, torch.randn(384, generator=g) * 0.1, gy


def _run(recipe: str, fmt: str, seed: int, provider=None):
    cfg = FP8Config(fp8_recipe=recipe, fp8_format=fmt, fp8_amax_history_len=4)
    ex = FP8Linear(cfg, provider or get_backend().fp8)
    x, w, b, gy = _inputs(seed)
    if recipe == "delayed":  # seed the history with this distribution so the scale in force fits it
        for _ in range(2):
            xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
            ex(xx, ww, b).backward(gy)
        scales = {r: s.scale.clone() for r, s in ex.states.items()}
    else:
        scales = None
    xx, ww, bb = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
    y = ex(xx, ww, bb)
    y.backward(gy)
    return cfg, (x, w, b, gy), (y, xx.grad, ww.grad, bb.grad), scales


def _scale(t, fmt, block, recipe, scales, role):
    if recipe == "delayed":
        return torch.full_like(t.double(), scales[role].item())
    return _tile_scale(t, fmt, block)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_fp8_linear_within_bound_of_float64(recipe, fmt):
    cfg, (x, w, b, gy), (y, dx, dw, db), scales = _run(recipe, fmt, seed=11)
    fb = cfg.backward_format
    blk = recipe == "blockwise"
    x2, g2 = x.reshape(-1, 256), gy.reshape(-1, 384)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    # forward: x tiles 1x128, w blocks 128x128
    ex_ = _err(x2, "e4m3", _scale(x2, "e4m3", (1, 128) if blk else None, recipe, scales, "input"))
    ew = _err(w, "e4m3", _scale(w, "e4m3", (128, 128) if blk else None, recipe, scales, "weight"))
    ref = x2.double() @ w.double().t() + b.double()
    err = (y.reshape(-1, 384).double() - ref).abs()
    bound = _mm_bound(x2, ex_, w.t(), ew.t())
    assert bool((err <= bound).all()), f"forward over bound by {(err - bound).max():.3g}"
    # data-grad: g tiles 1x128 along out-features
    eg = _err(g2, fb, _scale(g2, fb, (1, 128) if blk else None, recipe, scales, "grad_output"))
    err = (dx.reshape(-1, 256).double() - g2.double() @ w.double()).abs()
    assert bool((err <= _mm_bound(g2, eg, w, ew)).all())
    # weight-grad: g^T tiles along tokens, x tiles 128x1 (along tokens)
    egt = _err(g2.t(), fb, _scale(g2.t(), fb, (1, 128) if blk else None, recipe, scales, "grad_output"))
    ext = _err(x2, "e4m3", _scale(x2, "e4m3", (128, 1) if blk else None, recipe, scales, "input"))
    err = (dw.double() - g2.double().t() @ x2.double()).abs()
    assert bool((err <= _mm_bound(g2.t(), egt, x2, ext)).all())
    torch.testing.assert_close(db.double(), g2.double().sum(0), rtol=1e-5, atol=1e-6)
    # and the result is an FP8 result, not a wide one: it differs from the exact product
    assert (y.reshape(-1, 384).double() - ref).abs().max() > 1e-4


def test_blockwise_beats_tensorwise_with_outliers():
    """The point of fine-grained scales: a few huge outliers no longer push every other value of the
    tensor into float8's subnormal range. Compared per output row (median relative error)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 256, generator=g)
    x[::97, 3] = 1e5  # a few outlier rows (LLM activations reach 1e3-1e5 times the bulk)
    w = torch.randn(384, 256, generator=g) * 0.02
    ref = x.double() @ w.double().t()

    def median_row_error(recipe):
        ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="e4m3"), get_backend().fp8)
        y = ex(x, w, None).double()
        return ((y - ref).norm(dim=1) / ref.norm(dim=1)).median().item()

    t, bl = median_row_error("tensorwise"), median_row_error("blockwise")
    assert bl < 0.08 and t > 3 * bl, (t, bl)


def test_scaled_mm_and_emulated_paths_agree(monkeypatch):
    """Both paths multiply the same float8 values with fp32 accumulation: results agree to fp32 rounding."""
    backend = get_backend()
    provs = {}
    for path in ("scaled_mm", "emulated"):
        monkeypatch.setenv("OMNITRON_FP8_PATH", path)
        provs[path] = FP8Provider(backend)
        assert provs[path].path == path
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(64, 96, generator=g) * 20).to(torch.float8_e4m3fn)
    bt = (torch.randn(48, 96, generator=g) * 20).to(torch.float8_e5m2)
    for sa, sb in ((torch.tensor(0.5), torch.tensor(3.0)),
                   (torch.rand(64, 1, generator=g), torch.rand(1, 48, generator=g))):
        ys = [provs[p].scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.float32) for p in provs]
        ref = (a.double() * sa.double()) @ (bt.double().t() * sb.double())
        for y in ys:
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for recipe in ("tensorwise", "blockwise"):
        outs = [_run(recipe, "hybrid", 9, provider=provs[p])[2] for p in provs]
        for t0, t1 in zip(*outs):
            torch.testing.assert_close(t0, t1, rtol=1e-5, atol=1e-6)


def test_bf16_inputs_give_bf16_outputs_and_autocast_is_respected():
    ex = FP8Linear(FP8Config(fp8_recipe="tensorwise"), get_backend().fp8)
    x, w, b, _ = _inputs(1)
    y = ex(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert y.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = ex(x, w, b)
    assert y2.dtype == torch.bfloat16
    # autocast must not have pushed the FP8 GEMM itself into bf16 accumulation
    y3 = ex(x.bfloat16(), w, b)
    torch.testing.assert_close(y2.float(), y3.float(), rtol=0, atol=0)
    assert math.isfinite(y.float().sum().item())


def test_scaled_mm_pads_unaligned_inner_and_output_dims(monkeypatch):
    """A k or n that is not a multiple of 16 (an MoE expert's token count in the weight-gradient GEMM)
    reaches ``torch._scaled_mm`` zero-padded to 16 and gives the unpadded product: zero codes add
    nothing, padded columns are cut off. No fall back to the emulation, no warning."""
    monkeypatch.setenv("OMNITRON_FP8_PATH", "scaled_mm")
    prov = FP8Provider(get_backend())
    seen = []
    real = torch._scaled_mm

    def spy(a, b, **kw):
        seen.append((tuple(a.shape), tuple(b.shape), b.stride(0)))
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    g = torch.Generator().manual_seed(4)
    for m, k, n in ((40, 37, 48), (33, 64, 20), (7, 5, 3)):
        a = (torch.randn(m, k, generator=g) * 10).to(torch.float8_e4m3fn)
        b = (torch.randn(n, k, generator=g) * 10).to(torch.float8_e5m2).t()  # column-major [k, n]
        sa, sb = torch.tensor(0.25), torch.tensor(2.0)
        y = prov.scaled_mm(a, b, sa, sb, out_dtype=torch.float32)
        ref = (a.double() * 0.25) @ (b.double() * 2.0)
        assert y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        (am, ak), (bk, bn), stride0 = seen[-1]
        assert ak % 16 == 0 and bk == ak and bn % 16 == 0 and stride0 == 1, seen[-1]
    assert len(seen) == 3  # every GEMM ran natively


@pytest.mark.parametrize("path", ["scaled_mm", "emulated"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_expert_with_no_tokens(recipe, path, monkeypatch):
    """An MoE expert that receives no tokens runs an FP8 linear over 0 rows (its amax reductions must still
    join): the output has 0 rows and the weight and bias gradients are exactly zero (an empty sum). Its
    GEMMs pad a size-0 dimension, which torch 2.9's ``F.pad`` rejects (``backends.fp8.zero_pad``)."""
    monkeypatch.setenv("OMNITRON_FP8_PATH", path)
    ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), FP8Provider(get_backend()))
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(24, 40, generator=g) * 0.1).requires_grad_()
    b = torch.randn(24, generator=g).requires_grad_()
    x = torch.randn(0, 40, generator=g).requires_grad_()
    for _ in range(2):  # delayed scaling: the second call uses the history the first one wrote
        y = ex(x, w, b)
        assert y.shape == (0, 24)
        y.sum().backward()
        assert x.grad.shape == (0, 40)
        assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
