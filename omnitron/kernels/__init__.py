"""Fused ops behind one registry. Use ``get_backend().kernels.<op>(...)`` in the engine.

Public API: :func:`ops`, :func:`implementations`, :func:`get_impl`, :func:`register`,
:class:`KernelTable` (``resolved(op)``, ``table()``).
"""
from omnitron.kernels.registry import KernelTable, get_impl, implementations, ops, register

__all__ = ["KernelTable", "get_impl", "implementations", "ops", "register"]
