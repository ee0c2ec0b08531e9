"""--optimizer muon against a float64 Muon written plainly here (Megatron's rule and update), step for step: one
process, dp2, tp2 (whole-matrix orthogonalisation), the distributed optimizer at dp2 and tp2 x dp2; resume
bit-exact, from the optimizer state and through the training loop's checkpoints."""
from __future__ import annotations

import math
import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

STEPS, LR, WD, CLIP = 4, 2e-2, 0.1, 0.5
# Megatron's quintic Newton-Schulz coefficients (emerging_optimizers' "quintic" set, from modded-nanogpt)
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
# "polar_express" (arXiv:2505.16932, with its 1.01 safety factor folded in), as emerging_optimizers v0.3.0
POLAR = [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
         (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
         (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)]
# name: (full shape, tp dim (-1: replicated), stride, role); the qkv rows are 2 groups of [q 4, k 2, v 2] rows
PARAMS = {"qkv": ((16, 8), 0, 1, "qkv"), "fc1": ((24, 8), 0, 2, "matrix"), "fc2": ((8, 12), 1, 1, "matrix"),
          "dense": ((6, 8), -1, 1, "matrix"), "fc1_bias": ((24,), 0, 2, "bias"), "norm": ((8,), -1, 1, "norm"),
          "emb": ((10, 8), 0, 1, "embedding")}
QKV_ROWS = [4, 2, 2]


# ---- the float64 reference -------------------------------------------------------------------
def _ns(x: torch.Tensor, coefficients=QUINTIC) -> torch.Tensor:
    """Plain Newton-Schulz: transpose a tall matrix, divide by the Frobenius norm, one step per coefficient
    triple (default: the 5 quintic steps)."""
    t = x.shape[0] > x.shape[1]
    X = x.T if t else x
    X = X / X.norm()
    for a, b, c in coefficients:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if t else X


SCALES = {"spectral": lambda m, n: math.sqrt(max(m, n)), "unit_rms_norm": lambda m, n: math.sqrt(m / n),
          "shape_scaling": lambda m, n: math.sqrt(max(1.0, m / n))}
"""--muon-scale-mode's factor for an [m, n] (rows, cols) update: Moonlight's, Scion's and Keller Jordan's."""


def _orth(name: str, u: torch.Tensor, split_qkv: bool, scale_mode: str = "spectral") -> torch.Tensor:
    """scale(rows, cols) x NS(u) (default 'spectral', sqrt(max(rows, cols))); the qkv matrix per q / k / v block of
    every group."""
    if split_qkv and PARAMS[name][3] == "qkv":
        g = u.shape[0] // sum(QKV_ROWS)
        blocks = u.view(g, sum(QKV_ROWS), -1).split(QKV_ROWS, dim=1)
        outs = [_orth("", b.reshape(-1, u.shape[1]), False, scale_mode).view(g, -1, u.shape[1]) for b in blocks]
        return torch.cat(outs, dim=1).reshape(u.shape)
    return _ns(u) * SCALES[scale_mode](*u.shape)


def reference(init: dict, grads, *, momentum=0.9, nesterov=False, split_qkv=True, scale_mode="spectral") -> list[dict]:
    """float64 Muon: clip by the global norm; matrices: decay, EMA momentum, orthogonalised step; the rest
    (embedding, norm, bias): AdamW (decay on 2-D only). ``grads[s]``: the full mean gradients of step s."""
    p = {k: v.double().clone() for k, v in init.items()}
    m = {k: torch.zeros_like(v) for k, v in p.items()}
    v2 = {k: torch.zeros_like(v) for k, v in p.items()}
    out = []
    for s, g in enumerate(grads, start=1):
        norm = math.sqrt(sum(float(x.double().pow(2).sum()) for x in g.values()))
        g = {k: x.double() * min(1.0, CLIP / (norm + 1e-6)) for k, x in g.items()}
        for k in p:
            if PARAMS[k][3] in ("matrix", "qkv"):
                p[k] *= 1 - LR * WD
                m[k] = momentum * m[k] + (1 - momentum) * g[k]
                u = (1 - momentum) * g[k] + momentum * m[k] if nesterov else m[k]
                p[k] -= LR * _orth(k, u, split_qkv, scale_mode)
            else:
                if p[k].ndim == 2:
                    p[k] *= 1 - LR * WD
                m[k] = 0.9 * m[k] + 0.1 * g[k]
                v2[k] = 0.999 * v2[k] + 0.001 * g[k] ** 2
                p[k] -= LR * (m[k] / (1 - 0.9 ** s)) / ((v2[k] / (1 - 0.999 ** s)).sqrt() + 1e-8)
        out.append({k: x.clone() for k, x in p.items()})
    return out


# ---- the engine ---------------------------------------------------------------------------------
def full_init(seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64) * 0.3 for k, (shape, *_) in PARAMS.items()}


