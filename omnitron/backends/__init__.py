"""Backends: the only place a vendor is named. The engine calls :func:`get_backend`."""
from omnitron.backends.base import Backend, Capabilities, NullEvent, NullStream
from omnitron.backends.registry import BackendUnavailableError, get_backend, known_backends, probe_all

__all__ = ["Backend", "Capabilities", "NullEvent", "NullStream", "BackendUnavailableError", "get_backend",
           "known_backends", "probe_all"]
