"""The sim backend: a simulated accelerator (PrivateUse1 over host memory) with simccl collectives."""
from omnitron.backends.sim.backend import SimBackend

__all__ = ["SimBackend"]
