"""MUSA + MCCL: Moore Threads GPUs through torch_musa's own API.

After ``import torch_musa`` the device type ``"musa"`` exists and ``torch.musa`` is torch_musa's
runtime module (device, streams, events, memory, RNG, AMP). Nothing here patches torch or
pretends to be CUDA: the device reports its own name and ``mp_XY`` arch, and FP8 is claimed only
from mp_31 (S5000), where the hardware has it.

Spelling rule, checked by ``tests/backends/test_musa_manifest.py``: every torch_musa name is
written out in full (``torch.musa.memory_allocated()``, never an alias), so the names this file
uses can be listed in ``manifest.txt`` and checked against a test double and a real install.
"""
from __future__ import annotations

import importlib
import os

import torch

from omnitron.backends.autograd_exit import drain_at_exit
from omnitron.backends.base import Backend, Capabilities
from omnitron.backends.collectives import Collectives, watchdog_env
from omnitron.backends.fp8 import scaled_mm_runs
from omnitron.backends.musa.kernels import FLASH_HEAD_DIMS, register_musa_kernels

BF16_MIN_ARCH = 22
"""S4000 (mp_22) is the first MUSA part with native bf16."""
FP8_MIN_ARCH = 31
"""S5000 (mp_31) is the first MUSA part with FP8 (claimed only where ``torch._scaled_mm`` runs)."""

FP32_GEMM_DEFAULT_FROM = (2, 9)
"""torch_musa v2.9.0 (release note; the public source snapshot ends at v2.7.1): float32 GEMMs run in FP32
unless ``torch.backends.musa.matmul.allow_tf32`` is set or ``TORCH_ALLOW_TF32_MUBLAS_OVERRIDE=1``. Before it
(v2.7.1's source: csrc/aten/utils/Context.h, ``allow_tf32_ = true``) muDNN's switch
``torch.backends.mudnn.allow_tf32`` starts True, so they run as TF32."""
TF32_OVERRIDE_ENV = "TORCH_ALLOW_TF32_MUBLAS_OVERRIDE"

_T = 1e12
# Dense peak FLOP/s from Moore Threads' datasheets; parts not listed report None.
PEAKS: dict[str, dict[str, float | None]] = {
    "S4000": {"fp32": 25 * _T, "bf16": 100 * _T, "fp16": 100 * _T, "fp8": None},
}


def arch_number(cc: tuple[int, int]) -> int:
    """MUSA arch number from ``get_device_capability``: major * 10 + minor (S4000 -> 22, S5000 -> 31)."""
    return int(cc[0]) * 10 + int(cc[1])


def musa_peak_flops(device_name: str) -> dict[str, float | None]:
    for key, table in PEAKS.items():
        if key in device_name:
            return dict(table)
    return {"fp32": None, "bf16": None, "fp16": None, "fp8": None}


def torch_musa_release(version: str) -> tuple[int, int] | None:
    """``"2.7.1+abc1234"`` -> (2, 7); None when the string is not a release number."""
    parts = version.split("+", 1)[0].split(".")
    return (int(parts[0]), int(parts[1])) if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit() else None


def musa_fp32_matmul(release: tuple[int, int] | None, allow_tf32: bool | None, override: str | None) -> str | None:
    """``"tf32"`` or ``"fp32"``: how the installed torch_musa runs float32 GEMMs (see ``FP32_GEMM_DEFAULT_FROM``).

    ``allow_tf32`` is the release's switch (``torch.backends.musa.matmul.allow_tf32`` from v2.9,
    ``torch.backends.mudnn.allow_tf32`` before); ``override`` the ``TORCH_ALLOW_TF32_MUBLAS_OVERRIDE`` value."""
    if release is None or allow_tf32 is None:
        return None
    if release >= FP32_GEMM_DEFAULT_FROM:
        return "tf32" if allow_tf32 or override == "1" else "fp32"
    return "tf32" if allow_tf32 else "fp32"


