"""The backend contract: everything the engine needs from an accelerator and its collectives.

A vendor implements :class:`Backend` once. The engine (``omnitron.core``) only ever talks to
this class, so no vendor name appears outside ``omnitron/backends/<vendor>/``.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:  # pragma: no cover
    from omnitron.backends.collectives import Collectives
    from omnitron.backends.fp8 import FP8Provider
    from omnitron.kernels.registry import KernelTable


@dataclass(frozen=True)
class Capabilities:
    """Facts about the device a backend drives. Never borrowed from another vendor."""

    device_name: str
    """Human-readable device name, e.g. ``"NVIDIA H200"`` or ``"x86_64 CPU (AVX-512)"``."""
    arch: str | None
    """Vendor architecture string (``"sm_90"``, ``"mp_31"``, ``"x86_64"``); None when unknown."""
    dtypes: tuple[torch.dtype, ...]
    """Floating dtypes usable for compute (matmul, autocast)."""
    fp8_formats: tuple[str, ...] = ()
    """FP8 storage formats the device can hold and cast: subset of ``("e4m3", "e5m2")``."""
    fp8_recipes: tuple[str, ...] = ()
    """FP8 scaling recipes the backend's FP8 provider runs: ``delayed``, ``tensorwise``, ``blockwise``."""
    fp8_gemm: str | None = None
    """How FP8 GEMMs execute: ``"scaled_mm"`` (a probe GEMM ran on the device), ``"emulated"`` or None."""
    fp8_collectives: bool = False
    """True when the process-group backend carries float8 tensors natively."""
    fp32_matmul: str | None = None
    """How float32 GEMMs execute: ``"tf32"`` (tensor cores on inputs rounded to a 10-bit mantissa) or ``"fp32"``
    (full precision); None where the backend does not say."""
    flash_attention: bool = False
    """True when a fused (flash) attention kernel is available through SDPA."""
    flash_head_dims: tuple[int, int] | None = None
    """Inclusive head-dim range the flash kernel accepts, when ``flash_attention``."""
    peak_flops: dict[str, float | None] = field(default_factory=dict)
    """Dense peak FLOP/s per dtype name (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``, ``"fp8"``: the names
    :meth:`peak` looks up; the conformance suite refuses others); None if unknown."""
    streams: bool = False
    """True when streams/events are real (asynchronous); False for the no-op CPU objects."""
    memory_total: int | None = None
    """Device memory in bytes, when known."""
    host_memory: bool = False
    """True when the device's memory is the host's RAM (the CPU; a simulated device): every process on the host
    draws from the one ``memory_total``, whatever device index it runs on."""
    compiler: str | None = None
    """The ``torch.compile`` backend that runs on this device (``"inductor"``: generated fused kernels;
    ``"aot_eager"``: traced graphs run op by op) or None where none was shown to work (``--torch-compile``)."""
    graph_capture: bool = False
    """True when :meth:`Backend.capture` records device graphs (CUDA graphs); False where it is the no-op."""

    def peak(self, dtype: torch.dtype | str) -> float | None:
        """Peak FLOP/s for a dtype (a ``torch.dtype`` or one of the names above), or None."""
        key = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype, str(dtype))
        return self.peak_flops.get(key)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class NullStream:
    """A stream for devices without asynchronous queues: every method is an immediate no-op."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def synchronize(self) -> None:
        """Nothing is queued, so nothing to wait for."""

    def wait_stream(self, other: "NullStream") -> None:
        """Ordering is program order on a synchronous device."""

    def wait_event(self, event: "NullEvent") -> None:
        """Ordering is program order on a synchronous device."""

    def query(self) -> bool:
        """Always complete."""
        return True


class NullEvent:
    """An event for synchronous devices; records wall-clock time so elapsed_time still works."""

    def __init__(self, enable_timing: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: NullStream | None = None) -> None:
        import time

        self._t = time.perf_counter()

    def wait(self, stream: NullStream | None = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def elapsed_time(self, end: "NullEvent") -> float:
        """Milliseconds between this event's record and ``end``'s record."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._t - self._t) * 1e3


