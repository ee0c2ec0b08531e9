"""Kernel implementations named ``"sim_flash"``: the CPU flash-attention block kernels on sim tensors.

sim memory is host memory, and ATen's CPU flash-attention kernel (with its log-sum-exp and backward) runs
on it as it is; so ring attention on ``sim`` runs the same tiled kernel as on ``cpu``
(:mod:`omnitron.backends.cpu.kernels`), never the ``[sq, sk]`` scores of the reference. Dropout and
non-square causal blocks decline to the reference, as there.
"""
from __future__ import annotations

from omnitron.backends.cpu import kernels as cpu
from omnitron.backends.sim import device as sim_device
from omnitron.kernels.registry import register

IMPL = "sim_flash"
_fwd, _bwd = cpu.supports_on(sim_device.NAME)
register("attention_block_forward", IMPL, cpu.block_forward, available=cpu.flash_available, backends=("sim",),
         supports=_fwd, traceable=True)
register("attention_block_backward", IMPL, cpu.block_backward, available=cpu.flash_available, backends=("sim",),
         supports=_bwd, traceable=True)
