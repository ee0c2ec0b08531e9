"""A test double of exactly the torch_musa surface ``omnitron.backends.musa`` calls.

No MUSA hardware is at hand, so the MUSA backend's own code is exercised against this stand-in:
tensors live on the host CPU, ``"mccl"`` is registered over gloo with
``torch.distributed.Backend.register_backend``, and ``torch.rope`` / ``torch.swish_glu`` are
written here from torch_musa's documented semantics (independently of omnitron's references).
Results obtained this way are labelled **MUSA-double**, never MUSA.

The double is installed into ``sys.modules`` only by tests: ``with installed(): ...``, or by
constructing :class:`MUSADoubleBackend` (what spawned workers do through
``OMNITRON_EXTRA_BACKENDS=musa-double=omnitron.testing.musa_double:MUSADoubleBackend``).
It refuses to install over a real torch_musa. Its surface equals ``manifest.txt`` (checked).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pathlib
import sys
import time
import types
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from omnitron.backends.musa.backend import MUSABackend

LABEL = "MUSA-double"
MANIFEST = pathlib.Path(__file__).resolve().parents[1] / "backends" / "musa" / "manifest.txt"
TARGET = "musa-double=omnitron.testing.musa_double:MUSADoubleBackend"
"""Value for ``OMNITRON_EXTRA_BACKENDS`` that makes ``get_backend("musa-double")`` work in any process."""


@dataclass
class DoubleConfig:
    """What the simulated device reports (defaults: an S5000-like mp_31 part)."""

    device_name: str = f"{LABEL} (MTT S5000 surface over host CPU tensors)"
    capability: tuple[int, int] = (3, 1)
    device_count: int = 1
    total_memory: int = 80 * 2**30


def read_manifest(path: pathlib.Path = MANIFEST) -> set[str]:
    """The names in ``manifest.txt`` (comments and blank lines dropped)."""
    return {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()} - {""}


# ---- runtime pieces --------------------------------------------------------------------------
class _State:
    config = DoubleConfig()
    current = 0
    peak = 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Stream:
    """Host work is synchronous: every queue is already drained."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: "Stream") -> None:
        pass

    def wait_event(self, event: "Event") -> None:
        pass

    def query(self) -> bool:
        return True