def full_grads(step: int, rank: int) -> dict:
    """Replica ``rank``'s gradients of step ``step`` (the engine averages them over dp)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {k: torch.randn(shape, generator=g, dtype=torch.float64) * (3.0 if k == "fc2" else 1.0)
            for k, (shape, *_) in PARAMS.items()}


class Toy(torch.nn.Module):
    """The parameters of PARAMS, this tp rank's shards, with the engine's sharding attributes."""

    def __init__(self, tp: int, rank: int, init: dict, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from omnitron.core.parallel.tensor.sharding import set_attributes, shard_param

        for name, (shape, dim, stride, role) in PARAMS.items():
            local = list(shape)
            if dim >= 0:
                local[dim] //= tp
            p = set_attributes(torch.nn.Parameter(torch.empty(local, dtype=dtype)), parallel=dim >= 0 and tp > 1,
                               dim=dim, stride=stride)
            p.data.copy_(shard_param(init[name].to(dtype), p, tp, rank))
            if role == "qkv":
                p.qkv_split_rows = QKV_ROWS
            if role == "embedding":
                p.is_embedding_or_output_parameter = True
            self.register_parameter(name, p)


def build(groups, backend, *, distributed: bool, init: dict, dtype: torch.dtype = torch.float32, **cfg):
    """(DDP-wrapped toy, optimizer) for ``groups``; small buckets so matrices straddle the ZeRO slices."""
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim.muon import DistributedMuon, Muon
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel

    from omnitron.core.parallel.tensor.sharding import to_device

    model = to_device(Toy(groups.tp.size, groups.tp.rank if groups.tp.size > 1 else 0, init, dtype), backend.device())
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(use_distributed_optimizer=distributed,
                                                                    bucket_size=100), collectives=backend.collectives)
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=CLIP, muon_fp32_matmul_prec="high",
                             **cfg)
    named = list(model.named_parameters())
    opt = (DistributedMuon(named, config, groups, backend=backend, chunks=[ddp]) if distributed
           else Muon(named, config, groups, backend=backend))
    return ddp, opt


def step(ddp, opt, groups, s: int) -> None:
    """One step on replica ``dp rank``'s gradients of step ``s`` (the wrapper averages them over dp)."""
    from omnitron.core.parallel.tensor.sharding import shard_param

    ddp.zero_grad_buffer()
    tp, rank = groups.tp.size, groups.tp.rank if groups.tp.size > 1 else 0
    g = full_grads(s, groups.dp.rank if groups.dp.size > 1 else 0)
    for name, p in ddp.module.named_parameters():
        p.main_grad.copy_(shard_param(g[name].to(p.dtype), p, tp, rank))
    ddp.finish_grad_sync()
    assert not opt.step(LR).skipped


def full_params(model, groups) -> dict:
    from omnitron.core.parallel.tensor.sharding import gather_param

    return {n: gather_param(p.detach(), p, groups.tp).double().cpu().clone() for n, p in model.named_parameters()}


