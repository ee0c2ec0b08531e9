"""Master remainders (Transformer Engine's ``store_param_remainders``): a bf16 parameter's fp32 master kept as the
parameter plus an int16 remainder.

References: (1) the fp32 master's bits, for the split / join round trip on fresh random fp32 words; (2) the bf16
parameter written by TE's split, derived by hand in float64: the master rounded to 8 significant bits, ties away
from zero (TE rounds the high half up when the dropped half's top bit is set); (3) the same optimizer with fp32
masters on the same fresh gradients, bit for bit (the joined master is the fp32 master exactly, so the steps are
the same); (4) the float64 FusedAdam transcription and its derived bounds from test_precision_aware.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim import MixedPrecisionOptimizer
from omnitron.core.optim.moments import join_master, master_finite, split_master
from omnitron.core.parallel.groups import ParallelGroups
from test_precision_aware import U32, _f32, _grads, _model, _te_step


def _ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` (normal, below bf16's overflow) rounded to bf16's 8 significant bits, ties away from zero, in
    float64: the unit in the last place is 2^(e - 7) for |x| in [2^e, 2^(e+1))."""
    x = x.double()
    ulp = torch.exp2(torch.floor(torch.log2(x.abs())) - 7)
    return torch.sign(x) * torch.floor(x.abs() / ulp + 0.5) * ulp


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; the seed is in every message


def test_split_then_join_is_the_master_and_the_param_rounds_ties_away():
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    # normal fp32 words of both signs, exponents 2^-100 .. 2^100, and 1/8 of them exact ties (low half 0x8000)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-100, 100, (4096,), generator=gen).float())
    bits = x.view(torch.int32)
    tie = torch.rand(4096, generator=gen) < 0.125
    bits[tie] = (bits[tie] & ~0xFFFF) | 0x8000
    master = x.clone()
    param, rem = torch.empty(4096, dtype=torch.bfloat16), torch.empty(4096, dtype=torch.int16)
    split_master(x, param, rem)
    assert torch.equal(join_master(param, rem).view(torch.int32), master.view(torch.int32)), seed
    assert torch.equal(param.double(), _ties_away(master)), seed
    # round to nearest even differs exactly at the ties whose high half is even
    word = master.view(torch.int32)
    even = ((word & 0xFFFF) == 0x8000) & ((word >> 16) & 1 == 0)  # the forced ties and any drawn as such
    assert torch.equal(param != master.bfloat16(), even), seed


def _words(bits: list[int]) -> torch.Tensor:
    """fp32 values from their 32-bit patterns (given unsigned)."""
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32).view(torch.float32)


def _special_masters(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NaNs, infs, finite values in fp32's top binade): the NaNs GPUs and CPUs write (0x7FFFFFFF, 0xFFFFFFFF,
    0x7FC00000, 0xFFC00000), ones whose low half rounds up (0x7F80FFFF, 0x7FFF8000) and random ones of both signs;
    the largest finite values, ties and the neighbours of bf16's overflow threshold, and random ones."""
    nan_bits = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0xFFC00000, 0x7F80FFFF, 0x7FFF8000, 0xFFFF8000, 0x7FFF7FFF]
    mant = torch.randint(1, 1 << 23, (64,), generator=gen)
    sign = torch.randint(0, 2, (64,), generator=gen) << 31
    nan_bits += [int(s) | 0x7F800000 | int(m) for s, m in zip(sign, mant)]
    top = [0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x7F7E8000, 0x7F7F0000, 0x7F000000]
    top += [int(m) | 0x7F000000 for m in torch.randint(0, 1 << 23, (64,), generator=gen)]
    top += [b | 0x80000000 for b in top]
    return _words(nan_bits), _words([0x7F800000, 0xFF800000]), _words(top)


