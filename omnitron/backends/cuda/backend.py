"""CUDA + NCCL: NVIDIA GPUs through ``torch.cuda``.

Capabilities are read from the device (name, compute capability, memory); FP8 is claimed only on
sm_89 and newer, where the tensor cores have it, and only when a tiny ``torch._scaled_mm`` runs.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.distributed as dist

from omnitron.backends.autograd_exit import drain_at_exit
from omnitron.backends.base import Backend, Capabilities
from omnitron.backends.collectives import Collectives, watchdog_env
from omnitron.backends.fp8 import scaled_mm_runs
from omnitron.backends.cuda.peaks import peak_flops

FP8_MIN_CC = (8, 9)
"""Ada (sm_89) and Hopper (sm_90) are the first architectures with FP8 tensor cores."""
FLASH_MIN_CC = (8, 0)
"""torch's FlashAttention-2 SDPA kernel needs sm_80+; it takes head dims up to 256."""
FLASH_HEAD_DIMS = (8, 256)


def cuda_capabilities(device_name: str, cc: tuple[int, int], memory_total: int | None, bf16: bool,
                      scaled_mm: bool, triton: bool = True) -> Capabilities:
    """Capabilities of one CUDA device from plain facts (pure, so it is testable without a GPU).

    ``cc`` is the compute capability (major, minor); ``bf16`` what ``torch.cuda.is_bf16_supported``
    says; ``scaled_mm`` whether a tiny ``torch._scaled_mm`` ran on the device (``fp8.scaled_mm_runs``);
    ``triton`` whether Triton is importable (inductor's GPU code generator, for ``--torch-compile``).
    No Transformer Engine path is claimed: omnitron has no tested binding to TE's GEMM.
    """
    fp8 = tuple(cc) >= FP8_MIN_CC
    flash = tuple(cc) >= FLASH_MIN_CC
    dtypes = (torch.float32, torch.float16) + ((torch.bfloat16,) if bf16 else ())
    gemm = "scaled_mm" if fp8 and scaled_mm else None
    return Capabilities(
        device_name=device_name,
        arch=f"sm_{cc[0]}{cc[1]}",
        dtypes=dtypes,
        fp8_formats=("e4m3", "e5m2") if fp8 else (),
        fp8_recipes=("delayed", "tensorwise", "blockwise") if gemm else (),
        fp8_gemm=gemm,
        # NOTE: FP8 tensors travel as uint8 views and reduce in fp32 (see Collectives): torch's
        # NCCL bindings do not reduce float8 on every NCCL version, so native support is not claimed.
        fp8_collectives=False,
        flash_attention=flash,
        flash_head_dims=FLASH_HEAD_DIMS if flash else None,
        peak_flops=peak_flops(device_name),
        streams=True,
        memory_total=memory_total,
        compiler="inductor" if triton else None,
        graph_capture=True,
    )


class CUDABackend(Backend):
    """NVIDIA GPUs: ``torch.cuda`` for the device runtime, NCCL for collectives."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

    def __init__(self) -> None:
        # TORCH_NCCL_*: flight recorder on, dumped on a timeout; async errors end the process. NCCL runs a
        # communicator's p2p groups in order on one stream: strict p2p posts each batch as one group
        self._collectives = Collectives("nccl", fp8_native=False, device_type="cuda", env=watchdog_env("TORCH_NCCL_"),
                                        env_prefix="TORCH_NCCL_", p2p_groups_in_order=True)
        self._caps: Capabilities | None = None
        drain_at_exit(self.device_type, self.current_device, lambda: torch.cuda.is_initialized())

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if torch.version.cuda is None:
            hip = getattr(torch.version, "hip", None)
            kind = f"a ROCm/HIP {hip} build" if hip else "a CPU-only build"
            return False, f"this torch build has no CUDA (torch {torch.__version__} is {kind})"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return False, (f"no CUDA device visible{hint}; torch {torch.__version__} was built for CUDA "
                           f"{torch.version.cuda}")
        if not (dist.is_available() and dist.is_nccl_available()):
            return False, "this torch build has CUDA but no NCCL process-group backend"
        n = torch.cuda.device_count()
        return True, f"{n} device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"

    # ---- device -------------------------------------------------------------------------
    def device_count(self) -> int:
        return torch.cuda.device_count()

    def visibility_may_be_per_process(self) -> bool:
        """Only where ``CUDA_VISIBLE_DEVICES`` is set (unset, every process sees all of the host's devices)."""
        return "CUDA_VISIBLE_DEVICES" in os.environ

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    # ---- streams and events -------------------------------------------------------------
    def Stream(self):  # noqa: N802
        return torch.cuda.Stream()

    def Event(self, enable_timing: bool = False):  # noqa: N802
        return torch.cuda.Event(enable_timing=enable_timing)

    def current_stream(self):
        return torch.cuda.current_stream()

    def stream(self, stream):
        return torch.cuda.stream(stream)

    # ---- memory -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int | None]:
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                "peak_allocated": torch.cuda.max_memory_allocated(),
                "peak_reserved": torch.cuda.max_memory_reserved(), "free": free, "total": total}

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    # ---- RNG ----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state)

    # ---- facts and tables ---------------------------------------------------------------
    def capabilities(self) -> Capabilities:
        if self._caps is None:
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
            cc = torch.cuda.get_device_capability(index)
            self._caps = cuda_capabilities(
                torch.cuda.get_device_name(index), cc, int(props.total_memory), torch.cuda.is_bf16_supported(),
                tuple(cc) >= FP8_MIN_CC and scaled_mm_runs(torch.device("cuda", index)),
                importlib.util.find_spec("triton") is not None)
        return self._caps

    def capture(self, fn, sample_args: tuple):
        """CUDA graphs of ``fn``'s forward and backward (``torch.cuda.make_graphed_callables``: warm-up
        iterations on a side stream, then one capture of each pass; later calls replay them)."""
        return torch.cuda.make_graphed_callables(fn, sample_args)

    def compile_unsupported_reason(self) -> str:
        return "Triton is not installed, and inductor generates its CUDA kernels with it; pip install triton"

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    def register_kernels(self) -> None:
        import omnitron.backends.cuda.kernels  # noqa: F401 - registers the "cuda_flash" implementations

    def kernel_preference(self) -> tuple[str, ...]:
        # cuda_flash implements only the ring's attention block (ATen's flash kernels, which decline attention
        # dropout): first for it, so a block without dropout runs FlashAttention-2 and one with the hash dropout
        # the fused Triton block; every other op resolves to Triton as before.
        return ("cuda_flash", "triton", "reference")

    def profiler_activities(self) -> tuple:
        """The CPU and the CUDA kernels (CUPTI)."""
        from torch.profiler import ProfilerActivity

        return (ProfilerActivity.CPU, ProfilerActivity.CUDA)

    def versions(self) -> dict[str, str]:
        out = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - version query only
            pass
        if torch.backends.cudnn.is_available():
            out["cudnn"] = str(torch.backends.cudnn.version())
        for module in ("triton", "transformer_engine"):
            try:
                out[module] = str(getattr(importlib.import_module(module), "__version__", "unknown"))
            except Exception:  # noqa: BLE001 - optional packages
                pass
        return out
