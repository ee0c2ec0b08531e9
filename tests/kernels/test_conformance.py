"""Conformance: every usable implementation of every op against its reference in float64.

Forward output and every input gradient are compared with per-dtype tolerances
(``TOLERANCE``); outputs are poisoned (uninitialised memory filled with NaN) so an
unwritten element fails, and NaN never passes. Runs on the backend ``--backend`` selects: the
backend's resolved table (``table``) plus each registered implementation via ``get_impl``.
Triton implementations are usable on CPU only under ``TRITON_INTERPRET=1`` (see
test_triton_interpreter.py, which reruns this module in a subprocess with it set).
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.kernels import get_impl, implementations
from omnitron.kernels.cases import OPS, cases

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REQUIRED = set(filter(None, os.environ.get("OMNITRON_REQUIRE_IMPLS", "").split(",")))
FLOAT64_OPS = [op for op, spec in OPS.items() if spec.float64]
"""Ops whose cases (omnitron/kernels/cases.py, size "test") test_forward_backward checks; the
others have a dedicated test below."""

# (atol, rtol) against the float64 reference on the same (dtype-valued) inputs, per input dtype; the
# reference itself is held to exactly this bound (test_forward_backward), a fast version to this plus twice
# the reference's own error. Derivation, u = unit roundoff (fp32 2^-24 = 6.0e-8, fp16 2^-11 = 4.9e-4,
# bf16 2^-8 = 3.9e-3):
# * bf16/fp16: on its way from inputs to output a reference rounds to the storage dtype at most ~4 times
#   (bias add, activation, product, output cast; statistics and sums are accumulated in fp32, whose error
#   is negligible here), each <= u relative, and these ops are well conditioned away from the output's
#   zeros (relative condition <= ~1): rtol = 4u (bf16 1.6e-2, fp16 2e-3). Near a zero the relative bound
#   means nothing; atol = 4-5u covers the absolute error of inputs of order 1 (scale <= 3). Sums over rows
#   (weight gradients) cancel: _check adds rtol x the largest entry for them.
# * fp32: the error is the fp32 sums' (n <= 5000 terms: vocabulary rows, 1000-wide softmax, 300-row weight
#   gradients), which under the random-rounding model (Higham, Accuracy and Stability, sec. 4.2) grows as
#   sqrt(n) u relative to the partial sums: <= 70 u = 4.2e-6; plus ~2 ulp of a vectorised exp/tanh and a
#   condition factor of at most ~4 where signed terms cancel: 2e-5 (= 335 u) in rtol and atol.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}


def _impl_params(ops):
    params = []
    for op in ops:
        names = sorted(implementations(op)) + ["table"]
        params += [pytest.param(op, name, id=f"{op}-{name}") for name in names]
    return params


def _resolve(op, name, backend):
    """The callable under test; a direct implementation is wrapped so a call its ``supports``
    declines (e.g. a CPU kernel given device tensors) skips instead of running."""
    if name == "table":
        return backend.kernels.get(op)
    impl = implementations(op)[name]
    ok, why = impl.available()
    if not ok:
        if name in REQUIRED:
            pytest.fail(f"{op}/{name} required but unavailable: {why}")
        pytest.skip(f"{op}/{name} unavailable here: {why}")
    fn = get_impl(op, name)
    if impl.supports is None:
        return fn

    def checked(*args, **kwargs):
        reason = impl.supports(*args, **kwargs)
        if reason is not None:
            raise _Declined(reason)
        return fn(*args, **kwargs)
    return checked


class _Declined(pytest.skip.Exception):
    """The implementation's ``supports`` declined the call: a skip (with the reason), not a failure;
    the case loop of test_forward_backward catches it per case."""


def _to64(a):
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return a.detach().double().requires_grad_(a.requires_grad)
    return a


def _check(name, got, want, dtype, same_dtype_ref=None, sum_atol=0.0):
    """``|got - want| <= atol + rtol |want| + 2 |ref - want|`` elementwise, where ``want`` is the
    float64 reference and ``ref`` the reference run in ``dtype`` (an implementation may be off by
    twice the reference's own rounding error, e.g. a bias added in bf16 before a reduction); ``sum_atol``
    is a case's bound for long float32 sums (``Case.sum_atol``), added to ``atol``."""
    atol, rtol = TOLERANCE[dtype]
    atol = atol + sum_atol
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN in the output (unwritten or wrong element)"
    got, want = got.double(), want.double()
    bound = atol + rtol * want.abs()
    if dtype != torch.float32 and want.numel():
        # bf16/fp16: outputs summed over many rows (weight grads) cancel; one ulp of an input
        # (e.g. x + residual rounded differently) moves them by about rtol * the largest entry
        bound = bound + rtol * want.abs().amax()
    if same_dtype_ref is not None:
        bound = bound + 2 * (same_dtype_ref.double() - want).abs()
    err = (got - want).abs()
    bad = ~(err <= bound)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements off; first at flat index {i}: "
                             f"got {got.flatten()[i]:.6g}, float64 reference {want.flatten()[i]:.6g}, "
                             f"allowed error {bound.flatten()[i]:.3g}")