def layout_worker(tp: int, resume: bool, tp_mode: str = "duplicated") -> dict:
    """Every layout of this world with tensor-parallel size ``tp``, plain and distributed, a float64 model
    (LAYOUT_ATOL): the full parameters after each step; with ``resume``, the distributed run also restarted from its
    state after 2 steps."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), backend=be)
    out = {}
    for distributed in (False, True):
        ddp, opt = build(groups, be, distributed=distributed, init=full_init(), dtype=torch.float64,
                         muon_tp_mode=tp_mode)
        history = []
        for s in range(STEPS):
            step(ddp, opt, groups, s)
            history.append(full_params(ddp.module, groups))
            if resume and distributed and s == 1:
                state = opt.state_dict()
                ddp2, opt2 = build(groups, be, distributed=True, init={k: v for k, v in full_init(5).items()},
                                   dtype=torch.float64)
                with torch.no_grad():
                    for p2, p in zip(ddp2.module.parameters(), ddp.module.parameters()):
                        p2.copy_(p)
                opt2.reload_masters()
                opt2.load_state_dict(state)
        out["dist" if distributed else "plain"] = history
        out[f"{'dist' if distributed else 'plain'}_keys"] = {n: sorted(e)
                                                             for n, e in opt.state_dict()["tensors"].items()}
        if resume and distributed:
            resumed = []
            for s in range(2, STEPS):
                step(ddp2, opt2, groups, s)
                resumed.append(full_params(ddp2.module, groups))
            out["resumed"] = resumed
    return out


# Tolerance. The engine runs in fp32 (u = 6e-8) against float64. Gradient means, clipping and AdamW move each
# parameter by <= ~1e-7 x lr per step. The Muon step is lr x sqrt(max(m, n)) x NS(U): U carries the fp32
# momentum's relative error (~1e-7), and five quintic steps amplify an input perturbation by at most the
# product of the polynomials' slopes, prod_k |a_k| ~ 4.1 x 4.0 x 3.7 x 2.9 x 2.8 = 500 (the slope at 0, the
# largest), plus the fp32 rounding of ~k = 12-term dot products per matmul (~k u each, amplified likewise):
# |dNS| <= 500 x 20 x 6e-8 ~ 6e-4 relative to |NS| ~ 1 in the worst direction, x sqrt(24) = 4.9 x lr (2e-2)
# = 6e-5 per step, 2.4e-4 over four steps: far below what a wrong shard, block or scale gives (the update
# itself, ~lr = 2e-2 per element; splitting qkv or not moves it by 5e-2). Measured: 5e-7.
ATOL = 2.5e-4
# The layouts (tp2, dp2, plain and distributed, the Gram all-reduce mode) run a float64 model against the float64
# reference: the engine's sums in another order only, as in test_float64_model_steps_in_float64 (12-term dot
# products, the norm's ~500 squares, plus the dp2 mean's 2 terms and the tp halves of the Gram products: <= 500 u,
# u = 1.1e-16), amplified by Newton-Schulz's <= 500 (ATOL's slope product): 3e-11 relative to |NS| ~ 1, x sqrt(24)
# x lr (2e-2) = 3e-12 a step, 1.2e-11 over four steps. LAYOUT_ATOL = 1e-10 leaves a factor 8; a float32 run needed
# ATOL (2.5e-4), under which a layout that rounds U, the momentum or the masters to float32 (~1e-7) passed.
LAYOUT_ATOL = 1e-10


def _compare(history: list[dict], ref: list[dict], what: str, atol: float = LAYOUT_ATOL) -> None:
    for s, (got, want) in enumerate(zip(history, ref, strict=True)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m: f"{what} step {s} {k}: {m}")


def _mean_grads(dp: int) -> list[dict]:
    return [{k: sum(full_grads(s, r)[k] for r in range(dp)) / dp for k in PARAMS} for s in range(STEPS)]


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("nesterov,split,scale", [(False, True, "spectral"), (True, False, "spectral"),
                                                  (False, True, "unit_rms_norm"), (False, True, "shape_scaling")])
def test_one_process_matches_float64_reference(nesterov, split, scale):
    """The scale modes that are not symmetric in rows and columns meet tall (fc1 24 x 8) and wide (fc2 8 x 12)
    matrices here, so a transposed shape shows (unit_rms_norm: sqrt(3) against sqrt(1/3)). Their factors are at
    most sqrt(3) < sqrt(24), the spectral factor ATOL's analysis takes, so ATOL holds for them too."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups

    groups, be = ParallelGroups.single(), get_backend("cpu")
    ddp, opt = build(groups, be, distributed=False, init=full_init(), muon_nesterov=nesterov, muon_split_qkv=split,
                     muon_scale_mode=scale)
    history = []
    for s in range(STEPS):
        step(ddp, opt, groups, s)
        history.append(full_params(ddp.module, groups))
    ref = reference(full_init(), _mean_grads(1), nesterov=nesterov, split_qkv=split, scale_mode=scale)
    _compare(history, ref, "one process", ATOL)
    # fp32 parameters are their own masters: AdamW's two moments for the rest, the momentum alone for the matrices
    adam = sum(p.numel() for p in ddp.module.parameters() if p.ndim == 1 or p is ddp.module.emb)
    assert opt.state_bytes() == 4 * (sum(p.numel() for p in ddp.module.parameters()) + adam)
    assert "exp_avg_sq" not in opt.state_dict()["tensors"]["fc1"] and "exp_avg_sq" in opt.state_dict()["tensors"]["emb"]
    # the Muon matrices moved by ~lr x scale / sqrt(12) per element per step (the orthogonal factor of the 8 x 12 fc2
    # has singular values ~1, so an element RMS of sqrt(8 / 96)), the check is not vacuous
    moved = float((history[0]["fc2"] - full_init()["fc2"] * (1 - LR * WD)).abs().mean())
    assert moved > 0.3 * LR * SCALES[scale](8, 12) / math.sqrt(12)


