"""Tiny out-of-tree backend plug-ins a vendor could write by mistake, and one correct one, over the cpu backend's
device (tests/backends/test_plugin_contract.py). Each is found through ``OMNITRON_EXTRA_BACKENDS`` as
docs/backends.md describes; ``KERNEL`` names the implementations they register (under real op names, restricted
to these backends, so no other backend's table can pick them)."""
from __future__ import annotations

import dataclasses

import torch

from omnitron.backends.base import Backend
from omnitron.backends.cpu import CPUBackend
from omnitron.kernels.registry import register

KERNEL = "plugin_test"
NAMES = ("plugin-wrongsig", "plugin-badimport", "plugin-counting", "plugin-missing", "plugin-nofp8",
         "plugin-wrongsupports", "plugin-unavailable", "plugin-nomemory",
         "plugin-bf16only")


class MissingMethods(Backend):
    """Sets the class attributes and ``probe`` but implements none of the device methods."""

    name, device_type, dist_backend = "plugin-missing", "cpu", "gloo"

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "host CPU"


class _OnCPU(CPUBackend):
    """The cpu backend's device, collectives and memory under another name, with only its own kernels first."""

    def kernel_preference(self) -> tuple[str, ...]:
        return (KERNEL, "reference")


class WrongSignature(_OnCPU):
    """Registers an ``rms_norm`` that forgot the reference's ``eps``."""

    name = "plugin-wrongsig"

    def register_kernels(self) -> None:
        register("rms_norm", KERNEL, lambda x, weight: x * weight, backends=(self.name,))


class BadImport(_OnCPU):
    """Its kernel module needs a library that is not installed."""

    name = "plugin-badimport"

    def register_kernels(self) -> None:
        import plugin_vendor_kernels_not_installed  # noqa: F401


CALLS = {"swiglu": 0}


def counting_swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU in plain torch (float64 inside), counting its calls."""
    CALLS["swiglu"] += 1
    if bias is not None:
        x = x + bias
    a, b = x.double().chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


class Counting(_OnCPU):
    """A correct plug-in with one kernel of its own (``swiglu``)."""

    name = "plugin-counting"

    def register_kernels(self) -> None:
        register("swiglu", KERNEL, counting_swiglu, backends=(self.name,))


class NoFP8(Counting):
    """A device without float8 (its capabilities list no FP8 formats or recipes)."""

    name = "plugin-nofp8"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), fp8_formats=(), fp8_recipes=(), fp8_gemm=None)


class WrongSupports(_OnCPU):
    """A correct ``swiglu`` whose ``supports`` forgot the reference's ``bias`` (called with the op's arguments)."""

    name = "plugin-wrongsupports"

    def register_kernels(self) -> None:
        register("swiglu", KERNEL, counting_swiglu, supports=lambda x: None, backends=(self.name,))


class Unavailable(_OnCPU):
    """Its ``swiglu`` is registered, but the library it needs is not loaded in this process."""

    name = "plugin-unavailable"

    def register_kernels(self) -> None:
        register("swiglu", KERNEL, counting_swiglu, available=lambda: (False, "mychip_lib is not loaded"),
                 backends=(self.name,))


class NoMemoryCounters(Counting):
    """A correct plug-in whose runtime has no allocator counters: every ``memory_stats`` count is None, as
    docs/backends.md allows ("None where the device cannot say")."""

    name = "plugin-nomemory"

    def memory_stats(self) -> dict[str, int | None]:
        return dict.fromkeys(("allocated", "reserved", "peak_allocated", "peak_reserved", "free", "total"))


class BF16Only(Counting):
    """A device that computes in float32 and bfloat16 only (no float16 in its capabilities)."""

    name = "plugin-bf16only"

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), dtypes=(torch.float32, torch.bfloat16))


TARGETS = ",".join(f"{n}=broken_plugins:{c}" for n, c in zip(NAMES, (
    "WrongSignature", "BadImport", "Counting", "MissingMethods", "NoFP8", "WrongSupports", "Unavailable",
    "NoMemoryCounters", "BF16Only")))
"""``OMNITRON_EXTRA_BACKENDS`` for all of them (the tests put tests/backends on ``PYTHONPATH``)."""
