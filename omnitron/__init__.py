"""omnitron: one 3D-parallel FP8 training engine for Transformer LMs, on any backend.

Pick the accelerator with ``OMNITRON_BACKEND=cpu|cuda|musa|auto``; see ``omnitron.backends``.
"""
__version__ = "0.1.0"