@pytest.fixture(autouse=True)
def _poison():
    """Fill every uninitialised allocation with NaN while a test runs."""
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op,name", _impl_params(FLOAT64_OPS))
def test_forward_backward(op, name, dtype, backend):
    if name == "table" and backend.kernels.resolved(op) == "reference":
        pytest.skip(f"the {backend.name} table resolves {op} to the reference: that is the {op}-reference case")
    fn = _resolve(op, name, backend)
    ref = get_impl(op, "reference")
    device = backend.current_device()
    torch.manual_seed(1234)
    declined, refused, made = [], [], cases(op, device, dtype)  # refused: declines a required impl may not make
    for case in made:
        label, args, kwargs = case.label, case.args, case.mark_grad().kwargs
        where = f"{op}/{name} [{label}]"
        leaves = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        try:
            outs = _tuple(fn(*args, **kwargs))
        except _Declined as why:
            declined.append(f"{label}: {why.msg}")
            refused += [declined[-1]] if not case.may_decline else []
            continue
        # the reference in the same dtype: its error scales the bound of a fast version; when the call
        # under test IS the reference (by name, or a table whose fast versions all decline this call),
        # that term would make the check unfailable, so the reference gets the dtype's own bound
        lows = _tuple(ref(*args, **kwargs))
        own = name == "reference" or (name == "table" and _table_runs_reference(backend, op, args, kwargs))
        args64, kw64 = [_to64(a) for a in args], {k: _to64(v) for k, v in kwargs.items()}
        leaves64 = [a for a in args64 + list(kw64.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        outs64 = _tuple(ref(*args64, **kw64))
        assert len(outs) == len(lows), f"{where}: {len(outs)} outputs, reference gives {len(lows)}"
        for k, (out, low, out64) in enumerate(zip(outs, lows, outs64)):
            assert out.dtype == low.dtype, f"{where}: output {k} dtype {out.dtype}, reference gives {low.dtype}"
            _check(f"{where} output {k}", out, out64, dtype, None if own else low, case.sum_atol)
        if not leaves:
            continue  # an op without autograd (e.g. the cross-entropy shard kernels): outputs only
        gos = [torch.randn(o.shape, device=device, dtype=torch.float64).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, leaves, gos)
        grads_low = torch.autograd.grad(lows, leaves, gos)
        grads64 = torch.autograd.grad(outs64, leaves64, [g.double() for g in gos])
        for i, (g, gl, g64, leaf) in enumerate(zip(grads, grads_low, grads64, leaves)):
            assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"{where}: grad {i} dtype/shape"
            _check(f"{where} grad {i}", g, g64, dtype, None if own else gl)
    if refused and name in REQUIRED:
        pytest.fail(f"{op}/{name} declined: {refused}")
    if declined and len(declined) == len(made):
        pytest.skip(f"{op}/{name} declined every case: {declined[0]}")


def _table_runs_reference(backend, op, args, kwargs) -> bool:
    """True when every fast candidate of the backend's table declines this call (the table then runs
    the reference)."""
    return all(c.supports is not None and c.supports(*args, **kwargs) is not None
               for c in backend.kernels.get(op).candidates)


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@pytest.mark.parametrize("op,name", _impl_params(["add_rms_norm", "add_layer_norm"]))
def test_add_norm_one_output_used(op, name, backend):
    """Only the normalised output (or only h) feeds the loss: the other output's gradient is absent."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    d = 48
    x, r = torch.randn(5, d, device=device, requires_grad=True), torch.randn(5, d, device=device, requires_grad=True)
    w = torch.randn(d, device=device, requires_grad=True)
    extra = (torch.randn(d, device=device),) if op == "add_layer_norm" else ()
    ref = get_impl(op, "reference")
    for which in (0, 1):
        got = torch.autograd.grad(fn(x, r, w, *extra)[which].square().sum(), (x, r, w), allow_unused=True)
        want = torch.autograd.grad(ref(x, r, w, *extra)[which].square().sum(), (x, r, w), allow_unused=True)
        for g, wg in zip(got, want):
            if wg is None or not wg.abs().sum():
                assert g is None or not g.abs().sum()
            else:
                torch.testing.assert_close(g, wg, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op,name", _impl_params(["rms_norm", "softmax_cross_entropy", "swiglu"]))
def test_nan_propagates(op, name, backend):
    """A NaN in one row makes that row's output NaN and leaves the other rows finite."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    x = torch.randn(4, 64, device=device)
    x[2, 5] = float("nan")
    if op == "rms_norm":
        out = fn(x, torch.ones(64, device=device), 1e-5)
    elif op == "swiglu":
        out = fn(x)
        out = out[:, 5:6]
    else:
        out = fn(x, torch.zeros(4, dtype=torch.long, device=device), 0.0)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()


@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("op,name", _impl_params(["adamw_step"]))
def test_adamw(op, name, grad_dtype, backend):
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    sizes = (33, 1000, 70001, 1)
    params = [torch.randn(n, device=device) for n in sizes]
    m = [torch.randn(n, device=device) * 0.1 for n in sizes]
    v = [torch.rand(n, device=device) * 0.01 for n in sizes]
    p64, m64, v64 = ([t.double() for t in ts] for ts in (params, m, v))
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        grads = [torch.randn(n, device=device).to(grad_dtype) for n in sizes]
        fn(params, grads, m, v, step=step, **hp)
        get_impl(op, "reference")(p64, [g.double() for g in grads], m64, v64, step=step, **hp)
    for got, want in zip(params + m + v, p64 + m64 + v64):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("op,name", _impl_params(["grad_norm_sq"]))
def test_grad_norm_sq(op, name, backend):
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    ts = [torch.randn(70001, device=device), torch.randn(3, 5, device=device).t(),
          torch.randn(999, device=device).to(torch.bfloat16), torch.randn(17, device=device).half()]
    out = fn(ts)
    want = sum(float(t.double().pow(2).sum()) for t in ts)
    assert out.dtype == torch.float32 and out.dim() == 0
    assert abs(float(out) - want) <= 1e-5 * want
    ts[1] = ts[1].clone()
    ts[1][0, 0] = float("nan")
    assert torch.isnan(fn(ts))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("op,name", _impl_params(["cross_entropy_shard_grad"]))
def test_cross_entropy_grad_into_its_logits(op, name, dtype, backend):
    """``out=logits``: the gradient written over its own input (what ``inplace_backward`` runs) equals the float64
    formula; the target's column, read and written twice in a row, is where an alias goes wrong. Shard of global
    ids [start, start + 40) with 33 real columns, label smoothing 0.1. Tolerance: ``TOLERANCE``."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    n, width, start, valid, vocab, ls = 9, 40, 60, 33, 93, 0.1
    x = (torch.randn(n, width, device=device) * 3).to(dtype)
    target = torch.randint(start, start + valid, (n,), device=device)
    target[0] = 0  # a target in another shard
    lse = torch.logsumexp(x[:, :valid].double(), -1) + torch.rand(n, device=device, dtype=torch.float64)
    dloss = torch.randn(n, device=device)
    p = torch.exp(x.double() - lse[:, None]) - ls / vocab
    p[:, valid:] = 0.0
    rows = torch.nonzero(target >= start).squeeze(-1)
    p[rows, target[rows] - start] -= 1.0 - ls
    want = p * dloss.double()[:, None]
    out = fn(dloss, x, target, lse.float(), start, valid, vocab, ls, out=x)
    assert out.data_ptr() == x.data_ptr() and out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(x.double(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
@pytest.mark.parametrize("op,name", _impl_params(["fp8_cast_transpose_amax"]))
def test_fp8_cast_transpose_amax(op, name, fmt, backend):
    """Bit-exact FP8 codes (normal, subnormal, saturated, signed zero), exact transpose and amax."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    for shape, xdtype in (((33, 70), torch.float32), ((64, 128), torch.bfloat16), ((1, 5), torch.float16)):
        x = torch.randn(shape, device=device) * torch.logspace(-9, 6, shape[1], base=2.0, device=device)
        x[0, 0] = -0.0
        x = x.to(xdtype)
        scale = torch.tensor(2.0 ** float(torch.randint(-3, 4, ())), device=device)
        q, qt, amax = fn(x, scale, fmt)
        # independent expectation: float64 scaling, saturation, torch's exact float8 rounding
        limit = {"e4m3": 448.0, "e5m2": 57344.0}[fmt]
        want = (x.double() * scale.double()).clamp(-limit, limit).to(dtype)
        assert q.dtype == dtype and qt.dtype == dtype and q.shape == shape and qt.shape == shape[::-1]
        assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)), f"{name} {fmt} {shape}: fp8 codes differ"
        assert torch.equal(qt.view(torch.uint8), want.t().contiguous().view(torch.uint8))
        assert amax.dtype == torch.float32 and float(amax) == float(x.double().abs().max())
    x[0, 1] = float("nan")
    assert torch.isnan(fn(x, scale, fmt)[2])


