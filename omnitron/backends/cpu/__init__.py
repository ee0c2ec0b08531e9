"""The CPU backend: gloo collectives, synchronous no-op streams, FP8 by torch's float8 types."""
from omnitron.backends.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
