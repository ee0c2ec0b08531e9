"""AdamW step and sum of squares in Triton: one launch per tensor (no pointer-array multi-tensor
apply yet), blocks of elements per program; partial sums reduced by one torch ``sum``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, available, check, interpreting


@triton.jit
def _adamw(P, G, M, V, n, decay, w1, w2, bc2, eps, step_size, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(P + offs, mask=mask)
    g = tl.load(G + offs, mask=mask).to(tl.float32)
    m = tl.load(M + offs, mask=mask)
    v = tl.load(V + offs, mask=mask)
    p = p * decay
    m = m + w1 * (g - m)
    v = v + w2 * (g * g - v)
    p = p + step_size * (m / (tl.sqrt(v / bc2) + eps))
    tl.store(P + offs, p, mask=mask)
    tl.store(M + offs, m, mask=mask)
    tl.store(V + offs, v, mask=mask)


@triton.jit
def _sum_sq(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(OUT + tl.program_id(0), tl.sum(x * x, axis=0))


def _block() -> int:
    return 1 << 16 if interpreting() else 4096


def _adamw_supports(params, grads, exp_avgs, exp_avg_sqs, **_) -> str | None:
    if not (len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs)):
        return "params, grads, exp_avgs and exp_avg_sqs differ in length"
    for group in (params, exp_avgs, exp_avg_sqs):
        for t in group:
            why = check(t, dtypes=(torch.float32,))
            if why or not t.is_contiguous():
                return why or "params and moments must be contiguous"
    for p, g in zip(params, grads):
        why = check(g)
        if why or not g.is_contiguous() or g.numel() != p.numel():
            return why or "grads must be contiguous and sized like their params"
    return None


@register("adamw_step", NAME, available=available, backends=GPU_BACKENDS, supports=_adamw_supports)
def adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """AdamW in place (same arithmetic order as the reference), one launch per tensor. The moment weights
    1 - beta are formed here in double and rounded once: formed in the kernel from float32 betas they would carry
    beta's rounding, a relative error of up to 3e-4 in 1 - 0.9999 (csrc/cpu/optim.cpp says more)."""
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    block = _block()
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if p.numel():
            _adamw[(triton.cdiv(p.numel(), block),)](p, g, m, v, p.numel(), 1.0 - lr * weight_decay, 1.0 - beta1,
                                                      1.0 - beta2, bc2, eps, -lr / bc1, BLOCK=block)


@register("grad_norm_sq", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda tensors: next((w for w in (check(t) for t in tensors) if w), None))
def grad_norm_sq(tensors) -> torch.Tensor:
    """Sum of squares of all elements as a float32 scalar (per-block partials, float64 total)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    block = _block()
    parts = []
    for t in tensors:
        t = t.contiguous()
        out = torch.empty(triton.cdiv(t.numel(), block), dtype=torch.float32, device=t.device)
        if t.numel():
            _sum_sq[(out.numel(),)](t, out, t.numel(), BLOCK=block)
        parts.append(out)
    return torch.cat(parts).double().sum().float()