@pytest.mark.parametrize("fmt", ("e4m3", "e5m2"))
@pytest.mark.parametrize("op,name", _impl_params(["fp8_cast_transpose_from_amax"]))
def test_fp8_cast_transpose_from_amax(op, name, fmt, backend):
    """Current scaling fused: the scale is fp8_max / 2**margin / amax rounded once to float32 (1 for a zero, inf or
    nan amax; the largest float32 where the quotient overflows, so zeros stay zero), the codes are exactly those of
    that scale in float64, and scale_inv is its float32 reciprocal."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    dtype, limit = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}[fmt]
    x = (torch.randn(70, 33, device=device) * torch.logspace(-9, 6, 33, base=2.0, device=device)).to(torch.bfloat16)
    true_amax = x.float().abs().max()
    cases = [(true_amax, 0), (true_amax, 2), (true_amax * 0.25, 0),  # amax below max|x|: saturates
             (torch.tensor(0.0), 0), (torch.tensor(float("inf")), 0), (torch.tensor(float("nan")), 1),
             (torch.tensor(1e-38), 0)]  # the quotient overflows float32
    x[0, 0] = 0.0
    for amax, margin in cases:
        amax = amax.to(device=device, dtype=torch.float32)
        a = float(amax)
        # the float64 quotient of two float32s rounded to float32 is the correctly rounded one (53 >= 2 x 24 + 2
        # bits: double rounding is innocuous for division), clipped to the largest float32
        scale32 = torch.tensor(min(limit / 2.0 ** margin / a, torch.finfo(torch.float32).max)).float() \
            if 0 < a < float("inf") else torch.tensor(1.0)
        q, qt, scale_inv = fn(x, amax, fmt, margin)
        want = (x.double() * scale32.double()).clamp(-limit, limit).to(dtype)
        assert q.dtype == dtype and qt.shape == (33, 70)
        assert torch.equal(q.view(torch.uint8).cpu(),
                           want.view(torch.uint8).cpu()), f"{name} {fmt} amax={a} margin={margin}"
        assert torch.equal(qt.view(torch.uint8).cpu(), want.t().contiguous().view(torch.uint8).cpu())
        assert scale_inv.dtype == torch.float32 and float(scale_inv) == float(1.0 / scale32)


@pytest.mark.parametrize("algo", ("max", "most_recent"))
@pytest.mark.parametrize("op,name", _impl_params(["fp8_amax_history_push"]))
def test_fp8_amax_history_push(op, name, algo, backend):
    """The delayed-scaling update against the recipe written out in float64: newest amax first, the
    scale from the history's max (or newest entry) in one rounded division, the previous scale kept for 0 / inf /
    nan."""
    fn = _resolve(op, name, backend)
    device = backend.current_device()
    for fmt, limit in (("e4m3", 448.0), ("e5m2", 57344.0)):
        for length, margin in ((1, 0), (5, 1), (37, 0)):
            hist = torch.rand(length, device=device) * 10
            prev = torch.tensor(3.0, device=device)
            for amax in (7.5, 0.0, float("inf"), float("nan"), 1e-30):
                if length == 5 and amax == 0.0:
                    hist = torch.zeros(length, device=device)  # an all-zero history keeps the old scale
                new_hist, scale, scale_inv = fn(hist, torch.tensor(amax, device=device), prev, fmt, margin, algo)
                want_hist = [amax] + hist.tolist()[:-1]
                torch.testing.assert_close(new_hist.cpu(), torch.tensor(want_hist, dtype=torch.float32),
                                           rtol=0, atol=0, equal_nan=True)
                vals = torch.tensor(want_hist, dtype=torch.float64)
                summary = (float("nan") if vals.isnan().any() else float(vals.max())) if algo == "max" else amax
                ok = 0 < summary < float("inf")
                # one division rounded to float32 (a float64 quotient of float32s rounds to the same: 53 >= 2 x 24 + 2)
                want = torch.tensor(limit / 2.0 ** margin / summary).float() if ok else prev.cpu()
                assert float(scale) == float(want), (fmt, length, amax, algo)
                assert float(scale_inv) == float(1.0 / want.float())
                assert new_hist.data_ptr() != hist.data_ptr() and scale.data_ptr() != prev.data_ptr()
                hist, prev = new_hist, scale


@pytest.mark.parametrize("op,name", _impl_params(["attention_block_forward"]))
def test_attention_block(op, name, backend):
    """One ring-attention block: output and log-sum-exp, and the block's gradients given the final
    output and log-sum-exp, against the attention maths in float64 written out here (MHA, GQA, MQA;
    a causal square block and a non-causal rectangular one)."""
    fwd = _resolve(op, name, backend)
    bwd = _resolve("attention_block_backward", name, backend)
    device = backend.current_device()
    for hq, hkv, sq, sk, causal in ((4, 4, 24, 24, True), (4, 2, 24, 40, False), (4, 1, 16, 16, True)):
        q, k, v = (torch.randn(2, h, s, 16, device=device) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k64, v64))
        scores = q64 @ kr.transpose(-1, -2) * 0.3
        if causal:
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1), float("-inf"))
        lse64 = torch.logsumexp(scores, -1)
        out64 = torch.softmax(scores, -1) @ vr
        dout = torch.randn_like(out64)
        out64.backward(dout)
        out, lse = fwd(q, k, v, causal=causal, scale=0.3)
        torch.testing.assert_close(out.double(), out64.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), lse64.detach(), rtol=1e-5, atol=1e-5)
        dq, dk, dv = bwd(dout.float(), q, k, v, out64.detach().float(), lse64.detach().float(), causal=causal,
                         scale=0.3)
        for got, want in ((dq, q64.grad), (dk, k64.grad), (dv, v64.grad)):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def _dropout_attention64(q, k, v, causal: bool, scale: float, drop):
    """Float64 attention with the hash dropout written out: full scores, softmax, multiplier, matmul. Returns the
    leaf inputs, ``out``, ``lse``, the probabilities ``P``, the multiplier ``M`` and the heads-repeated ``k, v``."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k64, v64))
    s = q64 @ kr.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse, prob = torch.logsumexp(s, -1), torch.softmax(s, -1)
    mult = drop.multiplier(q.shape[0], q.shape[1], slice(None), torch.float64)
    return (q64, k64, v64), (prob * mult) @ vr, lse, prob.detach(), mult, kr.detach(), vr.detach()


