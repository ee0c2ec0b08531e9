"""The MUSA backend (Moore Threads): torch_musa runtime, MCCL collectives, muDNN-backed kernels.

``manifest.txt`` lists the torch_musa surface that the test double in ``omnitron.testing.musa_double``
provides, exactly; every torch_musa name the backend calls is in it. ``torch_musa_api/<tag>.txt`` is that
API as read from torch_musa's own source at each tag (``scripts/extract_torch_musa_api.py``).
"""
from omnitron.backends.musa.backend import MUSABackend

__all__ = ["MUSABackend"]