def test_nan_and_inf_masters_stay_non_finite_and_large_ones_round_trip():
    """TE's increment wraps 0x7FFF / 0xFFFF (NaN high halves) to a signed zero; here a NaN master's parameter stays
    non-finite and joins back to a NaN, an inf is kept as it is, and the top binade's finite masters round trip exactly
    with the parameter rounded ties away (inf beyond bf16's largest, as round to nearest even). The finite check
    of the joined masters says which are finite, whatever the chunk."""
    seed = _seed()
    nans, infs, top = _special_masters(torch.Generator().manual_seed(seed))
    for x, kind in ((nans, "nan"), (infs, "inf"), (top, "finite")):
        master = x.clone()
        param, rem = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
        split_master(x, param, rem)
        joined = join_master(param, rem)
        if kind == "nan":  # the parameter: NaN, or inf for a NaN whose high half is 0x7F80 / 0xFF80 and low < 0x8000
            assert not param.isfinite().any() and joined.isnan().all(), (seed, param, joined)
        else:
            assert torch.equal(joined.view(torch.int32), master.view(torch.int32)), seed
        if kind == "inf":
            assert torch.equal(param.float(), master), seed
        if kind == "finite":
            want = _ties_away(master)
            want = torch.where(want.abs() >= 2.0 ** 128, want.sign() * torch.inf, want)  # beyond bf16's range
            assert torch.equal(param.double(), want), seed
            assert param.isinf().any()  # 0x7F7FFFFF: a finite master whose parameter is inf
        for chunk in (1, 3, x.numel()):
            assert bool(master_finite(param, rem, chunk)) is (kind == "finite"), (seed, kind, chunk)
        for k in range(x.numel()):
            assert bool(master_finite(param[k:k + 1], rem[k:k + 1], 1)) is bool(master[k].isfinite()), (seed, k)


def test_pre_save_check_reads_the_joined_masters():
    """--check-for-nan-in-loss-and-grad's check before a save: a NaN master (0x7FFFFFFF, what a GPU writes) kept as
    a remainder refuses the save; a finite master whose bf16 parameter rounded to inf does not (its fp32 master is
    what the checkpoint holds, and a run with fp32 masters saves it too)."""
    from types import SimpleNamespace

    from omnitron.core.training.loop import _check_before_save
    from omnitron.core.training.nonfinite import NonFiniteError

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    for bits, refuses in ((0x7FFFFFFF, True), (0xFFFFFFFF, True), (0xFF800000, True), (0x7F7FFFFF, False)):
        runs = []
        for remainders in (True, False):
            model = _model(seed % 1000)
            opt = _optimizer(model, "fp32", remainders)
            _grads(model, gen)
            opt.step(1e-2)
            j = int(torch.randint(0, len(opt.masters), (), generator=gen))
            x = opt.saved_masters()[j].reshape(-1).clone()
            x[int(torch.randint(0, x.numel(), (), generator=gen))] = _words([bits])[0]
            opt.set_master(j, x)
            c = SimpleNamespace(optimizer=opt, backend=get_backend("cpu"), iteration=3, groups=SimpleNamespace(rank=0),
                                settings=SimpleNamespace(training=SimpleNamespace(check_for_nan_in_loss_and_grad=True)))
            try:
                _check_before_save(c)
                runs.append(False)
            except NonFiniteError as err:
                assert str(err).startswith("iteration 3, rank 0: a weight is not finite, found before saving")
                runs.append(True)
        assert runs == [refuses, refuses], (seed, hex(bits), runs)


def _optimizer(model, moments: str, remainders: bool) -> MixedPrecisionOptimizer:
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95, exp_avg_dtype=moments,
                          exp_avg_sq_dtype=moments, store_param_remainders=remainders)
    return MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))