@pytest.mark.parametrize("distributed", [False, True])
def test_float64_model_steps_in_float64(distributed):
    """A float64 model's Muon (plain, and distributed at one rank: its bucket gathers) keeps float64 masters and
    momenta and matches the float64 reference. Bound: the engine and the reference differ in the order of
    sums only (12-term dot products, the norm's ~500 squares: <= 500 u, u = 1.1e-16), which Newton-Schulz amplifies
    by at most ~500 (ATOL's slope product): 500 x 500 u ~ 3e-11 relative to |NS| ~ 1 in the worst direction, x
    sqrt(24) x lr (2e-2) ~ 3e-12 a step, ~1.2e-11 over four steps; atol 1e-10. fp32 masters or an fp32
    gather of U (what this guards) err by ~1e-7 or more."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups

    groups, be = ParallelGroups.single(), get_backend("cpu")
    ddp, opt = build(groups, be, distributed=distributed, init=full_init(), dtype=torch.float64)
    history = []
    for s in range(STEPS):
        step(ddp, opt, groups, s)
        history.append(full_params(ddp.module, groups))
    assert all(m.dtype == torch.float64 for m in opt.masters)
    assert all(t.dtype == torch.float64 for ts in opt.state.values() for t in ts)
    for s, (got, want) in enumerate(zip(history, reference(full_init(), _mean_grads(1)), strict=True)):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-10, msg=lambda m: f"step {s} {k}: {m}")


def test_layout_and_modes_refused_or_accepted():
    from omnitron.core.config import ConfigError
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim.muon import uses_muon

    for bad in (dict(muon_num_ns_steps=0), dict(muon_coefficient_type="cubic"), dict(muon_scale_mode="x"),
                dict(muon_tp_mode="rowwise"), dict(muon_momentum=1.0)):
        with pytest.raises(ConfigError, match="--muon-"):
            OptimizerConfig(optimizer="muon", **bad)
    # Megatron takes any step count (quintic cycles, polar_express repeats its last) and its distributed tp mode
    OptimizerConfig(optimizer="muon", muon_coefficient_type="polar_express", muon_num_ns_steps=3)
    OptimizerConfig(optimizer="muon", muon_num_ns_steps=4, muon_tp_mode="distributed")
    from omnitron.core.training.arguments import parse_settings

    flags = parse_settings(_train_args("/tmp/x", ["--muon-no-split-qkv", "--muon-momentum", "0.95"]), 2).optim
    assert ((flags.optimizer, flags.muon_split_qkv, flags.muon_momentum, flags.muon_nesterov)
            == ("muon", False, 0.95, True))
    # Megatron's --muon-scalar-optimizer adam is the AdamW that runs here; lion is refused in one line
    adam = parse_settings(_train_args("/tmp/x", ["--muon-scalar-optimizer", "adam", "--muon-use-syrk"]), 2).optim
    assert adam == flags.__class__(**{**flags.__dict__, "muon_split_qkv": True, "muon_momentum": 0.9})
    with pytest.raises(ConfigError, match="^--muon-scalar-optimizer lion: .* drop the flag or give adam$"):
        parse_settings(_train_args("/tmp/x", ["--muon-scalar-optimizer", "lion"]), 2)
    with pytest.raises(ConfigError, match="--optimizer muon .* --use-torch-fsdp2"):
        parse_settings([a for a in _train_args("/tmp/x", ["--use-torch-fsdp2"], None)
                        if a != "--use-distributed-optimizer"], 2)
    emb = torch.nn.Parameter(torch.zeros(3, 2))
    emb.is_embedding_or_output_parameter = True
    assert uses_muon(torch.nn.Parameter(torch.zeros(3, 2))) and not uses_muon(emb)
    assert not uses_muon(torch.nn.Parameter(torch.zeros(3)))


@pytest.mark.parametrize("prec", ["low", "high"])
def test_low_and_high_matmul_precision_iterate_in_fp32(prec):
    """--muon-fp32-matmul-prec low is Megatron's fp32 path too: torch.set_float32_matmul_precision ignores "low",
    and emerging_optimizers casts to bf16 only under "medium". One step against the float64 reference within
    the fp32 bound of one step worked out at ATOL (6e-5); bf16 iterations leave it (bf16's 4e-3 per rounding,
    a few roundings, on entries of the update ~lr x sqrt(24) x 0.3 = 3e-2: a few 1e-4)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups

    groups, be = ParallelGroups.single(), get_backend("cpu")
    ddp, opt = build(groups, be, distributed=False, init=full_init())
    opt.config.muon_fp32_matmul_prec = prec
    step(ddp, opt, groups, 0)
    got, ref = full_params(ddp.module, groups), reference(full_init(), _mean_grads(1)[:1])[0]
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=6e-5, msg=lambda m: f"{prec} {k}: {m}")
    opt.config.muon_fp32_matmul_prec = "medium"  # the check can fail: bf16 iterations leave the fp32 bound
    step(ddp, opt, groups, 1)
    ref = reference(full_init(), _mean_grads(1)[:2])[1]
    got = full_params(ddp.module, groups)
    assert max(float((got[k] - ref[k]).abs().max()) for k in ("fc1", "fc2", "qkv")) > 6e-5