class Backend(ABC):
    """One accelerator family: device runtime, collectives, kernels and FP8.

    Methods take and return torch objects; units are bytes for memory, seconds for time unless
    a name says otherwise. Subclasses set the three class attributes.
    """

    name: str = ""
    """Registry name used in ``OMNITRON_BACKEND`` (``"cpu"``, ``"cuda"``, ``"musa"``, ...)."""
    device_type: str = ""
    """The torch device type string tensors live on."""
    dist_backend: str = ""
    """The ``torch.distributed`` process-group backend name this device uses."""

    @property
    def registry_name(self) -> str:
        """The name this instance was selected by (``OMNITRON_BACKEND``, ``--backend``): an
        ``OMNITRON_EXTRA_BACKENDS`` entry or a plug-in's entry point may give a class another name than its ``name``
        (which its kernels register for)."""
        return getattr(self, "_registry_name", None) or self.name

    def label(self) -> str:
        """What messages call this backend: the name the user chose, with the class's ``name`` where that differs."""
        chosen = self.registry_name
        return chosen if chosen == self.name else f"{chosen} (class name {self.name!r})"

    def __deepcopy__(self, memo) -> "Backend":
        """A backend is this process's device and its library, not data: a deep-copied model shares it (a copy
        would split its caches and counters, and sim's, holding its extension module, cannot be copied)."""
        return self

    # ---- availability -------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def probe(cls) -> tuple[bool, str]:
        """(usable here?, reason). The reason names what is missing, e.g. "torch_musa is not installed"."""

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend can run on this machine."""
        return cls.probe()[0]

    # ---- device -------------------------------------------------------------------------
    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this type visible to the process."""

    def visibility_may_be_per_process(self) -> bool:
        """True unless this process is known to see all of its host's devices: a per-process visibility mask
        (a launcher such as ``srun --gpus-per-task=1`` giving each process its own devices) may be set, so the
        host's other ranks need not be on :meth:`device_count`'s devices (the fit check then sums no ranks onto
        one device). A backend that can tell (no mask in its environment) says False."""
        return True

    @abstractmethod
    def set_device(self, index: int) -> None:
        """Make device ``index`` current for this process."""

    @abstractmethod
    def current_device(self) -> torch.device:
        """The current device as a ``torch.device`` (never a bare int or a string)."""

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device`` for ``index`` (the current device when None)."""
        if index is None:
            return self.current_device()
        return torch.device(self.device_type, index)

    @abstractmethod
    def synchronize(self) -> None:
        """Block until all queued work on the current device is done."""

    # ---- streams and events -------------------------------------------------------------
    def Stream(self):  # noqa: N802 - mirrors torch.<device>.Stream
        """A new stream (a :class:`NullStream` on synchronous devices)."""
        return NullStream(self.current_device())

    def Event(self, enable_timing: bool = False):  # noqa: N802
        """A new event (a :class:`NullEvent` on synchronous devices)."""
        return NullEvent(enable_timing)

    def current_stream(self):
        """The stream work is queued on now."""
        return NullStream(self.current_device())

    @contextlib.contextmanager
    def stream(self, stream) -> Iterator[None]:
        """Queue the enclosed work on ``stream``."""
        yield

    # ---- memory -------------------------------------------------------------------------
    @abstractmethod
    def memory_stats(self) -> dict[str, int | None]:
        """Bytes: ``allocated``, ``reserved``, ``peak_allocated``, ``peak_reserved``, ``free``, ``total``
        (None where the device cannot say)."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Start peak tracking afresh."""

    def empty_cache(self) -> None:
        """Return cached, unused memory to the device (no-op where there is no caching allocator)."""

    # ---- RNG ----------------------------------------------------------------------------
    @abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's default generator."""

    @abstractmethod
    def get_rng_state(self) -> torch.Tensor:
        """The current device generator's state (a ByteTensor on CPU)."""

    @abstractmethod
    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restore a state from :meth:`get_rng_state`."""

    @contextlib.contextmanager
    def fork_rng(self) -> Iterator[None]:
        """Run the enclosed code with this device's RNG state saved and restored around it."""
        state = self.get_rng_state()
        try:
            yield
        finally:
            self.set_rng_state(state)

    # ---- precision ----------------------------------------------------------------------
    def autocast(self, dtype: torch.dtype | None, enabled: bool = True):
        """Autocast context for this device type (a null context when dtype is None)."""
        if dtype is None or not enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    # ---- facts and tables ---------------------------------------------------------------
    @abstractmethod
    def capabilities(self) -> Capabilities:
        """What the device can do, as facts (see :class:`Capabilities`)."""

    def capture(self, fn, sample_args: tuple):
        """``fn`` (a module or function of tensors) with its forward and backward captured once as device
        graphs and replayed on every later call, which must pass tensors of ``sample_args``' shapes, dtypes and
        ``requires_grad`` (no host syncs, no data-dependent shapes inside). Where the device has no graphs
        (``capabilities().graph_capture`` False: cpu, sim) it returns ``fn`` itself, so callers are the same
        everywhere and the eager path is what runs."""
        return fn

    def compile_unsupported_reason(self) -> str:
        """Why ``capabilities().compiler`` is None (the ``--torch-compile`` refusal names it)."""
        return "no torch.compile backend has been shown to run on this device"

    @property
    @abstractmethod
    def collectives(self) -> "Collectives":
        """The collective layer (process-group backend name and its dtype gaps)."""

    @property
    def kernels(self) -> "KernelTable":
        """Fused ops resolved for this backend (see ``omnitron.kernels``). Read on every fused call (an FP8
        linear reads it per use): a built table returns before the import statement."""
        table = getattr(self, "_kernel_table", None)
        if table is not None:
            return table
        from omnitron.kernels.registry import KernelContractError, KernelTable

        try:
            self.register_kernels()
        except Exception as err:  # noqa: BLE001 - a plug-in's kernel module: one line naming it, not a traceback
            raise KernelContractError(f"backend {self.name!r}: register_kernels() failed ({type(err).__name__}: "
                                      f"{err}); fix the module it imports, or install what that module needs") from err
        self._kernel_table = KernelTable(self.name, self.kernel_preference())
        return self._kernel_table

    def register_kernels(self) -> None:
        """Register this vendor's own kernel implementations (called once, before the table is built)."""

    def kernel_preference(self) -> tuple[str, ...]:
        """Implementation names to try, best first; the reference always closes the list."""
        return ("reference",)

    @property
    def fp8(self) -> "FP8Provider":
        """The FP8 provider: quantize, scaled GEMM, supported recipes."""
        from omnitron.backends.fp8 import FP8Provider

        if getattr(self, "_fp8", None) is None:
            self._fp8 = FP8Provider(self)
        return self._fp8

    def profiler_activities(self) -> tuple:
        """``torch.profiler.ProfilerActivity`` members to trace on this backend: the host CPU, plus the
        device's own activity where torch has one (``--profile``)."""
        from torch.profiler import ProfilerActivity

        return (ProfilerActivity.CPU,)

    def versions(self) -> dict[str, str]:
        """Versions of the libraries this backend relies on (for ``omnitron info``)."""
        return {"torch": torch.__version__}

    def __repr__(self) -> str:
        return f"<omnitron backend {self.name!r} device_type={self.device_type!r} dist={self.dist_backend!r}>"