@pytest.mark.parametrize("moments", ["fp32", "bf16", "fp16"])
def test_steps_equal_fp32_masters_bit_for_bit_and_float64_adam(moments):
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    full, kept = _model(seed % 1000), _model(seed % 1000)
    ref, opt = _optimizer(full, moments, False), _optimizer(kept, moments, True)
    assert all(r is not None for r in opt.remainders) and all(m.dtype == torch.bfloat16 for m in opt.masters)
    cfg = opt.config
    for step in range(1, 7):
        _grads(full, gen)
        for p, q in zip(full.parameters(), kept.parameters()):
            q.grad = p.grad.clone()
        before = [m.double() for m in opt.saved_masters()]
        m0 = [opt.moment("exp_avg", i).double() for i in range(len(before))]
        v0 = [opt.moment("exp_avg_sq", i).double() for i in range(len(before))]
        ref.step(cfg.lr)
        opt.step(cfg.lr)
        for i, master in enumerate(opt.saved_masters()):
            assert torch.equal(master.view(torch.int32), ref.masters[i].view(torch.int32)), (seed, step, i)
            assert torch.equal(opt.params[i].double(), _ties_away(master)), (seed, step, i)
            g = opt.params[i].grad.double()
            p, _, _, upd, spread = _te_step(before[i], g, m0[i], v0[i], step=step, cfg=cfg, decay=opt.decay[i])
            # the bound of test_precision_aware's master (its comment derives it): fp32 arithmetic on the joined
            # master, which is the fp32 master exactly
            bound = U32 * (3 * before[i].abs() + p.abs() + _f32(cfg.lr) * (8 * upd.abs() + 3 * spread))
            assert ((master.double() - p).abs() <= bound).all(), (seed, step, i)
        for key in ("exp_avg", "exp_avg_sq"):
            for a, b in zip(opt.state[key], ref.state[key]):
                assert torch.equal(a, b), (seed, step, key)
    # 2 bytes of remainder per element beside the moments (fp16 ones with a 4-byte scale each)
    per = {"fp32": 8, "bf16": 4, "fp16": 4}[moments]
    assert opt.state_bytes() == sum((2 + per) * p.numel() + 8 * (moments == "fp16") for p in kept.parameters())


def test_fp32_masters_beside_remainders_step_in_one_fused_launch(monkeypatch):
    """With remainders and fp32 moments, the fp32 parameters' masters (no remainder) go through one fused launch
    per group, not one at a time through the chunked path; the steps stay the fp32-master run's bit for bit."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    full, kept = _model(seed % 1000), _model(seed % 1000)
    for m in (full, kept):
        m[1].float()  # the norm in fp32: its weight and bias are their own masters
    ref, opt = _optimizer(full, "fp32", False), _optimizer(kept, "fp32", True)
    fp32 = [i for i, r in enumerate(opt.remainders) if r is None]
    assert len(fp32) == 2 and all(opt.remainders[i] is not None for i in range(4) if i not in fp32)
    kernels = opt.backend.kernels
    calls, inner = [], kernels.adamw_step
    monkeypatch.setattr(kernels, "adamw_step", lambda p, *a, **k: (calls.append([t.data_ptr() for t in p]),
                                                                    inner(p, *a, **k)))
    for step in range(3):
        for p, q in zip(full.parameters(), kept.parameters()):
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-10, 5, p.shape,
                                                                                                    generator=gen))
            p.grad, q.grad = g.to(p.dtype), g.to(p.dtype)
        ref.step(1e-2)
        opt.step(1e-2)
        for a, b in zip(opt.saved_masters(), ref.saved_masters()):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (seed, step)
    assert [opt.masters[i].data_ptr() for i in fp32] in calls  # the 1-D masters share decay and rate: one launch


def test_state_dict_holds_fp32_masters_and_loads_either_way():
    """The state dict's master is the joined fp32 value; a run without remainders loads it as its master, and one
    with them splits it back: both continue bit for bit."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    model = _model(1)
    opt = _optimizer(model, "bf16", True)
    for _ in range(3):
        _grads(model, gen)
        opt.step(1e-2)
    saved = opt.state_dict()
    for i, name in enumerate(opt.names):
        assert saved["tensors"][name]["master"].dtype == torch.float32
        assert torch.equal(saved["tensors"][name]["master"], opt.saved_masters()[i]), seed
    runs = []
    for remainders in (True, False):
        copy = _model(2)
        copy.load_state_dict(model.state_dict())
        resumed = _optimizer(copy, "bf16", remainders)
        resumed.load_state_dict(saved)
        runs.append((copy, resumed))
    for _ in range(2):
        _grads(model, gen)
        for copy, resumed in runs:
            for p, q in zip(model.parameters(), copy.parameters()):
                q.grad = p.grad.clone()
            resumed.step(1e-2)
        opt.step(1e-2)
    for _, resumed in runs:
        for a, b in zip(opt.saved_masters(), resumed.saved_masters()):
            assert torch.equal(a, b), seed
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), runs[0][0].parameters())), seed


