"""sim + simccl: the simulated accelerator, a backend like any vendor's.

Tensors live on ``torch.device("sim", i)`` (host memory behind a PrivateUse1 device, csrc/sim), so a
tensor created on the host where the device was meant, a hidden host sync or a collective given a
host tensor fails or is counted here as it would on a GPU. Capabilities are the simulator's own:
streams and events are synchronous (``streams=False``), FP8 GEMMs are emulated, there is no flash
attention and no peak FLOP/s. Memory statistics are the device allocator's bytes; "reserved" equals
"allocated" because nothing is cached. The device RNG is a generator of its own, not the host's.
"""
from __future__ import annotations

import os
import platform

import torch

from omnitron.backends.base import Backend, Capabilities
from omnitron.backends.collectives import Collectives
from omnitron.backends.sim import device as sim_device


def _host_memory() -> tuple[int | None, int | None]:
    """(total, available) bytes of host memory, which is where sim memory comes from."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (OSError, ValueError):
        return None, None


class SimBackend(Backend):
    """The simulated accelerator: ``omnitron._sim`` for the device, ``simccl`` (gloo, staged) for collectives."""

    name = "sim"
    device_type = sim_device.NAME
    dist_backend = sim_device.DIST_BACKEND

    def __init__(self) -> None:
        self._ext = sim_device.load()
        self._collectives = Collectives(self.dist_backend, fp8_native=False, device_type=self.device_type)
        self._caps: Capabilities | None = None

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        """Usable when the extension is built and PrivateUse1 is free (or already sim); loads nothing."""
        if not sim_device.extension_built():
            return False, f"omnitron._sim is not built; {sim_device.BUILD_HINT}"
        if sim_device.claimed_name() not in ("privateuseone", sim_device.NAME):
            return False, f"PrivateUse1 is already the {sim_device.claimed_name()!r} device in this process"
        return True, "simulated accelerator over host memory (omnitron._sim)"

    # ---- device -------------------------------------------------------------------------
    def device_count(self) -> int:
        return self._ext.device_count()

    def set_device(self, index: int) -> None:
        self._ext.set_device(index)

    def current_device(self) -> torch.device:
        return torch.device(self.device_type, self._ext.current_device())

    def synchronize(self) -> None:
        """Work is complete when issued: nothing to wait for (and not a counted host sync)."""

    # ---- memory -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int | None]:
        s = self._ext.memory_stats(self._ext.current_device())
        total, free = _host_memory()
        return {"allocated": s["allocated"], "reserved": s["allocated"], "peak_allocated": s["peak"],
                "peak_reserved": s["peak"], "free": free, "total": total}

    def reset_peak_memory_stats(self) -> None:
        self._ext.reset_peak(self._ext.current_device())

    # ---- RNG ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        self._ext.manual_seed(self._ext.current_device(), int(seed))

    def get_rng_state(self) -> torch.Tensor:
        return self._ext.get_rng_state(self._ext.current_device())

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._ext.set_rng_state(self._ext.current_device(), state)

    # ---- host syncs ---------------------------------------------------------------------
    def sync_count(self, kind: str = "") -> int:
        """Host synchronizations counted so far: ``copy`` (device to host), ``item``, ``shape``
        (data-dependent output shapes), ``compare`` (``torch.equal``); all of them when ``kind`` is empty."""
        return self._ext.sync_count(kind)

    def reset_sync_count(self) -> None:
        self._ext.reset_sync_count()

    def set_sync_hook(self, fn) -> None:
        """Call ``fn(kind, op)`` at every counted sync (raise there to get the Python stack); None stops."""
        self._ext.set_sync_hook(fn)

    # ---- facts and tables ---------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            self._caps = Capabilities(
                device_name=f"sim (simulated accelerator over host memory, {platform.machine()})",
                arch="sim",
                dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
                fp8_formats=("e4m3", "e5m2"),
                fp8_recipes=("delayed", "tensorwise", "blockwise"),
                fp8_gemm="emulated",  # CPU _scaled_mm underneath would be a slow reference (see the cpu backend)
                fp8_collectives=False,  # gloo under simccl has no float8: sent as uint8, reduced in fp32
                flash_attention=False,
                peak_flops={"fp32": None, "bf16": None, "fp16": None, "fp8": None},
                streams=False,  # one synchronous stream per device; events complete when recorded
                memory_total=_host_memory()[0],
                # NOTE: inductor has no code generator for this PrivateUse1 device (its lowering asserts, torch
                # 2.13, 2026-12-03); aot_eager traces forward and backward graphs and runs them op by op
                compiler="aot_eager",
            )
        return self._caps

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    def kernel_preference(self) -> tuple[str, ...]:
        return ("reference",)  # omnitron._C's kernels take host pointers; the references run on any device

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "omnitron._sim": "built"}
