"""Plain-PyTorch references for every fused op (differentiable; the numerics contract)."""
from omnitron.kernels.reference import (  # noqa: F401
    activations, attention, attention_block, cross_entropy_shard, fp8, losses, norms, optim, residual_norms, rope)
