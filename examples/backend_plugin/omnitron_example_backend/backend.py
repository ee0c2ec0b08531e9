"""``ExampleBackend``: the whole backend contract of ``omnitron.backends.base.Backend`` on the host CPU.

A vendor replaces each method body with its runtime's call (``torch.<vendor>.synchronize()``, the
vendor's allocator statistics, its generator, its collectives library as ``dist_backend``) and keeps
the shape. Nothing in omnitron changes: the package's entry point (pyproject.toml) makes
``get_backend("example")`` find it.
"""
from __future__ import annotations

import torch

from omnitron.backends.base import Backend, Capabilities
from omnitron.backends.collectives import Collectives


class ExampleBackend(Backend):
    """Host CPU tensors, gloo collectives, the ``example`` kernels first, then the references."""

    name = "example"
    device_type = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        self._collectives = Collectives(self.dist_backend, fp8_native=False)
        self._peak = 0

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        # a vendor checks its package and driver here and says which is missing
        return True, "host CPU: always available"

    # ---- device
    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        """One host device shared by every local rank."""

    def current_device(self) -> torch.device:
        return torch.device(self.device_type)

    def synchronize(self) -> None:
        """Host work is synchronous."""

    # ---- memory: the process's resident set (a device reports its allocator's counters)
    def memory_stats(self) -> dict[str, int | None]:
        import os

        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        self._peak = max(self._peak, rss)
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return {"allocated": rss, "reserved": rss, "peak_allocated": self._peak, "peak_reserved": self._peak,
                "free": None, "total": total}

    def reset_peak_memory_stats(self) -> None:
        self._peak = 0

    # ---- RNG: the device's own generator (here the host's)
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def capabilities(self) -> Capabilities:
        return Capabilities(device_name="example backend (host CPU)", arch="host",
                            dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                            fp8_formats=("e4m3", "e5m2"), fp8_recipes=("delayed", "tensorwise", "blockwise"),
                            fp8_gemm="emulated", fp8_collectives=False, flash_attention=False,
                            peak_flops={"fp32": None, "bf16": None, "fp16": None, "fp8": None}, streams=False,
                            memory_total=None)

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    # ---- kernels
    def register_kernels(self) -> None:
        from omnitron_example_backend import kernels  # noqa: F401 - registers the "example" implementations

    def kernel_preference(self) -> tuple[str, ...]:
        return ("example", "reference")
