"""Kernel implementations named ``"sim_flash"``: the CPU flash-attention kernels on sim tensors.

sim memory is host memory, and ATen's CPU flash-attention kernel (with its log-sum-exp and backward) runs
on it as it is; so ring attention on ``sim`` runs the same tiled kernel as on ``cpu``
(:mod:`omnitron.backends.cpu.kernels`), never the ``[sq, sk]`` scores of the reference. Dropout and
non-square causal blocks decline to the reference, as there.

Plain core attention (op ``attention``) too: SDPA dispatches on the device type and takes its math path on sim
tensors (``[b, h, s, s]`` scores, saved for backward), where on the host and on a GPU it runs a fused kernel; so
without dropout sim calls the same ATen kernel and its backward directly (:class:`_Flash`), and its memory figures
mean what a fused device's would. Dropout, a ``v`` head dim unlike ``q``'s (MLA) and non-square causal calls decline
to the reference (SDPA's math path), as the blocks do.
"""
from __future__ import annotations

import torch

from omnitron.backends.cpu import kernels as cpu
from omnitron.backends.sim import device as sim_device
from omnitron.kernels.registry import register

IMPL = "sim_flash"
_fwd, _bwd = cpu.supports_on(sim_device.NAME)
register("attention_block_forward", IMPL, cpu.block_forward, available=cpu.flash_available, backends=("sim",),
         supports=_fwd, traceable=True)
register("attention_block_backward", IMPL, cpu.block_backward, available=cpu.flash_available, backends=("sim",),
         supports=_bwd, traceable=True)


class _Flash(torch.autograd.Function):
    """Causal or full attention of ``q`` over ``k, v`` on ATen's CPU flash kernels: saves q, k, v, the output and
    the log-sum-exp (``O(s d)``), as a fused kernel does."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        out, lse = cpu.block_forward(q, k, v, causal=causal, scale=scale)
        ctx.causal, ctx.scale = causal, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = cpu.block_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def _attention_supports(q, k, v, causal: bool = True, dropout_p: float = 0.0, scale=None) -> str | None:
    """None where :func:`attention` takes the call, else why not (dropout, or what the block kernel declines)."""
    if dropout_p:
        return "attention dropout runs SDPA's dropout (the reference)"
    return _fwd(q, k, v, causal=causal, scale=scale)


@register("attention", IMPL, available=cpu.flash_available, backends=("sim",), supports=_attention_supports)
def attention(q, k, v, causal: bool = True, dropout_p: float = 0.0, scale: float | None = None):
    """``softmax(q k^T * scale) v`` (grouped-query heads) on the flash kernels, no ``[s, s]`` scores."""
    return _Flash.apply(q, k, v, causal, q.shape[-1] ** -0.5 if scale is None else scale)
