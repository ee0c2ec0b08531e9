"""Plain-PyTorch references for every fused op (differentiable; the numerics contract)."""
from omnitron.kernels.reference import activations, attention, fp8, losses, norms, optim, rope  # noqa: F401