def _tf32_switch(release: tuple[int, int] | None) -> bool | None:
    """The installed release's TF32 switch for float32 GEMMs (None when it has none)."""
    if release is not None and release >= FP32_GEMM_DEFAULT_FROM:
        matmul = getattr(getattr(torch.backends, "musa", None), "matmul", None)  # v2.9's name: not in the v2.7.1 source
        return None if matmul is None else bool(matmul.allow_tf32)
    if not hasattr(torch.backends, "mudnn"):
        return None
    return bool(torch.backends.mudnn.allow_tf32)


def musa_capabilities(device_name: str, cc: tuple[int, int], memory_total: int | None, bf16: bool,
                      scaled_mm: bool, fp8_transport: bool, fp32_matmul: str | None = None) -> Capabilities:
    """Capabilities of one MUSA device from plain facts (pure: testable without torch_musa).

    ``bf16`` is ``torch.musa.is_bf16_supported(including_emulation=False)`` (native bf16); ``scaled_mm`` whether a tiny
    ``torch._scaled_mm`` ran on the device (``fp8.scaled_mm_runs``; no Transformer Engine path is claimed);
    ``fp8_transport`` whether the process-group backend carries float8 tensors (MCCL does).
    """
    arch = arch_number(cc)
    fp8 = arch >= FP8_MIN_ARCH
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if bf16 and arch >= BF16_MIN_ARCH else ())
    gemm = "scaled_mm" if fp8 and scaled_mm else None
    return Capabilities(
        device_name=device_name,
        arch=f"mp_{arch}",
        dtypes=dtypes,
        fp8_formats=("e4m3", "e5m2") if fp8 else (),
        fp8_recipes=("delayed", "tensorwise", "blockwise") if gemm else (),
        fp8_gemm=gemm,
        fp8_collectives=fp8 and fp8_transport,
        fp32_matmul=fp32_matmul,
        flash_attention=arch >= BF16_MIN_ARCH,
        flash_head_dims=FLASH_HEAD_DIMS if arch >= BF16_MIN_ARCH else None,
        peak_flops=musa_peak_flops(device_name),
        streams=True,
        memory_total=memory_total,
    )


def _import_torch_musa():
    """Import torch_musa (registers the ``musa`` device, ``torch.musa`` and the ``mccl`` backend)."""
    return importlib.import_module("torch_musa")


