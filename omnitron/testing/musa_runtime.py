"""The runtime half of the torch_musa test double: ``torch.musa``'s device, stream, memory and RNG
functions, written from torch_musa's documented API (``torch_musa/core/{device,stream,memory,random}.py``
and ``core/amp``: names, signatures, defaults, the ``memory_stats`` key names) over the sim device
(``omnitron._sim``) that the double names ``musa``.

Nothing here is stubbed: the current device is the extension's, memory figures are its allocator's
bytes, the generator is the device's own (a device draw never advances the host RNG), and tensors are
``torch.device("musa", i)`` tensors; streams and events are the sim device's (ordered, checked, with its
stream-ordered caching allocator: ``capabilities().streams`` is True, as on MUSA).
"""
from __future__ import annotations

import collections
import time
import types
from dataclasses import dataclass

import torch

DEVICE = "musa"


@dataclass
class DoubleConfig:
    """What the simulated part reports (defaults: an S5000-like mp_31 part)."""

    device_name: str = "MUSA-double (MTT S5000 surface over the sim device)"
    capability: tuple[int, int] = (3, 1)
    device_count: int = 1
    total_memory: int = 80 * 2**30


class _State:
    config = DoubleConfig()
    ext = None  # omnitron._sim, named musa in this process
    installed = False  # False again after uninstall: torch.musa stays, with no device


def _ext():
    if _State.ext is None:
        raise RuntimeError("MUSA-double: the double is not installed (omnitron.testing.musa_double.install())")
    return _State.ext


def _index(device=None, optional: bool = True) -> int:
    """A device index as torch_musa's ``_get_musa_device_index``: int, ``"musa:i"``, ``torch.device``; None is
    current."""
    if device is None:
        if not optional:
            raise ValueError("Expected a musa device, but got: None")
        return _ext().current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != DEVICE:
        raise ValueError(f"Expected a musa device, but got: {device}")
    return _ext().current_device() if device.index is None else device.index


def _valid(device=None) -> int:
    i = _index(device)
    if not 0 <= i < device_count():
        raise AssertionError(f"Invalid device id {i} (MUSA-double has {device_count()})")
    return i


# ---- device ------------------------------------------------------------------------------
def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return _State.config.device_count if _State.installed else 0


def current_device() -> int:
    return _ext().current_device()


def is_initialized() -> bool:
    """Whether the device runtime has started in this process (the double's starts when it is installed)."""
    return _State.installed


def set_device(device) -> None:
    """Select the current device (a negative index is a no-op, as in torch_musa)."""
    i = _index(device, optional=False)
    if i >= 0:
        _ext().set_device(_valid(i))


def synchronize(device=None) -> None:
    """Every queue of the double is drained when work is issued: nothing to wait for."""
    _valid(device)


def get_device_properties(device) -> types.SimpleNamespace:
    cfg = _State.config
    _valid(device)
    return types.SimpleNamespace(name=cfg.device_name, major=cfg.capability[0], minor=cfg.capability[1],
                                 total_memory=cfg.total_memory)


def get_device_name(device=None) -> str:
    return get_device_properties(device).name


def get_device_capability(device=None) -> tuple[int, int]:
    props = get_device_properties(device)
    return props.major, props.minor


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """Native bf16 from mp_22 (the double emulates nothing, so ``including_emulation`` changes nothing)."""
    return tuple(_State.config.capability) >= (2, 2)


class device:  # noqa: N801 - torch_musa's spelling
    """Context manager that makes ``device`` current for the enclosed block."""

    def __init__(self, device) -> None:
        self.idx, self.prev = (-1 if device is None else _index(device)), -1

    def __enter__(self):
        self.prev = current_device()
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, *exc) -> bool:
        if self.idx >= 0:
            set_device(self.prev)
        return False


# ---- streams and events ------------------------------------------------------------------
class Stream(torch.Stream):
    """A queue on one device: a ``torch.Stream`` of the sim device underneath (as ``torch.musa.Stream`` is one
    of the MUSA device), so work on it is ordered and checked as csrc/sim/stream.cpp models a GPU's: events,
    ``wait_stream``, ``record_stream`` and the stream-ordered caching allocator behave as on sim."""

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:  # an existing stream (current_stream / default_stream)
            return super().__new__(cls, **kwargs)
        return super().__new__(cls, device=torch.device(DEVICE, _valid(device)), priority=priority)

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        pass  # torch.Stream is built in __new__

    def synchronize(self) -> None:
        super().synchronize()

    def wait_stream(self, stream: "Stream") -> None:
        self.wait_event(stream.record_event())

    def wait_event(self, event: "Event") -> None:
        super().wait_event(event)

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return super().query()


def _wrap(s: torch.Stream) -> Stream:
    return Stream(stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)


