"""The sim device's happens-before race detector (csrc/sim/race.cpp): planted stream races raise on sim, naming
both kernels, both streams and the fix; the same programs with the right synchronisation pass and compute what
plain float64 torch computes; every program, racy or not, runs silently on cpu (so the detector is what
catches them, not a crash).

Kernels run when issued on sim, so a race never shows in the numbers: it is found by order. Each program runs
``bug`` (the synchronisation left out) and ``ok`` (put in) on fresh random inputs, in one two-rank worker per
backend (the collective cases need two ranks; the others run on each rank's own device).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_STRICT_COLLECTIVES": "0"}
# float32 results against float64 references: each case is one or two float32 roundings of values of size ~4
# (exp of |x| < 4.5 is below 100), so 1e-6 relative with 1e-6 absolute bounds them (2 ulp is 2.4e-7 relative).
RTOL, ATOL = 1e-6, 1e-6


def _join(be, side) -> None:
    """Order the two streams after each other, so the frees after a program are safe (stream-ordered allocator)."""
    be.current_stream().wait_stream(side)
    side.wait_stream(be.current_stream())


def cross_stream_read(be, x, ref, sync):
    """A side-stream kernel reads what the main stream wrote after the side stream last waited for it."""
    side = be.Stream()
    y = x * 2  # main stream
    if sync:
        side.wait_stream(be.current_stream())
    with be.stream(side):
        z = y + 1  # side stream: reads y
    _join(be, side)
    return z, ref * 2 + 1


def missing_event_wait(be, x, ref, sync):
    """The main stream uses a side-stream result; the event recorded after it is never waited for."""
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        y = x.exp()
        done = be.Event()
        done.record(side)
    if sync:
        done.wait(be.current_stream())
    z = y * 3  # main stream: reads y
    _join(be, side)
    return z, ref.exp() * 3


def host_read(be, x, ref, sync, read="item"):
    """``.item()`` / ``.cpu()`` (a blocking copy on the *current* stream) of a side-stream result."""
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        s = x.sum()
    if sync:
        side.synchronize()
    got = torch.tensor(s.item(), dtype=torch.float64) if read == "item" else s.cpu().double()
    _join(be, side)
    # a float32 sum of n terms is within log2(n) roundings of sum |x| (ATen sums pairwise; 2 for slack)
    return got, ref.sum(), 2 * 12 * 2.0 ** -24 * ref.abs().sum().item()


def overwrite_while_read(be, x, ref, sync):
    """Write-after-read: the main stream overwrites what a side stream still reads."""
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        y = x * 2  # side stream: reads x
    if sync:
        be.current_stream().wait_stream(side)
    x.zero_()  # main stream: overwrites x
    _join(be, side)
    return y, ref * 2


def slices(be, x, ref, sync):
    """Two streams update slices of one tensor with no order between them: overlapping slices race;
    disjoint ones (``sync``) do not -- the detector's granularity is a tensor's byte extent, not its block."""
    n = x.numel()
    cut = n // 2 if sync else n // 2 + 64
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        x[:cut].add_(1.0)
    x[n // 2:].add_(2.0)  # main stream
    _join(be, side)
    want = ref.clone()
    want[:cut] += 1.0
    want[n // 2:] += 2.0
    return x, want


def reuse_after_free(be, x, ref, sync):
    """FSDP2's reduce-scatter output: written on a side stream, read on the main stream after an event wait, freed
    without record_stream. Safe when the side stream waits for the main stream before it uses memory allocated
    after the free (FSDP2 does, instead of record_stream); without that wait a GPU's allocator may give the side
    stream's next allocation the freed bytes while the main stream still reads them."""
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        g = x * 2  # allocated on the side stream
        done = be.Event()
        done.record(side)
    done.wait(be.current_stream())
    y = g + 1  # main stream: reads g
    del g  # freed without g.record_stream(main)
    if sync:
        side.wait_stream(be.current_stream())
    with be.stream(side):
        h = x * 3  # a fresh block on the side stream: the freed bytes, on a GPU
    _join(be, side)
    return y + h, ref * 2 + 1 + ref * 3


def resized_out(be, x, ref, sync, size=0):
    """A side-stream kernel writes an ``out=`` tensor it resizes (the CPU kernel reallocates its memory, which
    becomes the tensor's device memory); the main stream reads it. ``size``: the out tensor's elements before."""
    import warnings

    side = be.Stream()
    side.wait_stream(be.current_stream())
    out = torch.empty(size, device=x.device)
    with be.stream(side), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "An output with one or more elements was resized"
        torch.exp(x, out=out)
    if sync:
        be.current_stream().wait_stream(side)
    y = out * 3  # main stream: reads out
    _join(be, side)
    return y, ref.exp() * 3


def all_reduce_read_early(be, x, sync, others):
    """An async all-reduce's output read on the current stream before ``work.wait()``."""
    work = be.collectives.all_reduce(x, async_op=True)
    try:
        if sync:
            work.wait()
        y = x * 1
    finally:
        if not sync:
            work.wait()
    return y, others.sum(0)


