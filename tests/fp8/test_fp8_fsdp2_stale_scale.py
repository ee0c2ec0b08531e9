"""FP8 with FSDP2 (:mod:`omnitron.core.precision.fp8.fsdp`): a weight that changes between forwards is gathered with
a scale taken from its new value, whatever changed it: an optimizer step followed by the step's refresh (the
training path), an optimizer step without the refresh, an in-place write (``mul_``) and a ``.data`` copy outside
any step (the shard's fallback: before the fix the local shard's own version counters were compared, which none of
these moves, and the gathered weight kept its old scale; on ``sim`` the optimizer's foreach step moves not even the
parameter's counter). Tensorwise only: FSDP2 refuses the other recipes
(:func:`~omnitron.core.precision.fp8.fsdp.fsdp_refusal`, tested in test_fp8_fsdp2.py).

Each forward's FP8 linear output is checked against a float64 reference of the quantized forward, computed in one
process from the linear's whole current weight and bias and its captured input: ``q(v) = fp8(clamp(v * s))``, ``s =
448 / max|v|`` taken in fp32 (e4m3's largest value; the tensorwise recipe, margin 0), ``y = (q(x) / s_x) @ (q(W) /
s_W)^T + b`` in float64.

Bound. The codes are equal (the same fp32 products rounded to e4m3, the amax the max over shards of the whole
weight's), so the engine's output differs from the reference only by its fp32 GEMM: each product of two e4m3 codes
is exact in fp32 (4 + 4 significant bits), the K-term sum errs by at most ``K u`` times the sum of the terms' moduli
and the two scale multiplies add ``2 u`` more (``u = 2^-24``): ``|dy| <= (K + 2) u sum_k |q(x)_k q(W)_k| / (s_x
s_W)``, plus the bias add's rounding, ``u |y|`` (1% more for the sum's own error), computed per element. A stale scale changes codes: a weight tripled under its old scale saturates at 448 (an
error of two thirds of its largest terms); one scaled by 1/3 rounds other significands (e4m3 steps are 2^-3
relative), each far past the bound.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

E4M3_MAX = 448.0
U32 = 2.0 ** -24


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 output of the tensorwise-quantized forward with bias ``b`` (wide, added after the GEMM), its fp32
    error bound per element)."""
    def q(v):
        s = torch.tensor(E4M3_MAX, dtype=torch.float32) / v.float().abs().max()
        return (v.float() * s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double(), s.double()

    (qx, sx), (qw, sw) = q(x), q(w)
    y = (qx @ qw.t()) / (sx * sw)
    bound = (x.shape[-1] + 2) * U32 * (qx.abs() @ qw.abs().t()) / (sx * sw)
    if b is not None:
        y = y + b.double()
        bound = bound + U32 * y.abs() * 1.01  # the bias add's rounding (of the slightly perturbed sum)
    return y, bound


def _worker(seed: int) -> list:
    """dp = world FSDP2 over a 2-layer GPT with tensorwise FP8 (fp32 masters and compute); per change of the
    weights, rank 0's check of the first layer's fc1 and qkv outputs: (case, linear, max |y - ref| / bound)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt import GPTConfig, GPTModel
    from omnitron.core.parallel.data.fsdp import apply_fsdp2
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import FP8Config, enable_fp8
    from omnitron.core.precision.fp8.fsdp import WeightScales

    torch.set_num_threads(1)
    be = get_backend()
    world = dist.get_world_size()
    groups = ParallelGroups.build(ParallelConfig(), backend=be)  # dp = world
    torch.manual_seed(seed)  # every rank the same weights and data
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, ffn_hidden_size=48, seq_length=8,
                    vocab_size=64, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, groups)
    enable_fp8(model, FP8Config(fp8_recipe="tensorwise", fp8_format="hybrid"), groups, backend=be)
    scales = WeightScales(groups.dp_cp, be.collectives)
    apply_fsdp2(model.to(be.device()), groups, compute_dtype=torch.float32, device_type=be.device_type,
                collectives=be.collectives, fp8_scales=scales)
    scales.refresh()
    names = ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.self_attention.linear_qkv")
    seen = {}
    for name in names:
        model.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0].detach(), out.detach())))
    tokens = torch.randint(0, 64, (2, 8)).to(be.device())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []

    def check(case: str) -> None:
        seen.clear()
        loss = model(tokens, labels=tokens).float().mean()
        for name in names:
            m = model.get_submodule(name)
            w = m.weight.full_tensor().detach().cpu()  # the whole current (fp32 master) weight
            b = m.bias.full_tensor().detach().cpu() if m.bias is not None else None
            x, y = seen[name]
            x = x.cpu().reshape(-1, x.shape[-1])
            ref, bound = _reference(x, w, b)
            err = (y.cpu().reshape(ref.shape).double() - ref).abs() / bound.clamp_min(1e-300)
            out.append((case, name, float(err.max())))
        loss.backward()

    check("first forward")
    opt.step()
    opt.zero_grad()
    scales.refresh()  # what train_step does after each optimizer step
    check("optimizer step, refreshed")
    opt.step()
    opt.zero_grad()
    check("optimizer step, not refreshed")
    opt.zero_grad()
    with torch.no_grad():
        model.get_submodule(names[0]).weight.mul_(3.0)
    check("in-place mul_ x 3")
    opt.zero_grad()
    with torch.no_grad():
        w = model.get_submodule(names[1]).weight
        w.data.copy_(w.data / 3.0)  # no version counter sees it; the write through the wrapper does
    check(".data copy_ / 3")
    return out if dist.get_rank() == 0 else []


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=[requires_sim(), pytest.mark.slow])])
def test_a_changed_weight_is_rescaled_before_the_next_forward(backend):
    seed = int.from_bytes(os.urandom(4), "little")
    results = run_distributed(_worker, 2, seed, backend=backend, timeout_s=240)[0]
    assert len(results) == 5 * 2, results
    bad = [r for r in results if not r[2] <= 1.0]
    assert not bad, (seed, bad)