class Event(torch.Event):
    """A ``torch.Event`` of the sim device (recorded, waited and queried as csrc/sim models); ``elapsed_time``
    is wall-clock between the records (milliseconds): the sim device runs a kernel when it is issued."""

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return super().__new__(cls, device=torch.device(DEVICE, _valid()), enable_timing=enable_timing)

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing, self._t = enable_timing, None

    def record(self, stream: Stream | None = None) -> None:
        super().record(stream)
        self._t = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        super().wait(stream)

    def query(self) -> bool:
        return super().query()

    def synchronize(self) -> None:
        super().synchronize()

    def elapsed_time(self, end_event: "Event") -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self._t is None or end_event._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._t - self._t) * 1e3


def default_stream(device=None) -> Stream:
    i = _valid(device)
    current = torch.accelerator.current_stream(i)
    return Stream(stream_id=0, device_index=i, device_type=current.device_type)


def current_stream(device=None) -> Stream:
    return _wrap(torch.accelerator.current_stream(_valid(device)))


def set_stream(stream: Stream | None) -> None:
    if stream is not None:
        torch.accelerator.set_stream(stream)


class stream:  # noqa: N801 - torch_musa's spelling (a function returning a StreamContext there)
    """Make ``stream`` current on its device for the enclosed block (None: a no-op)."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream, self.prev = stream, None

    def __enter__(self):
        if self.stream is not None:
            self.prev = current_stream(self.stream.device)
            set_stream(self.stream)

    def __exit__(self, *exc) -> bool:
        if self.stream is not None:
            set_stream(self.prev)
        return False


# ---- memory ------------------------------------------------------------------------------
def memory_stats(device=None) -> "collections.OrderedDict[str, int]":
    """The allocator's statistics under torch_musa's key names (bytes; counts for ``allocation``): the sim
    device's stream-ordered caching allocator, so ``reserved_bytes`` includes its cached free blocks, and
    ``inactive_split_bytes`` is 0 (it never splits a block)."""
    s = _ext().memory_stats(_valid(device))
    stats = {"allocated_bytes.all.current": s["allocated"], "allocated_bytes.all.peak": s["peak"],
             "reserved_bytes.all.current": s["reserved"], "reserved_bytes.all.peak": s["peak_reserved"],
             "inactive_split_bytes.all.current": 0, "allocation.all.allocated": s["allocations"]}
    return collections.OrderedDict(sorted(stats.items()))


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None) -> None:
    _ext().reset_peak(_valid(device))


def empty_cache() -> None:
    """Release the sim allocator's cached free blocks (those no stream still holds)."""
    _ext().empty_cache()


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the simulated part: its configured capacity less what is allocated on it."""
    total = _State.config.total_memory
    return max(total - memory_allocated(device), 0), total


# ---- RNG ---------------------------------------------------------------------------------
def get_rng_state(device="musa") -> torch.Tensor:
    return _ext().get_rng_state(_valid(device))


def set_rng_state(new_state: torch.Tensor, device="musa") -> None:
    _ext().set_rng_state(_valid(device), new_state.clone(memory_format=torch.contiguous_format))


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states) -> None:
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    _ext().manual_seed(current_device(), int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _ext().manual_seed(i, int(seed))


def seed() -> None:
    _ext().seed(current_device())


def seed_all() -> None:
    first = _ext().seed(0)
    for i in range(1, device_count()):
        _ext().manual_seed(i, first)


def initial_seed() -> int:
    return _ext().initial_seed(current_device())


# ---- AMP ---------------------------------------------------------------------------------
def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16, torch.float32]


class autocast(torch.amp.autocast_mode.autocast):  # noqa: N801 - torch_musa's spelling
    """``torch.musa.amp.autocast``: ``torch.autocast("musa", ...)`` (the sim device's autocast lists)."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        super().__init__(DEVICE, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


PUBLIC = (is_available, device_count, current_device, is_initialized, set_device, synchronize, get_device_name,
          get_device_capability, get_device_properties, is_bf16_supported, device, Stream, Event, current_stream,
          default_stream, set_stream, stream, memory_stats, memory_allocated, memory_reserved, max_memory_allocated,
          max_memory_reserved, reset_peak_memory_stats, empty_cache, mem_get_info, get_rng_state, set_rng_state,
          get_rng_state_all, set_rng_state_all, manual_seed, manual_seed_all, seed, seed_all, initial_seed,
          get_amp_supported_dtype)
"""Everything ``torch.musa`` exposes in the double (``amp.autocast`` beside it)."""
PRIVATE = {"_is_in_bad_fork": lambda: False, "_lazy_init": lambda: None}
"""What torch's generic PrivateUse1 code calls on ``torch.musa`` (``torch.manual_seed`` seeds the device
through ``_is_in_bad_fork`` + ``manual_seed_all``; factories call ``_lazy_init``)."""