def test_bf16_iterations_stay_near_fp32():
    """--muon-fp32-matmul-prec medium (Megatron's default): bf16 iterations, the same orthogonal factor within
    bf16's resolution (2^-8 = 4e-3 per rounding, a few roundings per step, not amplified near converged
    singular values where the polynomials' slopes are < 1)."""
    from omnitron.core.optim.newton_schulz import coefficient_schedule, orthogonalize

    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    coeffs = coefficient_schedule("quintic", 5)
    hi, lo = orthogonalize(x, coeffs, bf16=False), orthogonalize(x, coeffs, bf16=True)
    assert lo.dtype == torch.float32
    assert float((lo - hi).norm() / hi.norm()) < 5e-2
    torch.testing.assert_close(hi.double(), _ns(x.double()), rtol=0, atol=1e-5)


SIMPLE = [(3.4445, -4.7750, 2.0315)]


# (kind, steps, Megatron's schedule, a plausible misreading: the other end behaviour or one step fewer)
@pytest.mark.parametrize("kind,steps,schedule,wrong", [
    ("quintic", 7, QUINTIC + QUINTIC[:2], QUINTIC + QUINTIC[-1:] * 2), ("quintic", 3, QUINTIC[:3], QUINTIC[:2]),
    ("polar_express", 3, POLAR[:3], POLAR[:2]), ("polar_express", 10, POLAR + POLAR[-1:] * 2, POLAR + POLAR[:2]),
    ("simple", 2, SIMPLE * 2, SIMPLE)])
