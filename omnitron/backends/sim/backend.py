"""sim + simccl: the simulated accelerator, a backend like any vendor's.

Tensors live on ``torch.device("sim", i)`` (host memory behind a PrivateUse1 device, csrc/sim), so a
tensor created on the host where the device was meant, a hidden host sync or a collective given a
host tensor fails or is counted here as it would on a GPU. FP8 GEMMs are emulated, attention's fused kernel
is ATen's CPU flash kernel on sim memory (``sim_flash``: the ring's blocks, core attention without dropout), there
is no peak FLOP/s. The device RNG is a generator of its own, not the host's.

Streams (``streams=True``), in the sense modelled here (csrc/sim/stream.cpp):

- *Kernels run when issued, checked as if they had not.* An op's data is final when the host issues
  it; what a GPU would run later is modelled by order: every stream, and the host, carries a vector
  clock of how far it is ordered after each stream (``Event.record``/``wait``, ``wait_stream``,
  ``synchronize``, a query that says done). Compute is never done on its own, so a missing wait is
  found deterministically (the worst case a GPU allows), not when a race happens to lose.
- *Happens-before race detector* (csrc/sim/race.cpp). Each allocation block keeps its accesses (byte
  extent, stream, point, read or write, op); a kernel whose read or write conflicts with another
  stream's access that its stream is not ordered after raises a ``RuntimeError`` from the op, one line
  naming both kernels, both streams and the fix (read-after-write, write-after-write,
  write-after-read). Reads and writes come from the op's schema (``Tensor(a!)``: written; a view's
  input: not accessed); fresh results are written. ``.cpu()``, ``.item()``, ``.tolist()`` are
  kernels on the current stream and order the host after that stream only, as CUDA's blocking copies.
  Granularity is a tensor's extent in its block: disjoint slices on two streams are fine; interleaved
  strided views (``x[0::2]``, ``x[1::2]``) overlap in extent and are reported.
- *Stream-ordered caching allocator.* A freed block goes back to its allocation stream's cache,
  poisoned (0xff: NaN); ``record_stream`` holds it until that stream passes the free. A block used on
  another stream and freed without ``record_stream`` or a wait hands that use to every block its
  allocation stream allocates next (a GPU's allocator may give them its bytes, split or merged), until that
  stream waits for the use: a kernel touching such a block unordered after it raises (the race detector).
  Blocks are never split (inactive split bytes are 0); memory a CPU kernel allocated for a result is
  adopted, counted, checked, not cached.
- *Asynchronous copies.* A ``non_blocking`` device-to-host copy into pinned memory lands after
  ``OMNITRON_SIM_ASYNC_DELAY_MS`` (default 50) on a worker thread unless the host waits first. Until then
  the destination's whole pages are protected: a host access ends the process with a message naming the
  copy's call site (csrc/sim/pinned.cpp; ``OMNITRON_SIM_GUARD_PAGES=0`` turns it off), and its other
  bytes read NaN (-1 in integer types).
- *simccl is NCCL-shaped.* Each communicator has a stream per device (8 slots; two communicators may
  share one). A collective is a kernel there, after the issuing thread's current stream, reading its
  inputs and writing its outputs; ``work.wait()`` makes the current stream (not another) wait for it.
  Its output is in flight until ``work.wait()`` (or ``isCompleted()``, or a device synchronize): any
  kernel touching it raises. One collective runs at a
  time per device, in issue order, so opposite orders on two ranks deadlock; after
  ``OMNITRON_SIM_DEADLOCK_S`` (default 60) with another waiting behind it, each rank reports both
  collectives with their groups, call sites and threads. A collective issued while another thread's is
  still queued is an error. ``work.wait()`` blocks the host (the kernels after it run on the host);
  ``wait(timeout)`` raises "timed out" at the bound, as strict mode's deadlock report expects.
- *NCCL's tensor rules* (gloo has none of them): a collective's single tensor must be contiguous, each of a
  list dense (``ValueError``, as NCCL's "Tensors must be contiguous"); point-to-point moves a dense tensor's bytes
  in memory order and refuses one with gaps; the stacked forms of ``all_gather_into_tensor`` and
  ``reduce_scatter_tensor`` run, as does ``all_to_all``'s list form with tensors of different sizes.
- *Point-to-point order.* A send publishes how many of its group's collectives were issued before it (in
  the group's store); the receive compares its own count once it completed. A difference deadlocks NCCL
  (the two wait behind each other's collectives): the receiver raises naming both, and the sender's
  watchdog aborts the sender's communicator with the same line. Outside a batch, a rank's sends and receives
  with one peer also run in issue order (NCCL puts them on the pair's stream, each blocking until the peer's
  matching one runs): the k-th unbatched operation of each rank with the other must be a send on one and a
  receive on the other. Two sends (or two receives) at one place fail both ranks at once, naming both
  (csrc/sim/pair_order.cpp). ``batch_isend_irecv`` coalesces (one work for the batch, as NCCL's), and a
  batch's operations are not ordered against each other; a send inside a batch received outside one (or the
  reverse) is reported like the order check above (NCCL runs the two on different communicators). A
  communicator's batches run one after another, each until all its operations met their partners (the k-th
  send to a rank pairs with that rank's k-th receive, tags ignored, every payload taken as too large for NCCL's
  buffers): for each pair of ranks, two batches heading their queues that each wait for an operation the other
  rank posts later (each rank posting its send before the batch with its receive) fail both ranks, naming both
  batches and call sites, when the later of the two is issued (csrc/sim/group_order.cpp). A cycle of such waits
  through three or more ranks (each rank's send to the next in a batch before the one with the receive from the
  previous) fails every rank of it, and the group's other ranks that issued point-to-point operations on it,
  naming each batch, the batch it waits for and their call sites, within a watchdog poll or two of its last
  batch (csrc/sim/cycle.cpp: each rank replays its batches against the heads the others publish). NCCL
  ignores tags: a send whose tag differs from the receive NCCL pairs it with (the k-th batched, or the k-th
  unbatched of the pair, counted in issue order) fails both ranks before the second of the two is launched,
  naming both operations and call sites (gloo pairs by tag: the program runs there, and each receive gets
  another send than on NCCL); so does a batched send whose size differs from its receive's (gloo ends the
  receiving process when the send is larger).
- *Every collective, at the process-group level* (csrc/sim/comm_check.cpp): each operation is recorded
  with its issue, completion and wait (``flight_recorder_dump()``), and in strict mode the fingerprint of
  each collective the engine's ``Collectives`` did not check itself (FSDP2's, DCP's) is exchanged first.

Not modelled: kernels overlapping in time (there is no timing), a host write to a pinned buffer that a
``non_blocking`` host-to-device copy still reads (the copy is taken when issued); the race detector misses a
race between two communicators sharing a stream slot, and one between kernels two host threads issue at the
same instant (each checks before the other records); point-to-point cycles across pairs closed by ``wait()`` (NCCL's
stream waits), and unbatched operations to different peers sharing the group's one stream (eager initialization,
which simccl is never told of: torch connects eagerly only backends that support splitting) are not checked.
Barriers are queued, checked and recorded like the collectives.
"""
from __future__ import annotations

