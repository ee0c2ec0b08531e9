"""The CUDA backend: NCCL collectives, CUDA streams/events/memory/RNG, Triton kernels, TE FP8 where installed."""
from omnitron.backends.cuda.backend import CUDABackend

__all__ = ["CUDABackend"]
