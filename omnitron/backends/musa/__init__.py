"""The MUSA backend (Moore Threads): torch_musa runtime, MCCL collectives, muDNN-backed kernels.

``manifest.txt`` lists the torch_musa surface (from its documented API) that the test double in
``omnitron.testing.musa_double`` provides, exactly; every torch_musa name the backend calls is in it.
"""
from omnitron.backends.musa.backend import MUSABackend

__all__ = ["MUSABackend"]