def _heads_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """``[b, hq, s, d] -> [b, hkv, s, d]``: summed over each key/value head's query heads."""
    return x.unflatten(1, (hkv, -1)).sum(2)


def _dropout_bounds(q, k, out64, lse64, prob, mult, kr, vr, dout, scale):
    """Componentwise rounding bounds of an fp32 flash block against float64 (u = 2^-24; gamma_n ~ n u the bound of
    an n-term fp32 dot product relative to the sum of |terms|, Higham ch. 3). A score carries (d + 4) u of
    ``scale |q| |k|`` (dot, scale, log2(e), max subtracted), an absolute error in the exponent, so each probability
    ``p`` a relative ``e_p = 2 (d + 4) u max_j scale |q_i| |k_j| + (8 + |lse|) 4u`` (exp2, the log-sum-exp
    rounded). Forward: ``out`` adds the sk-term sums of the numerator and of the normaliser, ``lse`` the
    normaliser's log; backward adds to ``dv = (P M)^T dO`` its sq*rep-term sum, to ``dS = P (dO V^T M - delta)``
    the errors of ``dP`` (dv terms), of ``delta = rowsum(dO out)`` (dv terms) and ``e_p``, and to
    ``dq = scale dS K``, ``dk = scale dS^T Q`` their sums. Each bound doubled (the rescaling of the online
    softmax, a few more roundings than counted). Returns (out, lse, dq, dk, dv) bounds."""
    u, (b, hq, sq, d), (hkv, sk, dv) = 2.0 ** -24, q.shape, (k.shape[1], k.shape[2], vr.shape[-1])
    qa = q.double().abs()
    e_p = (2 * (d + 4) * u * scale * (qa @ kr.abs().transpose(-1, -2)).amax(-1, keepdim=True)
           + 4 * u * (8 + lse64.abs().unsqueeze(-1)))
    pm, do = prob * mult, dout.double().abs()
    b_out = 2 * (2 * e_p + (2 * sk + 16) * u) * (pm @ vr.abs())
    b_lse = 2 * (e_p.squeeze(-1) + (sk + 8) * u + u * lse64.abs())
    b_dv = 2 * _heads_sum((e_p * pm).transpose(-1, -2) @ do + (sq * hq // hkv + 2) * u * (pm.transpose(-1, -2) @ do),
                          hkv)
    dp = dout.double() @ vr.transpose(-1, -2)
    delta = (dout.double() * out64).sum(-1, keepdim=True)
    g = (dp * mult - delta).abs()
    e_dp, e_delta = (dv + 2) * u * (do @ vr.abs().transpose(-1, -2)), (dv + 2) * u * (do * out64.abs()).sum(-1, True)
    e_ds = prob * ((e_p + 2 * u) * g + e_dp * mult + e_delta)
    ds = prob * g
    b_dq = 2 * scale * (e_ds @ kr.abs() + (sk + 2) * u * (ds @ kr.abs()))
    b_dk = 2 * scale * _heads_sum(e_ds.transpose(-1, -2) @ qa + (sq * hq // hkv + 2) * u * (ds.transpose(-1, -2) @ qa),
                                  hkv)
    return b_out, b_lse, b_dq, b_dk, b_dv


@pytest.mark.parametrize("op,name", _impl_params(["attention_block_forward"]))
def test_attention_block_dropout(op, name, backend):
    """One ring-attention block with context parallelism's hash dropout (scattered global positions, a head
    offset, a 64-bit seed): the drop positions it applies in forward and in backward's dq, dk and dv are the
    hash's bit for bit (read back from the outputs: omnitron.testing.dropout_masks), also with the seed given as
    its int32 key on the device (a compiled layer's); output, log-sum-exp and gradients against float64
    attention with the same mask written out here, within the fp32 rounding bound of ``_dropout_bounds``."""
    from omnitron.kernels.hash_dropout import block_positions, row_key
    from omnitron.testing import dropout_masks as masks

    fwd = _resolve(op, name, backend)
    bwd = _resolve("attention_block_backward", name, backend)
    dev, seed = backend.current_device(), int.from_bytes(os.urandom(8), "little")
    for hq, hkv, sq, sk, causal, p in ((4, 2, 24, 40, False, 0.3), (2, 2, 24, 24, True, 0.6)):
        pos = torch.randperm(3 * (sq + sk), device=dev)
        drop = block_positions(pos[:sq], pos[sq:sq + sk], seed, p, 3, dev)
        want = masks.expected(drop, 2, hq, sq, sk, causal, dev)
        keyed = drop._replace(seed=torch.tensor(row_key(seed), dtype=torch.int32, device=dev))
        for d in (drop, keyed):
            assert torch.equal(masks.forward_kept(fwd, d, 2, hq, hkv, sq, sk, causal, torch.float32, dev), want)
        for got, where in zip(masks.backward_kept(bwd, drop, 2, hq, sq, sk, causal, torch.float32, dev),
                              ("dq", "dk", "dv")):
            assert torch.equal(got, want), f"{name}: backward's {where} drops other elements than the hash"
        q, k, v = (torch.randn(2, h, s, 16, device=dev) for h, s in ((hq, sq), (hkv, sk), (hkv, sk)))
        leaves, out64, lse64, prob, mult, kr, vr = _dropout_attention64(q, k, v, causal, 0.3, drop)
        dout = torch.randn(out64.shape, device=dev)
        out64.backward(dout.double())
        out, lse = fwd(q, k, v, causal=causal, scale=0.3, drop=drop)
        grads = bwd(dout, q, k, v, out64.detach().float(), lse64.detach().float(), causal=causal, scale=0.3,
                    drop=drop)
        bounds = _dropout_bounds(q, k, out64.detach(), lse64.detach(), prob, mult, kr, vr, dout, 0.3)
        for what, got, ref, bound in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                         (out64, lse64, *(t.grad for t in leaves)), bounds):
            err = (got.double() - ref.detach()).abs()
            assert got.shape == ref.shape and bool((err <= bound).all()), \
                f"{name} {what} (causal={causal}): max error {float(err.max()):.3g}, worst error/bound " \
                f"{float((err / bound).max()):.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("op,name", _impl_params(["cross_entropy_shard_stats"]))
def test_cross_entropy_shards(op, name, dtype, backend):
    """Three padded vocabulary shards combined as a tensor-parallel group would (max, rescale, sum)
    give the float64 loss and gradient over the real vocabulary; padding gets zero gradient."""
    from omnitron.kernels.reference.cross_entropy_shard import loss_from_stats

    stats_fn = _resolve(op, name, backend)
    grad_fn = _resolve("cross_entropy_shard_grad", "table" if name == "table" else name, backend)
    device = backend.current_device()
    vocab, width, ls = 50, 19, 0.1  # 3 shards of 19 columns: the last has 12 real + 7 padding
    logits = (torch.randn(4, 3, 3 * width, device=device) * 3).to(dtype)
    target = torch.randint(0, vocab, (4, 3), device=device)
    target[0, 0], target[0, 1] = 0, vocab - 1  # ids at both ends of the vocabulary
    shards = [(logits[..., r * width:(r + 1) * width].contiguous(), r * width, min(width, vocab - r * width))
              for r in range(3)]
    stats = [stats_fn(x, target, start, valid, vocab) for x, start, valid in shards]
    m = torch.stack([s[0] for s in stats]).amax(0)
    total = sum(torch.cat([s[:1] * 0, s[1:2] * torch.exp(s[0] - m), s[2:]]) for s in stats)
    total[0] = m
    loss, lse = loss_from_stats(total, vocab, ls)
    x64 = logits[..., :vocab].double().requires_grad_()
    want = torch.nn.functional.cross_entropy(x64.flatten(0, 1), target.flatten(), reduction="none",
                                             label_smoothing=ls).view(4, 3)
    _check(f"{name} shard loss", loss, want, torch.float32 if dtype == torch.float32 else dtype)
    dloss = torch.randn(4, 3, device=device)
    (g64,) = torch.autograd.grad(want, x64, dloss.double())
    grads = torch.cat([grad_fn(dloss, x, target, lse, start, valid, vocab, ls) for x, start, valid in shards], -1)
    assert grads.dtype == dtype
    _check(f"{name} shard grad", grads[..., :vocab], g64, dtype)
    assert torch.equal(grads[..., vocab:], torch.zeros_like(grads[..., vocab:]))
