"""CPU + gloo: the backend every developer machine, test and CI run has."""
from __future__ import annotations

import os
import platform

import torch

from omnitron.backends.base import Backend, Capabilities
from omnitron.backends.collectives import Collectives


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CPUBackend(Backend):
    """Host CPU. Streams and events are no-op objects; memory stats come from the process RSS."""

    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        self._collectives = Collectives("gloo", fp8_native=False)
        self._caps: Capabilities | None = None

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        return True, "always available"

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        if index != 0:
            # every local rank shares the one host "device"
            pass

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def memory_stats(self) -> dict[str, int | None]:
        rss = peak = None
        try:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ImportError, ValueError):
            pass
        total = free = None
        try:
            pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
            total, free = pages * os.sysconf("SC_PAGE_SIZE"), avail * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
        if peak is not None and rss is not None:
            peak = max(peak, rss)  # ru_maxrss is sampled by the kernel and can trail the current RSS
        return {"allocated": rss, "reserved": rss, "peak_allocated": peak, "peak_reserved": peak,
                "free": free, "total": total}

    def reset_peak_memory_stats(self) -> None:
        """The OS keeps the process peak; it cannot be reset (peak stays monotone)."""

    def manual_seed(self, seed: int) -> None:
        # the host's generator only: torch.manual_seed also queues a seeding of every other device type, recording
        # a stack trace for each (1.5 ms a call; every model chunk built seeds its RNG tracker's streams)
        torch.default_generator.manual_seed(int(seed))

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = Capabilities(
                device_name=_cpu_name(),
                arch=platform.machine(),
                dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                fp8_formats=("e4m3", "e5m2"),
                fp8_recipes=("delayed", "tensorwise", "blockwise"),
                # NOTE: torch's CPU _scaled_mm runs, but as a slow reference: 2.3 s per 512x128x512 e4m3
                # GEMM against 2.1 ms emulated (same float8 values, fp32 accumulation), one thread, a Xeon
                # with AMX, torch 2.13 (2026-12-01). OMNITRON_FP8_PATH=scaled_mm still forces it.
                fp8_gemm="emulated",
                fp8_collectives=False,
                flash_attention=False,
                peak_flops={"fp32": None, "bf16": None, "fp16": None, "fp8": None},
                streams=False,
                memory_total=self.memory_stats()["total"],
                host_memory=True,
                compiler="inductor",  # C++/OpenMP code generation (needs a C++ compiler at run time)
            )
        return self._caps

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    def register_kernels(self) -> None:
        import omnitron.backends.cpu.kernels  # noqa: F401 - registers the "cpu_flash" implementations

    def kernel_preference(self) -> tuple[str, ...]:
        return ("cpp", "cpu_flash", "reference")