def test_ns_step_counts_follow_megatrons_schedule(kind, steps, schedule, wrong):
    """--muon-num-ns-steps N with a coefficient type whose set count does not divide N: Megatron's Muon
    (emerging_optimizers v0.3.0) cycles through the "simple" / "quintic" sets and runs "polar_express" in order,
    repeating its last; against a float64 Newton-Schulz on that schedule. Tolerance: fp32 iterations (u = 6e-8)
    on a 20 x 12 matrix, ~k u = 1e-6 per matmul amplified by at most the product of the slopes at 0 (quintic
    7 steps: 4.1 x 4.0 x 3.7 x 2.9 x 2.8 x 4.1 x 4.0 = 8e3; polar_express's first slope 8.2) and shrunk again
    where singular values converge: 1e-3 absolute on entries ~0.3 still tells apart one step more or less or a
    wrong triple (those move entries by > 1e-2)."""
    from omnitron.core.optim.newton_schulz import coefficient_schedule, orthogonalize

    x = torch.randn(20, 12, generator=torch.Generator().manual_seed(11))
    got = orthogonalize(x, coefficient_schedule(kind, steps), bf16=False).double()
    torch.testing.assert_close(got, _ns(x.double(), schedule), rtol=0, atol=1e-3)
    assert float((got - _ns(x.double(), wrong)).abs().max()) > 1e-2


def test_tp2_distributed_tp_mode_is_the_whole_matrix_update():
    """--muon-tp-mode distributed (Megatron's Gram all-reduce mode, whole-matrix like duplicated) at tp2, plain
    and distributed optimizer, against the float64 whole-matrix reference."""
    ref = reference(full_init(), _mean_grads(1))
    for r in run_distributed(layout_worker, 2, 2, False, "distributed"):
        _compare(r["plain"], ref, "tp2 distributed mode plain")
        _compare(r["dist"], ref, "tp2 distributed mode distributed")


@pytest.mark.parametrize("tp,backend", [(1, "cpu"), (2, "cpu"),
                                        pytest.param(1, "sim", marks=[pytest.mark.slow, requires_sim()])])
def test_world2_matches_float64_reference_and_resumes_bit_exact(tp, backend):
    """tp 1: dp2, plain and distributed; tp 2: whole-matrix orthogonalisation over tp (plain; the distributed
    optimizer is then one shard). The distributed run restarted from its state after 2 steps continues bit
    for bit. ``sim``: the same on the simulated accelerator (device tensors, asynchronous streams)."""
    res = run_distributed(layout_worker, 2, tp, True, backend=backend)
    dp = 2 // tp
    ref = reference(full_init(), _mean_grads(dp))
    for r in res:
        _compare(r["plain"], ref, f"tp{tp} plain")
        _compare(r["dist"], ref, f"tp{tp} distributed")
        assert r["dist_keys"] == r["plain_keys"] and r["plain_keys"]["fc2"] == ["exp_avg"]
        for got, want in zip(r["resumed"], r["dist"][2:], strict=True):
            assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_tp2_dp2_distributed_matches_float64_reference():
    res = run_distributed(layout_worker, 4, 2, False)
    ref = reference(full_init(), _mean_grads(2))
    for r in res:
        _compare(r["dist"], ref, "tp2 dp2 distributed")
        _compare(r["plain"], ref, "tp2 dp2 plain")