class Event:
    """Records wall-clock time, so ``elapsed_time`` (milliseconds) is meaningful on the host."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing, self._t = enable_timing, None

    def record(self, stream: Stream | None = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Events were not created with enable_timing=True")
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._t - self._t) * 1e3


_DEFAULT_STREAM = Stream()
_stream_stack: list[Stream] = [_DEFAULT_STREAM]


@contextlib.contextmanager
def _stream(s: Stream) -> Iterator[None]:
    _stream_stack.append(s)
    try:
        yield
    finally:
        _stream_stack.pop()


def _check_index(i: int | None) -> int:
    i = _State.current if i is None else int(i)
    if not 0 <= i < _State.config.device_count:
        raise RuntimeError(f"invalid device ordinal {i} (MUSA-double has {_State.config.device_count})")
    return i


def _set_device(i: int) -> None:
    _State.current = _check_index(i)


def _memory_allocated(device=None) -> int:
    now = _rss()
    _State.peak = max(_State.peak, now)
    return now


def _max_memory_allocated(device=None) -> int:
    return max(_State.peak, _memory_allocated())


def _reset_peak_memory_stats(device=None) -> None:
    _State.peak = _rss()


def _mem_get_info(device=None) -> tuple[int, int]:
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(free, _State.config.total_memory), _State.config.total_memory


def _properties(i=None):
    cfg = _State.config
    return types.SimpleNamespace(name=cfg.device_name, major=cfg.capability[0], minor=cfg.capability[1],
                                 total_memory=cfg.total_memory)


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)  # the double's "device" generator is the host generator


def _autocast(enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
    return torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


# ---- muDNN ops torch_musa adds to torch ----------------------------------------------------
def _rope(input: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False, batch_first: bool = False,
          multi_latent_attention: bool = False) -> torch.Tensor:
    """torch_musa's RoPE: ``input`` [s,b,h,d] (or [b,s,h,d] when batch_first), ``freqs`` [s,d] of
    Megatron-style angles (each pair's angle twice); rotates every channel, fp32 inside."""
    if multi_latent_attention:
        raise NotImplementedError("MUSA-double: multi_latent_attention RoPE is not simulated")
    s = input.shape[1] if batch_first else input.shape[0]
    if input.dim() != 4 or tuple(freqs.shape) != (s, input.shape[-1]):
        raise RuntimeError(f"rope: freqs must be [seq, head_dim] = [{s}, {input.shape[-1]}], got {tuple(freqs.shape)}")
    f = freqs.float()[None, :, None, :] if batch_first else freqs.float()[:, None, None, :]
    x = input.float()
    if rotary_interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return (x * f.cos() + rotated * f.sin()).to(input.dtype)


def _swish_glu(input: torch.Tensor) -> torch.Tensor:
    """torch_musa's fused SwiGLU: ``silu(a) * b`` for ``[a, b] = input.chunk(2, -1)``, fp32 inside."""
    a, b = input.float().chunk(2, dim=-1)
    return (F.silu(a) * b).to(input.dtype)


def _create_mccl(store, rank: int, size: int, timeout: datetime.timedelta):
    """``mccl`` over gloo: same semantics for every dtype gloo carries; no float8 (see fp8_transport)."""
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# ---- building and installing --------------------------------------------------------------
def _build() -> tuple[types.ModuleType, types.ModuleType]:
    musa = types.ModuleType("torch.musa", f"{LABEL}: torch.musa runtime over host CPU tensors")
    funcs = {
        "is_available": lambda: _State.config.device_count > 0,
        "device_count": lambda: _State.config.device_count,
        "current_device": lambda: _State.current,
        "set_device": _set_device,
        "synchronize": lambda device=None: None,
        "get_device_name": lambda device=None: _properties(_check_index(device)).name,
        "get_device_capability": lambda device=None: tuple(_State.config.capability),
        "get_device_properties": lambda device=None: _properties(_check_index(device)),
        "is_bf16_supported": lambda: tuple(_State.config.capability) >= (2, 2),
        "Stream": Stream,
        "Event": Event,
        "current_stream": lambda device=None: _stream_stack[-1],
        "stream": _stream,
        "memory_allocated": _memory_allocated,
        "memory_reserved": _memory_allocated,
        "max_memory_allocated": _max_memory_allocated,
        "max_memory_reserved": _max_memory_allocated,
        "reset_peak_memory_stats": _reset_peak_memory_stats,
        "empty_cache": lambda: None,
        "mem_get_info": _mem_get_info,
        "manual_seed": _manual_seed,
        "get_rng_state": lambda device="musa": torch.get_rng_state(),
        "set_rng_state": lambda state, device="musa": torch.set_rng_state(state),
    }
    for name, fn in funcs.items():
        setattr(musa, name, fn)
    musa.amp = types.ModuleType("torch.musa.amp")
    musa.amp.autocast = _autocast
    torch_musa = types.ModuleType("torch_musa", f"{LABEL}: stand-in for Moore Threads' torch_musa")
    torch_musa.__version__ = "0.0+musa.double"
    torch_musa.__omnitron_double__ = True
    return torch_musa, musa


_TORCH_ADDITIONS = {"rope": _rope, "swish_glu": _swish_glu}


def is_installed() -> bool:
    return getattr(sys.modules.get("torch_musa"), "__omnitron_double__", False)


def install(config: DoubleConfig | None = None) -> None:
    """Put the double into ``sys.modules`` / ``torch.musa`` (idempotent; refuses a real torch_musa)."""
    if config is not None:
        _State.config = config
        _State.current = 0
    if is_installed():
        return
    if "torch_musa" in sys.modules or hasattr(torch, "musa"):
        raise RuntimeError("a real torch_musa is loaded in this process; the MUSA test double will not replace it")
    torch_musa, musa = _build()
    sys.modules["torch_musa"], sys.modules["torch.musa"] = torch_musa, musa
    torch.musa = musa
    for name, fn in _TORCH_ADDITIONS.items():
        setattr(torch, name, fn)
    if "mccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("mccl", _create_mccl, devices=["cpu"])


def uninstall() -> None:
    """Remove the double (the ``mccl`` process-group name stays registered: torch cannot unregister it)."""
    if not is_installed():
        return
    for key in ("torch_musa", "torch.musa"):
        sys.modules.pop(key, None)
    for name in ("musa", *_TORCH_ADDITIONS):
        if hasattr(torch, name):
            delattr(torch, name)
    _State.config, _State.current = DoubleConfig(), 0


@contextlib.contextmanager
def installed(config: DoubleConfig | None = None) -> Iterator[None]:
    """Install the double for the enclosed block only."""
    install(config)
    try:
        yield
    finally:
        uninstall()


def surface() -> set[str]:
    """The names the installed double provides, in manifest spelling."""
    if not is_installed():
        raise RuntimeError("install the double first")
    names = {"torch_musa.__version__"}
    musa = sys.modules["torch.musa"]
    for attr in (a for a in vars(musa) if not a.startswith("_")):
        if attr == "amp":
            names |= {f"torch.musa.amp.{a}" for a in vars(musa.amp) if not a.startswith("_")}
            continue
        names.add(f"torch.musa.{attr}")
        obj = getattr(musa, attr)
        if isinstance(obj, type):
            names |= {f"torch.musa.{attr}.{m}" for m in vars(obj) if not m.startswith("_")}
    names |= {f"torch.{a}" for a in _TORCH_ADDITIONS}
    if "mccl" in dist.Backend.backend_list:
        names.add("process_group:mccl")
    return names


class MUSADoubleBackend(MUSABackend):
    """The MUSA backend's code over the double. Name and device say so: ``musa-double`` on ``cpu``."""

    name = "musa-double"
    device_type = "cpu"
    """The double's tensors live in host memory (stock torch has no ``musa`` device)."""
    fp8_transport = False
    """Its ``mccl`` is gloo underneath, which carries no float8: the uint8-view path is used."""

    @classmethod
    def probe(cls) -> tuple[bool, str]:
        if not (dist.is_available() and hasattr(dist.Backend, "register_backend")):
            return False, "this torch cannot register a custom process-group backend"
        return True, f"{LABEL}: torch_musa test double over host CPU tensors (not a MUSA device)"

    def __init__(self) -> None:
        install()
        super().__init__()

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def capabilities(self):
        """The simulated part's facts, except streams: the double's queues are synchronous."""
        return dataclasses.replace(super().capabilities(), streams=False)
