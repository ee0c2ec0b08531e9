"""AdamW kernels over many steps with betas near 1, against ``torch.optim.AdamW`` on float64 copies.

Each implementation of ``adamw_step`` usable here (float32 parameters, the main params of a bf16 model, and moments;
float32 or bf16 gradients) runs STEPS steps of fresh random gradients whose scales span 1e-3..1e2 across elements,
with weight decay, beside a float64 ``torch.optim.AdamW`` started from the same values.

Error analysis (u = 2^-24 = 6.0e-8, float32's unit roundoff):
* The second moment ``v`` is a weighted mean of g^2 with weights set by ``w2 = 1 - beta2``. Formed from float32
  betas, ``1.0f - float(beta2)`` carries beta2's own rounding (up to u/2 absolute), a relative error of
  (u/2) / (1 - beta2): 3e-4 at beta2 = 0.9999, 3e-5 at 0.999, which biases every v by about that much. Rounded once
  from double, w2 is within u/2 relative, and v's bias from it is <= u/2.
* Each step rounds v's update a few times (g*g, the difference, the product with w2, the sum: <= 2u of v
  relative), zero-mean on random data, so the mean over N elements of the relative error of v, after T steps
  whose errors decay by beta2 per step, has a standard deviation <= 2u sqrt(T / N) (T = 400, N = 1024: 1.25u).
  BOUND_V = u/2 (the weight) + 6 sigma (7.5u) + u (the bias corrections, each rounded once to float32) = 9u. The
  float32-beta weights fail it by 20x (beta2 = 0.999) and 300x (0.9999).
* The parameters: each implementation does the same float32 steps up to a couple of roundings per element, so its
  worst error over the elements is that of torch's fused AdamW in float32 on the same inputs, within a factor of 2
  (the second reference of what is acceptable: Megatron's fused Adam rounds the same way). 4u |p| absolute is added
  for parameters the update does not move (an element whose error is one rounding of p).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.kernels import get_impl, implementations

U, N, STEPS = 2.0 ** -24, 1024, 400
BOUND_V = 9 * U


def _impls():
    return [pytest.param(name, id=name) for name in sorted(implementations("adamw_step"))]


def _usable(name):
    ok, why = implementations("adamw_step")[name].available()
    if not ok:
        pytest.skip(f"adamw_step/{name} unavailable here: {why}")
    return get_impl("adamw_step", name)


@pytest.mark.parametrize("betas,lr,grad_dtype", [((0.95, 0.999), 1e-2, torch.float32),
                                                 ((0.9, 0.9999), 1e-2, torch.bfloat16),  # a bf16 model's grads
                                                 ((0.9, 0.9999), 1e-5, torch.float32)],
                         ids=("0.95-0.999-fp32", "0.9-0.9999-bf16", "0.9-0.9999-tiny-lr-fp32"))
@pytest.mark.parametrize("name", _impls())
def test_adamw_many_steps_against_float64(name, betas, lr, grad_dtype):
    fn = _usable(name)
    (b1, b2), wd, eps = betas, 0.1, 1e-8
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    scale = torch.exp(torch.empty(N).uniform_(-7.0, 4.6, generator=gen))  # 1e-3 .. 1e2 per element
    p0 = torch.randn(N, generator=gen)
    p, m, v = p0.clone(), torch.zeros(N), torch.zeros(N)
    ref = torch.nn.Parameter(p0.double())
    opt64 = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    fused = torch.nn.Parameter(p0.clone())
    try:
        opt32 = torch.optim.AdamW([fused], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
    except RuntimeError:  # a torch without the CPU fused kernel: the plain float32 loop is the same arithmetic
        opt32 = torch.optim.AdamW([fused], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for step in range(1, STEPS + 1):
        g = (torch.randn(N, generator=gen) * scale).to(grad_dtype)
        fn([p], [g], [m], [v], step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd)
        ref.grad, fused.grad = g.double(), g.float()
        opt64.step()
        opt32.step()
    v64 = opt64.state[ref]["exp_avg_sq"]
    bias_v = float(((v.double() - v64) / v64).mean())
    assert abs(bias_v) <= BOUND_V, f"{name}: v's mean relative error {bias_v:.3g} > {BOUND_V:.3g}"
    p64 = ref.detach()
    err = float((p.double() - p64).abs().max())
    err_fused = float((fused.detach().double() - p64).abs().max())
    assert err <= 2 * err_fused + 4 * U * float(p64.abs().max()), (name, err, err_fused)