# float64 (u = 2**-53 = 1.1e-16). tp2 and tp1 x dp2 differ in the order of sums only: tp splits contractions of
# <= 128 terms, dp adds 2 partial gradients where tp2 accumulates 2 micro-batches: <= 128 u = 1.4e-14 relative on
# a gradient. Muon's momentum carries it, five Newton-Schulz steps amplify a relative input error by at most the
# product of the polynomials' slopes, ~500 (ATOL's analysis): <= 7e-12 relative on an update of ~lr x sqrt(128)
# = 3.4e-2 per element, 2.4e-13 absolute. A loss moves by the gradient's inner product with the weights' errors:
# over N ~ 5e4 weights <= ||g|| sqrt(N) x 2.4e-13 ~ 1 x 224 x 2.4e-13 = 5e-11 absolute per step on a loss ~5.3,
# 1e-11 relative; iterations 3 and 4 add the earlier steps' errors: <= 3e-11. RESUME_REL = 1e-10 leaves a factor
# 3 over that worst case (errors of random sign add as sqrt: ~100x typical). An fp32 run needed 1e-5; a resume
# that drops or rescales the momentum (5e-4) or rounds it to fp32 (~1e-8 relative on the update) fails here.
RESUME_REL = 1e-10


def _train_args(root, extra=(), dtype="--bf16"):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "200", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "3e-3", "--log-interval", "1", "--seed", "7", "--no-tensorboard",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--optimizer", "muon", "--muon-nesterov",
            "--use-distributed-optimizer", *([dtype] if dtype else []), "--save", root,
            "--data-cache-path", os.path.join(root, "cache"), *extra]


def resume_worker(root: str) -> dict:
    """bf16 at dp2: 4 iterations, and 2 + save + 2 resumed. A float64 model at tp2: 4 iterations, and 2 + save + 2
    resumed at tp1 x dp2 (the checkpoint resharded on load)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    be, world = get_backend(), dist.get_world_size()

    def run(root, extra=(), dtype="--bf16"):
        # no precision flag: the model in float64
        return train(settings_in(_train_args(root, extra, dtype), world, None if dtype else torch.float64),
                     be)["losses"]

    out = {"full": run(os.path.join(root, "full"))}
    part = os.path.join(root, "part")
    out["resumed"] = {**run(part, ["--exit-interval", "2"]), **run(part, ["--load", part])}
    tp2 = ["--tensor-model-parallel-size", "2"]
    out["tp2"] = run(os.path.join(root, "tp2"), tp2, None)
    for fmt in ("torch_dist", "torch"):
        part, f = os.path.join(root, f"tp2part_{fmt}"), ["--ckpt-format", fmt]
        out[f"tp2_to_dp2_{fmt}"] = {**run(part, [*tp2, *f, "--exit-interval", "2"], None),
                                    **run(part, [*f, "--load", part], None)}
    return out


def test_training_loop_resumes_bit_exact_and_reshards(tmp_path):
    """--optimizer muon --use-distributed-optimizer through the CLI at world 2: bf16 dp2, 4 iterations == 2, save,
    resume for 2, bit for bit (the checkpoint carries the Muon momentum); a float64 model at tp2 resumed at tp1 x
    dp2 (both checkpoint formats, resharded on load) continues the tp2 run (whole-matrix orthogonalisation makes
    the update tp-independent), within RESUME_REL (derived beside it); resuming without the optimizer state
    (--no-load-optim) moves iteration 4's loss by ~5e-4."""
    res = run_distributed(resume_worker, 2, str(tmp_path))
    full = res[0]["full"]
    assert sorted(full) == [1, 2, 3, 4] and len(set(full.values())) > 1
    assert res[0]["resumed"] == full
    ref = res[0]["tp2"]
    for fmt in ("torch_dist", "torch"):
        got = res[0][f"tp2_to_dp2_{fmt}"]
        assert sorted(got) == [1, 2, 3, 4]
        for it in ref:
            assert abs(got[it] - ref[it]) <= RESUME_REL * abs(ref[it]), (fmt, it, got, ref)