def all_reduce_other_stream(be, x, sync, others):
    """``work.wait()`` orders the *current* stream after the communicator; a side stream that reads the result
    must then wait for the current stream."""
    work = be.collectives.all_reduce(x, async_op=True)
    work.wait()
    side = be.Stream()
    if sync:
        side.wait_stream(be.current_stream())
    with be.stream(side):
        y = x * 1
    _join(be, side)
    return y, others.sum(0)


def gather_input_overwritten(be, x, sync, others):
    """Write-after-read on a collective's input: all_gather's input overwritten before ``work.wait()``."""
    import torch.distributed as dist

    out = torch.empty(others.numel(), device=x.device)
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    try:
        if sync:
            work.wait()
        x.fill_(-1.0)  # the communicator may still be reading x
    finally:
        if not sync:
            work.wait()
    return out, others.flatten()


LOCAL = {"cross_stream_read": cross_stream_read, "missing_event_wait": missing_event_wait, "host_item": host_read,
         "host_cpu": lambda be, x, ref, sync: host_read(be, x, ref, sync, read="cpu"), "war": overwrite_while_read,
         "slices": slices, "reuse_after_free": reuse_after_free, "resized_out": resized_out,
         "resized_nonempty_out": lambda be, x, ref, sync: resized_out(be, x, ref, sync, size=3)}
COLLECTIVE = {"all_reduce_read_early": all_reduce_read_early, "all_reduce_other_stream": all_reduce_other_stream,
              "gather_input_overwritten": gather_input_overwritten}


def _run(be, fn, *args) -> tuple[str, bool]:
    """(the race's message or '', whether the result matched the float64 reference)."""
    try:
        got, want, *atol = fn(be, *args)
        ok = torch.allclose(got.cpu().double(), want, rtol=RTOL, atol=atol[0] if atol else ATOL)
        return "", ok
    except RuntimeError as err:
        be.synchronize()  # the frees of the racing program's tensors are then ordered (no deferred report)
        return str(err).splitlines()[0], False


def races_worker(seed: int) -> dict:
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, fn in LOCAL.items():
        for sync in (False, True):
            x = (torch.rand(4096, generator=gen, dtype=torch.float64) * 9 - 4.5).float()
            out[name, sync] = _run(be, fn, x.to(be.device()), x.double(), sync)
    for name, fn in COLLECTIVE.items():
        for sync in (False, True):
            every = (torch.rand(world, 256, generator=gen, dtype=torch.float64) * 9 - 4.5).float()  # same on all ranks
            out[name, sync] = _run(be, fn, every[rank].to(be.device()), sync, every.double())
    return out


# What each racy program's message must name: the race kind, both kernels, both streams and the fix.
EXPECTED = {
    "cross_stream_read": ["race (read-after-write)", "aten::add", "aten::mul", "stream 0 (the default stream)",
                          ".wait_stream("],
    "missing_event_wait": ["race (read-after-write)", "aten::mul", "aten::exp", "stream 0 (the default stream)",
                           "event.wait()"],
    "host_item": ["race (read-after-write)", "item() reads", "aten::sum", "blocking copy to the host", "synchronize"],
    "host_cpu": ["race (read-after-write)", "a blocking copy to the host reads", "aten::sum", "synchronize"],
    "war": ["race (write-after-read)", "aten::zero_ writes", "aten::mul read", "stream 0 (the default stream)",
            "record_stream("],
    # main's in-place add on a slice reaches the device as aten::add with out=: its read of self is checked first
    "slices": ["race (read-after-write)", "aten::add reads", "aten::add wrote", "bytes [8192, 8448)"],
    "reuse_after_free": ["was freed while stream 0 (the default stream) may still be using it",
                         "aten::add ran on it", "aten::mul writes on stream", "record_stream(", "wait_stream"],
    # the resized memory is recorded as the kernel's write (it was recorded on the freed block, or not at all)
    "resized_out": ["race (read-after-write)", "aten::mul reads", "aten::exp wrote", "stream 0 (the default stream)"],
    "resized_nonempty_out": ["race (read-after-write)", "aten::mul reads", "aten::exp wrote"],
    "all_reduce_read_early": ["all_reduce", "before its work.wait()"],  # the in-flight check, before the detector
    "all_reduce_other_stream": ["race (read-after-write)", "aten::mul",
                                "all_reduce wrote it on the communicator stream",
                                "work.wait()"],
    "gather_input_overwritten": ["race (write-after-read)", "aten::fill_", "all_gather_into_tensor read it on the "
                                 "communicator stream", "work.wait()"],
}


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_planted_races(backend):
    seed = torch.randint(0, 2**31, ()).item()
    results = run_distributed(races_worker, 2, seed, backend=backend, env=ENV, timeout_s=120)
    for rank, res in enumerate(results):
        for (name, sync), (message, matches) in res.items():
            where = f"rank {rank} {name} sync={sync} seed={seed}: {message}"
            if sync:
                assert message == "" and matches, where  # silent, and the result is right
            elif backend == "cpu":
                assert message == "", where  # silent (gloo's async collectives may well give a torn result)
            else:
                assert message, where
                for part in EXPECTED[name]:
                    assert part in message, f"{part!r} missing from {where}"