import contextlib
import os
import platform

import torch

from omnitron.backends.autograd_exit import drain_at_exit
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
        drain_at_exit(self.device_type, self.current_device)
        # simccl runs a communicator's batches in order as NCCL does (csrc/sim/group_order.cpp): strict mode posts
        # each batch as one group, as on cuda
        self._collectives = Collectives(self.dist_backend, fp8_native=False, device_type=self.device_type,
                                        p2p_groups_in_order=True)
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
        """Wait for the device's streams, asynchronous copies and collectives (not a counted host sync)."""
        self._ext.synchronize(self._ext.current_device())

    # ---- streams and events -------------------------------------------------------------
    def Stream(self):  # noqa: N802
        return torch.Stream(device=self.current_device())

    def Event(self, enable_timing: bool = False):  # noqa: N802
        return torch.Event(device=self.current_device(), enable_timing=enable_timing)

    def current_stream(self):
        return torch.accelerator.current_stream(self.current_device())

    @contextlib.contextmanager
    def stream(self, stream):
        prev = self.current_stream()
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(prev)

    # ---- memory -------------------------------------------------------------------------
    def memory_stats(self) -> dict[str, int | None]:
        """The caching allocator's bytes (``reserved`` includes cached free blocks; ``torch.sim.memory_stats()``
        also has ``inactive_split``, 0 as blocks are never split, and ``cached_blocks``)."""
        s = self._ext.memory_stats(self._ext.current_device())
        total, free = _host_memory()
        return {"allocated": s["allocated"], "reserved": s["reserved"], "peak_allocated": s["peak"],
                "peak_reserved": s["peak_reserved"], "free": free, "total": total}

    def empty_cache(self) -> None:
        self._ext.empty_cache()

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
                streams=True,  # ordered and checked as the module docstring says; kernels run when issued
                memory_total=_host_memory()[0],
                host_memory=True,  # every simulated device and the host share it
                # NOTE: inductor has no code generator for this PrivateUse1 device (its lowering asserts, torch
                # 2.13, 2026-12-03); aot_eager traces forward and backward graphs and runs them op by op
                compiler="aot_eager",
            )
        return self._caps

    @property
    def collectives(self) -> Collectives:
        return self._collectives

    def register_kernels(self) -> None:
        import omnitron.backends.sim.kernels  # noqa: F401 - registers the "sim_flash" implementations

    def kernel_preference(self) -> tuple[str, ...]:
        # omnitron._C's kernels take host pointers; ATen's CPU flash attention runs on sim memory as it is
        return ("sim_flash", "reference")

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "omnitron._sim": "built"}
