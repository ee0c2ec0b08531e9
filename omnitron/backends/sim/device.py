"""Load the sim accelerator into this process: ``torch.device("sim")``, ``torch.sim`` and ``simccl``.

``omnitron._sim`` (csrc/sim) registers a PrivateUse1 device over host memory; nothing in it is
named, so :func:`claim` can give PrivateUse1 another name (the MUSA test double names it ``musa``).
Loading it as sim names PrivateUse1 ``"sim"``, adds the ``Tensor.sim()``/``is_sim`` methods, registers ``torch.sim``
(the runtime module torch's accelerator-generic code looks for) and the ``simccl`` process-group backend.
Nothing here runs when omnitron is imported: only the sim backend (or a test that asks) calls
:func:`load`, so a CPU process never claims PrivateUse1.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import os
import types

import torch

from omnitron.backends.sim import structured

NAME = "sim"
DIST_BACKEND = "simccl"
BUILD_HINT = "build it with: MAX_JOBS=2 python setup.py build_ext --inplace (or pip install -e .)"
DEVICES_ENV = "OMNITRON_SIM_DEVICES"
"""How many sim devices a process sees (default 8; all share host memory, each keeps its own statistics)."""
POISON_ENV = "OMNITRON_SIM_POISON"
"""``1``: fresh device memory is all 0xff bytes (NaN), so a read of an ``empty()`` buffer before any write shows."""


class SimUnavailableError(RuntimeError):
    """The extension is missing or PrivateUse1 is already taken in this process."""


def extension_built() -> bool:
    """True when ``omnitron._sim`` can be imported (without importing it)."""
    return importlib.util.find_spec("omnitron._sim") is not None


def claimed_name() -> str:
    """The name PrivateUse1 has in this process (``"privateuseone"`` while unclaimed)."""
    return torch._C._get_privateuse1_backend_name()


_ext = None


def claim(name: str = NAME):
    """Import the extension and name PrivateUse1 ``name`` in this process (idempotent for one name).

    Adds ``Tensor.<name>()``/``is_<name>`` and the module/storage methods, and the hook through which the
    extension's reports name the Python call site of a collective (whatever the device is called: the MUSA
    test double's reports come from the same C++); registers neither a runtime module nor collectives
    (:func:`load` does both for ``sim``; the MUSA test double brings its own ``torch.musa`` and ``mccl``).
    A process names PrivateUse1 once: asking for a second name is an error."""
    global _ext
    if _ext is not None and claimed_name() == name:
        return _ext
    if claimed_name() not in ("privateuseone", name):
        raise SimUnavailableError(f"PrivateUse1 is already the {claimed_name()!r} device in this process "
                                  f"(a process can name it once; run {name!r} in a process of its own)")
    try:
        ext = importlib.import_module("omnitron._sim")
    except ImportError as err:
        raise SimUnavailableError(f"omnitron._sim is not built ({err}); {BUILD_HINT}") from err
    atexit.register(ext.shutdown)  # join the communicator and copy threads before the interpreter goes
    ext.set_site_hook(_issue_site)
    ext.set_device_count(int(os.environ.get(DEVICES_ENV, "8")))
    ext.set_poison(os.environ.get(POISON_ENV) == "1")
    structured.register()
    if claimed_name() != name:
        torch.utils.rename_privateuse1_backend(name)
    if not hasattr(torch.Tensor, name):
        torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    _ext = ext
    return ext


def load():
    """Import the extension as ``sim``: ``torch.device("sim")``, ``torch.sim`` and ``simccl`` (idempotent)."""
    ext = claim(NAME)
    from omnitron.backends import flight

    flight.add_source(ext.flight_records)
    if not hasattr(torch, NAME):
        torch._register_device_module(NAME, _runtime_module(ext))
    register_collectives(ext, DIST_BACKEND, NAME)
    return ext


def register_collectives(ext, dist_backend: str, device_type: str, sync_returns_none: bool = False) -> None:
    """Register ``dist_backend`` for ``device_type`` tensors: gloo on host staging copies (idempotent).
    ``sync_returns_none``: a synchronous call completes before it returns and returns no work (where the
    build can tell one: ``ext.build_features()["sync_returns_none"]``). A group made again under a name this process
    made before (``new_group(..., use_local_synchronization=True)`` names a group by its ranks) gets a store of its
    own: gloo's rendezvous would read the destroyed group's addresses there and hang (plain gloo does), and simccl's
    records of blocked waits and releases would be the destroyed group's (csrc/sim/collective_wait.cpp)."""
    import torch.distributed as dist

    made: dict[str, int] = {}  # groups made under each name in this process

    def create(opts, _options):  # opts.store: where sends publish their order (csrc/sim/comm_check.cpp)
        rank, store = opts.group_rank, opts.store
        global_rank = dist.get_rank() if dist.is_initialized() else rank  # the default group's own: the job's rank
        incarnation = made[opts.group_id] = made.get(opts.group_id, 0) + 1
        if incarnation > 1:  # the name came back: a store of its own, not the destroyed group's keys
            store = dist.PrefixStore(f"simccl#{incarnation}/", store)
        gloo = dist.ProcessGroupGloo(store, rank, opts.group_size, opts.timeout)
        return ext.collective_backend(store, gloo, sync_returns_none, global_rank, incarnation)

    if dist_backend.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(dist_backend, create, extended_api=True, devices=[device_type])