class MUSABackend(Backend):
    """Moore Threads GPUs: ``torch.musa`` for the device runtime, MCCL for collectives."""

    name = "musa"
    device_type = "musa"
    dist_backend = "mccl"
    fp8_transport = True
    """MCCL carries float8_e4m3fn / e5m2 natively (no uint8 detour)."""

    def __init__(self) -> None:
        _import_torch_musa()
        # TORCH_MCCL_*: ProcessGroupMCCL is a port of ProcessGroupNCCL and reads the same settings under
        # its own prefix (checked against torch_musa's source by tests/backends/test_musa_manifest.py); its batches
        # are taken to run as NCCL's groups, one after another per communicator: strict mode posts each as one group
        self._collectives = Collectives(self.dist_backend, fp8_native=self.fp8_transport,
                                        device_type=self.device_type, env=watchdog_env("TORCH_MCCL_"),
                                        env_prefix="TORCH_MCCL_", p2p_groups_in_order=True)
        self._caps: Capabilities | None = None
        drain_at_exit(self.device_type, self.current_device, lambda: torch.musa.is_initialized())

    def compile_unsupported_reason(self) -> str:
        return ("torch.compile on MUSA devices (torch_musa's inductor backend) has not been probed by omnitron; "
                "run eager")

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        try:
            _import_torch_musa()
        except ImportError as err:
            if err.name == "torch_musa":
                return False, ("torch_musa is not installed (Moore Threads' PyTorch plug-in; it needs its own torch "
                               "build)")
            return False, f"torch_musa failed to import: {err}"
        except Exception as err:  # noqa: BLE001 - a broken install is "not usable", with the reason
            return False, f"torch_musa failed to import: {type(err).__name__}: {err}"
        if not torch.musa.is_available() or torch.musa.device_count() == 0:
            visible = os.environ.get("MUSA_VISIBLE_DEVICES")
            hint = f" (MUSA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return False, f"torch_musa is installed but no MUSA device is visible{hint}"
        return True, f"{torch.musa.device_count()} device(s), {torch.musa.get_device_name(0)}"

    # ---- device -------------------------------------------------------------------------
    def device_count(self) -> int:
        return torch.musa.device_count()

    def visibility_may_be_per_process(self) -> bool:
        """Only where ``MUSA_VISIBLE_DEVICES`` is set (unset, every process sees all of the host's devices)."""
        return "MUSA_VISIBLE_DEVICES" in os.environ

    def set_device(self, index: int) -> None:
        torch.musa.set_device(index)

    def current_device(self) -> torch.device:
        return self.device(torch.musa.current_device())

    def synchronize(self) -> None:
        torch.musa.synchronize()

    # ---- streams and events -------------------------------------------------------------
    def Stream(self):  # noqa: N802
        return torch.musa.Stream()

    def Event(self, enable_timing: bool = False):  # noqa: N802
        return torch.musa.Event(enable_timing=enable_timing)

    def current_stream(self):
        return torch.musa.current_stream()

    def stream(self, stream):
        return torch.musa.stream(stream)

    # ---- memory -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int | None]:
        free, total = torch.musa.mem_get_info()
        return {"allocated": torch.musa.memory_allocated(), "reserved": torch.musa.memory_reserved(),
                "peak_allocated": torch.musa.max_memory_allocated(),
                "peak_reserved": torch.musa.max_memory_reserved(), "free": int(free), "total": int(total)}

    def reset_peak_memory_stats(self) -> None:
        torch.musa.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.musa.empty_cache()

    # ---- RNG ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.musa.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.musa.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.musa.set_rng_state(state)

    # ---- precision ----------------------------------------------------------------------
    def autocast(self, dtype: torch.dtype | None, enabled: bool = True):
        """``torch.musa.amp.autocast`` (a null context when dtype is None)."""
        if dtype is None or not enabled:
            return super().autocast(None)
        return torch.musa.amp.autocast(dtype=dtype)

    # ---- facts and tables ---------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            index = torch.musa.current_device()
            props = torch.musa.get_device_properties(index)
            cc = tuple(torch.musa.get_device_capability(index))
            release = torch_musa_release(self.versions()["torch_musa"])
            fp32 = musa_fp32_matmul(release, _tf32_switch(release), os.environ.get(TF32_OVERRIDE_ENV))
            self._caps = musa_capabilities(
                torch.musa.get_device_name(index), cc,
                int(props.total_memory), bool(torch.musa.is_bf16_supported(including_emulation=False)),
                arch_number(cc) >= FP8_MIN_ARCH and scaled_mm_runs(self.device(index)), self.fp8_transport, fp32)
        return self._caps

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    def register_kernels(self) -> None:
        register_musa_kernels()

    def kernel_preference(self) -> tuple[str, ...]:
        # Triton kernels run where a MUSA Triton build provides an active driver (their own
        # availability check says so); muDNN's fused ops come first.
        return ("musa", "triton", "reference")

    def profiler_activities(self) -> tuple:
        """The CPU and the MUSA device: torch_musa's own ``ProfilerActivity.MUSA`` where it adds one, else the
        out-of-tree device slot (``PrivateUse1``) it registers as; the CPU alone when torch has neither."""
        from torch.profiler import ProfilerActivity

        device = getattr(ProfilerActivity, "MUSA", None) or getattr(ProfilerActivity, "PrivateUse1", None)
        return (ProfilerActivity.CPU,) if device is None else (ProfilerActivity.CPU, device)

    def versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__}
        torch_musa = _import_torch_musa()
        try:
            out["torch_musa"] = str(torch_musa.__version__)
        except AttributeError:
            out["torch_musa"] = "unknown"
        return out
