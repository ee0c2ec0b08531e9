"""Multi-tensor AdamW step and gradient norm references (no autograd; in place)."""
from __future__ import annotations


import torch

from omnitron.kernels.registry import register


@register("adamw_step", "reference")
def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float) -> None:
    """One decoupled-weight-decay Adam step on float32 lists, in place (step counts from 1)."""
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    with torch.no_grad():
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            g = g.to(p.dtype)
            if weight_decay:
                p.mul_(1.0 - lr * weight_decay)
            m.lerp_(g, 1.0 - beta1)
            v.lerp_(g * g, 1.0 - beta2)  # the weight rounded once: no float32 beta2 in the recursion
            denom = (v / bc2).sqrt_().add_(eps)
            step_size = -lr / bc1
            if abs(step_size) <= torch.finfo(p.dtype).max:
                p.addcdiv_(m, denom, value=step_size)
            else:  # addcdiv_ refuses a scalar its dtype cannot hold; overflow to inf as the fused kernels do
                p.add_(m / denom * step_size)


@register("grad_norm_sq", "reference")
def grad_norm_sq(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element of ``tensors`` as a float32 scalar (sqrt after all-reduce)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=tensors[0].device)
    for t in tensors:
        total += t.float().pow(2).sum()
    return total