def replicated_kv_worker() -> dict:
    """tp2 with one key/value group (linear_q sharded, linear_kv replicated over tp) and the one-process model:
    two Muon steps on the same batch; the largest difference of each full parameter."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.models.gpt import GPTConfig, GPTModel, allreduce_sequence_parallel_grads, gather_full_state
    from omnitron.core.optim.muon import Muon
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend("cpu")
    cfg = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=1, ffn_hidden_size=48,
                    seq_length=8, vocab_size=64, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                    attention_dropout=0.0, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                    untie_embeddings_and_output_weights=True, add_bias_linear=False, params_dtype=torch.float64)
    layouts = {"tp": ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=be),
               "ref": ParallelGroups.single()}
    models = {k: GPTModel(cfg, g, seed=3) for k, g in layouts.items()}
    config = OptimizerConfig(optimizer="muon", lr=LR, weight_decay=WD, clip_grad=0.0, muon_fp32_matmul_prec="high")
    opts = {k: Muon(list(m.named_parameters()), config, layouts[k], backend=be) for k, m in models.items()}
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(4))
    for _ in range(2):
        for k, m in models.items():
            opts[k].zero_grad()
            m(tokens, labels=tokens).mean().backward()
        allreduce_sequence_parallel_grads(models["tp"], layouts["tp"])
        for k in models:
            assert not opts[k].step(LR).skipped
    got, want = gather_full_state(models["tp"], layouts["tp"]), gather_full_state(models["ref"], layouts["ref"])
    return {k: float((got[k] - want[k]).abs().max()) for k in want}


def test_replicated_key_value_weight_takes_the_one_process_update():
    """Fewer key/value groups than tp ranks: the key/value weight is a replicated parameter of its own, and
    --muon-split-qkv (the default) must orthogonalise its K and V rows apart as the fused weight's blocks are
    at one process. float64 throughout: the two layouts differ by the order of tp partial sums only (~1e-16
    relative, amplified by <= 500 through Newton-Schulz, as at ATOL): 1e-10 absolute on updates of ~lr = 2e-2
    leaves orders of magnitude either way (orthogonalising K and V together moves them by ~1e-2)."""
    diffs = run_distributed(replicated_kv_worker, 2)[0]
    assert any("linear_qkv" in k for k in diffs), sorted(diffs)
    assert max(diffs.values()) < 1e-10, {k: v for k, v in diffs.items() if v >= 1e-10}


def test_whole_qkv_refused_where_the_fused_weight_is_split():
    from omnitron.core.config import ConfigError
    from omnitron.core.training.arguments import parse_settings

    args = _train_args("/tmp/x",
                       ["--muon-no-split-qkv", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="^--muon-no-split-qkv .* --num-query-groups 1 < --tensor-model-parallel"):
        parse_settings(args, 2)
    parse_settings(_train_args("/tmp/x", ["--num-query-groups", "1", "--tensor-model-parallel-size", "2"]), 2)


@pytest.mark.parametrize("mode", ["duplicated", "distributed", "blockwise"])
def test_whole_matrix_group_is_expert_tensor_parallel_for_experts(mode):
    """An expert weight is sharded over expert tensor parallelism (--expert-tensor-parallel-size), which may differ
    from tp: its whole matrix is gathered over ``groups.etp``, a dense weight's over ``groups.tp``; a group of one
    rank, an unsharded weight or --muon-tp-mode blockwise gathers nothing (the module docstring's rule). Both group
    sizes are tried against each other (tp 1 / etp 2 and tp 2 / etp 1), so taking one group for the other shows."""
    from types import SimpleNamespace

    from omnitron.core.optim.muon import MuonMixin

    def param(sharded: bool, expert: bool) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros(4, 2))
        p.tensor_model_parallel, p.expert = sharded, expert
        return p

    for tp, etp in ((1, 2), (2, 1)):
        groups = SimpleNamespace(tp=SimpleNamespace(size=tp, name="tp"), etp=SimpleNamespace(size=etp, name="etp"))
        opt = SimpleNamespace(config=SimpleNamespace(muon_tp_mode=mode), groups=groups)
        for sharded in (True, False):
            for expert in (True, False):
                want = groups.etp if expert else groups.tp
                if mode == "blockwise" or not sharded or want.size == 1:
                    want = None
                assert MuonMixin._tp_group(opt, param(sharded, expert)) is want, (tp, etp, sharded, expert)