@pytest.mark.parametrize("extra,on", [(["--bf16"], True), ([], False), (["--fp16"], False),
                                      (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise"], False)])
def test_flags_turn_remainders_on_where_megatron_does(extra, on):
    """Megatron (TE >= 2.1) keeps remainders whenever its precision-aware optimizer runs under --bf16 with TE
    holding the masters (not under an FP8 recipe other than delayed); no flag spells it."""
    from omnitron.core.training.arguments import parse_settings

    aware = ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]
    assert parse_settings(["--model", "gpt2_tiny", *extra, *aware], 1).optim.store_param_remainders is on
    assert not parse_settings(["--model", "gpt2_tiny", *extra, "--use-distributed-optimizer"],
                              1).optim.store_param_remainders


def _rounding_term(g, m, v, upd, *, step: int, cfg, eta: float) -> torch.Tensor:
    """Bound on |upd(g') - upd(g)| for a gradient g' with |g' - g| <= eta |g| (the clipped bf16 gradient against
    the float64 one): with m_hat = m / bc1, den = sqrt(v / bc2) + eps and upd = m_hat / den, m_hat moves by at most
    (1 - b1) eta |g| / bc1; v by at most (1 - b2) g^2 ((1 + eta)^2 - 1) <= v rho, rho = eta (2 + eta), so
    sqrt(v / bc2) and den (eps only adds) by at most rho den (1 - sqrt(1 - x) <= x for x <= 1); then
    |m_hat' / den' - m_hat / den| <= (|d m_hat| + |m_hat| rho) / (den (1 - rho)) = ((1 - b1) eta |g| / (bc1 den)
    + |upd| rho) / (1 - rho). ``g, m, v, upd``: float64, the reference step's (:func:`_te_step`'s)."""
    b1, b2, eps = (_f32(x) for x in (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps))
    rho = eta * (2 + eta)
    den = (v / (1 - b2 ** step)).sqrt() + eps
    return ((1 - b1) * eta * g.abs() / ((1 - b1 ** step) * den) + upd.abs() * rho) / (1 - rho)


def _bf16_grads_steps(args: list[str], seed: int) -> list[float]:
    """Each step's largest error / bound of the distributed optimizer's masters against the float64 FusedAdam, with
    the bf16 gradient buffers (--main-grads-dtype bf16) read as they are and clipped in place (--clip-grad > 0:
    the float64 reference clips the bf16 gradients read exactly by their float64 norm)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    s = parse_settings(args, 1)
    c = build_components(s, get_backend())
    opt, cfg = c.optimizer, s.optim
    assert {sl.grad.dtype for sl in opt.slices} == {torch.bfloat16}
    gen = torch.Generator().manual_seed(seed)
    worst = []
    for step in range(1, 4):
        for ch in c.chunks:
            for buf in ch.buffers:
                buf.data.copy_(torch.randn(buf.data.shape, generator=gen) * 2.0 ** -6)
        before = [m.double() for m in opt.saved_masters()]
        m0 = [opt.moment("exp_avg", j).double() for j in range(len(before))]
        v0 = [opt.moment("exp_avg_sq", j).double() for j in range(len(before))]
        grads = [sl.grad.double() for sl in opt.slices]
        n = sum(g.numel() for g in grads)
        norm = float(sum(g.square().sum() for g in grads).sqrt())  # exact squares, float64 sums: rel ~1e-16 n
        coef = min(1.0, cfg.clip_grad / (norm + 1e-6)) if cfg.clip_grad > 0 else 1.0
        # the step's norm sums the squares (exact in fp32: 8-bit significands) in fp32: relative error at most
        # n u32 (recursive summation), halved by the sqrt, plus its rounding; the coefficient inherits it
        eps_c = (n / 2 + 2) * U32
        res = opt.step(cfg.lr)
        assert abs(res.grad_norm - norm) <= eps_c * norm, (seed, step, res.grad_norm, norm)
        # the coefficient c (1 + e_c) is rounded to fp32, the product g c in fp32, then to bf16 in place (unit
        # 2^-8): relative error eta = (1 + eps_c) (1 + u32)^2 (1 + 2^-8) - 1 against the float64 g c; no
        # clipping: the gradient is read exactly
        eta = (1 + eps_c) * (1 + U32) ** 2 * (1 + 2.0 ** -8) - 1 if coef < 1.0 else 0.0
        ratio = 0.0
        for j, master in enumerate(opt.saved_masters()):
            g = grads[j] * coef
            # the buffer holds the clipped gradient the step read (clipped in place, as Megatron's)
            assert ((opt.slices[j].grad.double() - g).abs() <= eta * g.abs()).all(), (seed, step, j)
            p, m, v, upd, spread = _te_step(before[j], g, m0[j], v0[j], step=step, cfg=cfg, decay=opt.decay[j])
            d_upd = _rounding_term(g, m, v, upd, step=step, cfg=cfg, eta=eta)
            # test_precision_aware's master bound (derived there), its update terms taken at the rounded gradient
            # (upd within d_upd; spread's |g| grows by at most 1 + eta, its den shrinks by at most 1 - rho), plus the
            # rounded gradient's change of the update, times lr
            rho = eta * (2 + eta)
            fp32 = U32 * (3 * before[j].abs() + p.abs()
                          + _f32(cfg.lr) * (8 * (upd.abs() + d_upd) + 3 * spread * (1 + eta) / (1 - rho)))
            bound = fp32 + _f32(cfg.lr) * d_upd * (1 + 2 * U32) + 1e-300
            ratio = max(ratio, float(((master.double() - p).abs() / bound).max()))
        worst.append(ratio)
    assert not opt._scratch_bufs  # no fp32 copy of the gradients was made
    return worst


@pytest.mark.parametrize("clip", ["0", "0.3"])
def test_bf16_main_grads_step_as_they_are(tmp_path, clip):
    """bf16 main grads are clipped in place in bf16, as Megatron's clip_grad_by_total_norm_fp32 scales the
    precision-aware optimizer's bf16 decoupled_grad views (multi_tensor_scale, grads onto themselves)."""
    from omnitron.testing.distributed import run_distributed

    seed = _seed()
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--micro-batch-size", "1", "--train-iters", "2", "--no-tensorboard",
            "--data-cache-path", str(tmp_path / "cache"), "--bf16", "--use-distributed-optimizer",
            "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
            "--main-grads-dtype", "bf16", "--clip-grad", clip, "--weight-decay", "0.1", "--lr", "0.01",
            "--adam-beta2", "0.95"]  # the beta test_precision_aware's bound is derived for
    worst = run_distributed(_bf16_grads_steps, 1, args, seed)[0]
    assert max(worst) <= 1.0, (seed, worst)


def test_scaling_bf16_gradients_rounds_each_once():
    """The clip's and the loss scaler's in-place scaling of bf16 gradients (--main-grads-dtype bf16): the fp32
    product of the gradient (exact in fp32) and the fp32 factor, rounded to bf16 -- relative error at most
    (1 + u32)^2 (1 + 2^-8) - 1 against the float64 product with the float64 factor (the factor's and the product's
    fp32 roundings, then bf16's); a factor rounded to bf16 first would add up to 2^-8 more."""
    from omnitron.core.optim.optimizer import _scale_

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen) * 2.0 ** -6).bfloat16() for n in (4096, 33, 1)]
    for _ in range(4):
        coef = float(torch.rand((), generator=gen, dtype=torch.float64)) * 0.99 + 0.005
        want = [g.double() * coef for g in grads]
        got = [g.clone() for g in grads]
        _scale_(got, coef)
        eta = (1 + U32) ** 2 * (1 + 2.0 ** -8) - 1
        for g, w in zip(got, want):
            assert ((g.double() - w).abs() <= eta * w.abs()).all(), (seed, coef)
