"""The MUSA backend (Moore Threads): torch_musa runtime, MCCL collectives, muDNN-backed kernels.

``manifest.txt`` lists every torch_musa name the backend calls; the test double in
``omnitron.testing.musa_double`` provides exactly those names.
"""
from omnitron.backends.musa.backend import MUSABackend

__all__ = ["MUSABackend"]