_ENGINE_LAYER = ("omnitron/backends/collectives.py", "omnitron/backends/flight.py", "omnitron/backends/staged.py")
"""The engine's collective plumbing (flight.py issues strict mode's batches and fingerprint exchanges for the
caller of collectives.py): never the call site a message should name."""
_WRAPPERS = ("/typing_extensions.py", "/contextlib.py", "/functools.py", "/distributed_c10d.py", "/c10d_logger.py")
"""Frames that only pass a collective on: the wrappers torch puts around its collectives (typing_extensions'
``deprecated``, its loggers, context managers) and torch.distributed's own entry points."""


def _is_library(path: str) -> bool:
    """torch, or a wrapper around it: never the call site a message should name."""
    return "/torch/" in path or path.endswith(_WRAPPERS)


def _frame_site(frame) -> str:
    path = frame.f_code.co_filename.replace("\\", "/")
    if "/torch/" in path:
        path = "torch/" + path.rsplit("/torch/", 1)[1]
    return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"


def _issue_site() -> tuple[str, str, bool]:
    """(call site, thread, engine) of a collective being issued: the innermost frame outside torch and the
    collective layer, the issuing thread's name (threads torch's autograd engine runs count as the main
    thread: their collectives are ordered by the backward call that waits for them), and whether the
    engine's collective layer issued it (it records and, in strict mode, checks those itself; simccl
    checks the rest: FSDP2's, DCP's, plain torch.distributed calls). A collective issued from a hook on
    autograd's device thread has only torch frames: its site is the innermost of them plus the backward
    call the main thread waits in (:func:`_backward_site`)."""
    import sys
    import threading

    thread = threading.current_thread()
    autograd = isinstance(thread, threading._DummyThread)
    name = threading.main_thread().name if autograd else thread.name
    frame, engine, innermost = sys._getframe(1), False, None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        engine = engine or path.endswith(_ENGINE_LAYER)
        if not _is_library(path) and not path.endswith(_ENGINE_LAYER):
            return _frame_site(frame), name, engine
        if innermost is None and not path.endswith(_WRAPPERS):
            innermost = frame
        frame = frame.f_back
    where = _frame_site(innermost) if innermost is not None else "(no Python frame)"
    if autograd:
        where += f" (autograd thread{_backward_site()})"
    return where, name, engine


def _backward_site() -> str:
    """``; backward called at FILE:LINE (fn)``: where the main thread waits in a backward call (the call that
    runs the autograd thread's hooks), else ""."""
    import sys
    import threading

    frame, in_backward = sys._current_frames().get(threading.main_thread().ident), False
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        in_backward = in_backward or "/torch/autograd/" in path
        if in_backward and not _is_library(path):
            return f"; backward called at {_frame_site(frame)}"
        frame = frame.f_back
    return ""


def _index(device=None) -> int:
    """A device index from None (current), an int, a string or a torch.device."""
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _ext.current_device() if device.index is None else device.index


def _runtime_module(ext) -> types.ModuleType:
    """``torch.sim``: the runtime surface torch (autocast, RNG forking, serialization) and omnitron call."""
    mod = types.ModuleType("torch.sim", "Runtime of the simulated accelerator (omnitron._sim).")

    def manual_seed_all(seed: int) -> None:
        for i in range(ext.device_count()):
            ext.manual_seed(i, int(seed))

    def memory_stats(device=None) -> dict:
        return ext.memory_stats(_index(device))

    @contextlib.contextmanager
    def stream(s):
        prev = torch.accelerator.current_stream(s.device_index) if s is not None else None
        if s is not None:
            torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            if prev is not None:
                torch.accelerator.set_stream(prev)

    fns = dict(
        is_available=lambda: True, is_initialized=lambda: True, _is_in_bad_fork=lambda: False, _lazy_init=lambda: None,
        init=lambda: None, device_count=ext.device_count, current_device=ext.current_device,
        set_device=lambda device: ext.set_device(_index(device)),
        synchronize=lambda device=None: ext.synchronize(_index(device)),
        Stream=lambda device=None, priority=0: torch.Stream(device=torch.device(NAME, _index(device))),
        Event=lambda enable_timing=False, **_: torch.Event(device=torch.device(NAME, _ext.current_device()),
                                                         enable_timing=enable_timing),
        current_stream=lambda device=None: torch.accelerator.current_stream(_index(device)),
        set_stream=torch.accelerator.set_stream, stream=stream,
        manual_seed=lambda seed: ext.manual_seed(ext.current_device(), int(seed)), manual_seed_all=manual_seed_all,
        seed=lambda: ext.seed(ext.current_device()), seed_all=lambda: [ext.seed(i) for i in range(ext.device_count())],
        initial_seed=lambda: ext.initial_seed(ext.current_device()),
        get_rng_state=lambda device=None: ext.get_rng_state(_index(device)),
        set_rng_state=lambda state, device=None: ext.set_rng_state(_index(device), state),
        memory_allocated=lambda device=None: memory_stats(device)["allocated"],
        memory_reserved=lambda device=None: memory_stats(device)["reserved"],
        max_memory_allocated=lambda device=None: memory_stats(device)["peak"],
        max_memory_reserved=lambda device=None: memory_stats(device)["peak_reserved"],
        reset_peak_memory_stats=lambda device=None: ext.reset_peak(_index(device)),
        empty_cache=ext.empty_cache, memory_stats=memory_stats,
        get_amp_supported_dtype=lambda: [torch.float16, torch.bfloat16],
        sync_count=ext.sync_count, reset_sync_count=ext.reset_sync_count,
    )
    for name, fn in fns.items():
        setattr(mod, name, fn)
    mod.get_rng_state_all = lambda: [ext.get_rng_state(i) for i in range(ext.device_count())]
    mod.set_rng_state_all = lambda states: [ext.set_rng_state(i, s) for i, s in enumerate(states)]
    return mod
