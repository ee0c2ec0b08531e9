"""The sim device itself, checked against plain torch on the host: memory statistics in bytes, a device
RNG of its own, the host-sync counter, placement errors a GPU would raise, views and resizes through the
CPU fallback, autograd and simccl's staged results. Everything runs in one spawned worker (the pytest
process never claims PrivateUse1)."""
from __future__ import annotations

import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), __import__("pytest").mark.multiprocess]


ROUND = 512  # the caching allocator's block granularity (as CUDA's)


def _caching(be) -> dict:
    """A freed block is cached (reserved stays) and reused by the next allocation of its size on its stream,
    never by another stream's; it is poisoned when freed."""
    be.empty_cache()
    r0 = be.memory_stats()["reserved"]
    y = torch.ones(1000, device=be.device())
    ptr = y.data_ptr()
    del y
    cached = be.memory_stats()["reserved"] - r0
    z = torch.empty(1000, device=be.device())
    same = z.data_ptr() == ptr
    poisoned = bool(z.isnan().all().cpu())
    with be.stream(be.Stream()):
        w = torch.empty(1000, device=be.device())
    return {"cached": cached, "reused": same, "poisoned": poisoned, "other_stream_fresh": w.data_ptr() != ptr,
            "reserved": be.memory_stats()["reserved"] - r0}


def _memory(be) -> dict:
    """Allocated bytes move by a tensor's nbytes rounded up to the block granularity; the peak remembers a
    freed tensor."""
    be.reset_peak_memory_stats()
    base = be.memory_stats()["allocated"]
    x = torch.empty(1000, 3, dtype=torch.float64, device=be.device())
    grown = be.memory_stats()["allocated"] - base
    del x
    after = be.memory_stats()
    be._ext.set_poison(True)  # OMNITRON_SIM_POISON=1: fresh memory reads as NaN
    poisoned = bool(torch.empty(5, device=be.device()).isnan().all().cpu())
    be._ext.set_poison(False)
    return {"grown": grown, "freed": after["allocated"] - base, "peak": after["peak_allocated"] - base,
            "poisoned": poisoned}


def _rng(be) -> dict:
    """The device generator is not the host's: device draws (dropout included) leave the host state alone, and (same
    Mersenne Twister) a seeded device stream equals the host stream from the same seed."""
    torch.manual_seed(5)
    host_state = torch.get_rng_state()
    be.manual_seed(123)
    dev = torch.rand(16, device=be.device()).cpu()
    torch.nn.functional.dropout(torch.ones(64, device=be.device()), 0.5)  # native_dropout: no generator argument
    untouched = torch.equal(torch.get_rng_state(), host_state)
    torch.manual_seed(123)
    return {"untouched": untouched, "same_stream": torch.equal(dev, torch.rand(16))}


def _syncs(be) -> dict:
    """Each kind of host sync counts once; device work and host-to-device copies count nothing."""
    x = torch.randn(8, device=be.device())
    be.reset_sync_count()
    y = (x * 2 + 1).relu().sum()
    quiet = be.sync_count()
    y.item()
    x.cpu()
    torch.nonzero(x > 0)
    x[x > 0]  # boolean indexing sizes its result from device data
    torch.equal(x, x)
    x.to(be.device()).copy_(torch.ones(8))
    return {"quiet": quiet, **{k: be.sync_count(k) for k in ("item", "copy", "shape", "compare")}}


def _placement(be) -> dict:
    """A host tensor beside a device tensor, or a host generator for a device op, is an error (as on a GPU);
    a 0-dim host scalar is fine."""
    x = torch.ones(4, device=be.device())
    errors = {}
    for name, fn in {"host_tensor": lambda: x + torch.ones(4), "host_generator":
                     lambda: torch.randn(4, device=be.device(), generator=torch.Generator())}.items():
        try:
            fn()
            errors[name] = ""
        except RuntimeError as err:
            errors[name] = str(err)
    errors["scalar_ok"] = float((x + torch.tensor(2.0)).sum().cpu())
    return errors


def _fallback(be) -> dict:
    """Views, in-place ops, out= resizes and autograd through the CPU fallback match host torch."""
    torch.manual_seed(0)
    a = torch.randn(6, 5, dtype=torch.float64)
    d = a.to(be.device())
    d.t()[1:3].mul_(3)  # in place through a view: the base sees it
    a.t()[1:3].mul_(3)
    out = torch.empty(0, device=be.device(), dtype=torch.float64)
    torch.cumsum(d, 0, out=out)  # out= resized by the CPU kernel, memory adopted by the device tensor
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    wd = w.detach().to(be.device()).requires_grad_()
    (d @ wd).tanh().sum().backward()
    (a @ w).tanh().sum().backward()
    return {"base": (d.cpu() - a).abs().max().item(), "out": (out.cpu() - a.cumsum(0)).abs().max().item(),
            "out_device": str(out.device), "grad": (wd.grad.cpu() - w.grad).abs().max().item(),
            "grad_device": str(wd.grad.device)}


def _silu_backward(be) -> dict:
    """SiLU's backward on the device (``silu_backward``, reached through autograd) allocates its one output, as on a
    GPU, not the six full-size tensors of ATen's decomposition a device without its own kernel gets
    (omnitron/backends/sim/structured.py); float64 values against the derivative written out by hand."""
    torch.manual_seed(0)
    n = 1000
    x, g = torch.randn(n, dtype=torch.float64) * 4, torch.randn(n, dtype=torch.float64)
    xd = x.to(be.device()).requires_grad_()
    y = torch.nn.functional.silu(xd)
    gd = g.to(be.device())
    be.reset_peak_memory_stats()
    base = be.memory_stats()["allocated"]
    (dx,) = torch.autograd.grad(y, xd, gd)
    peak = be.memory_stats()["peak_allocated"] - base
    sig = 1.0 / (1.0 + torch.exp(-x))
    want = g * sig * (1.0 + x * (1.0 - sig))  # d/dx x sigmoid(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
    return {"err": (dx.cpu() - want).abs().max().item(), "scale": (g.abs() * (1.0 + x.abs())).max().item(),
            "peak": peak, "device": str(dx.device)}


def _staged_collective(be) -> dict:
    """simccl hands a result back on wait(), not before (a vendor library's stream semantics)."""
    import torch.distributed as dist

    x = torch.full((4,), float(dist.get_rank() + 1), device=be.device())
    work = be.collectives.all_reduce(x, async_op=True)
    work.wait()
    return {"sum": x.cpu().tolist(), "device": str(x.device)}


def device_checks() -> dict:
    from omnitron.backends import get_backend

    be = get_backend()
    return {"memory": _memory(be), "caching": _caching(be), "rng": _rng(be), "syncs": _syncs(be),
            "placement": _placement(be),
            "fallback": _fallback(be), "silu_backward": _silu_backward(be), "collective": _staged_collective(be)}


def test_sim_device_against_host_torch():
    results = run_distributed(device_checks, 2, backend="sim", timeout_s=120)
    r = results[0]
    nbytes = -(-24000 // ROUND) * ROUND
    assert r["memory"] == {"grown": nbytes, "freed": 0, "peak": nbytes, "poisoned": True}, r["memory"]
    block = -(-4000 // ROUND) * ROUND
    reserved = r["caching"].pop("reserved")  # both blocks, and the small results cached since
    assert r["caching"] == {"cached": block, "reused": True, "poisoned": True, "other_stream_fresh": True}, r
    assert 2 * block <= reserved <= 2 * block + 4 * ROUND, reserved
    assert r["rng"] == {"untouched": True, "same_stream": True}, r["rng"]
    assert r["syncs"] == {"quiet": 0, "item": 1, "copy": 1, "shape": 2, "compare": 1}, r["syncs"]
    p = r["placement"]
    assert "Expected all tensors to be on the same device" in p["host_tensor"], p
    assert "Expected a 'sim' device type for generator" in p["host_generator"], p
    assert p["scalar_ok"] == 12.0
    f = r["fallback"]
    # the same CPU kernels on the same float64 data: identical results, on the device
    assert f == {"base": 0.0, "out": 0.0, "out_device": "sim:0", "grad": 0.0, "grad_device": "sim:0"}, f
    d = r["silu_backward"]
    # one float64 [1000] output (8000 bytes, one 512-byte-rounded block); the decomposition's peak is six
    assert d["peak"] == -(-8000 // ROUND) * ROUND and d["device"] == "sim:0", d
    # the kernel's and the reference's products, sums and exp differ by a few roundings each, every term bounded by
    # |g| (1 + |x|) (sigmoid in (0, 1)): 16 float64 epsilons of that is well above them and far below any wrong formula
    assert d["err"] <= 16 * torch.finfo(torch.float64).eps * d["scale"], d
    for res in results:
        assert res["collective"] == {"sum": [3.0] * 4, "device": "sim:0"}, res["collective"]


def bounded_wait() -> dict:
    """work.wait(timeout) on a queued simccl collective returns or raises within the bound (strict mode's
    deadlock report relies on it); an unbounded wait afterwards still completes the collective."""
    import datetime
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    x = torch.ones(8, device=be.device())
    if dist.get_rank() == 1:
        time.sleep(2.0)  # the peer is late
    work = dist.all_reduce(x, async_op=True)
    t0, message = time.perf_counter(), ""
    try:
        work.wait(timeout=datetime.timedelta(seconds=0.5))
    except RuntimeError as err:
        message = str(err)
    waited = time.perf_counter() - t0
    work.wait()
    return {"message": message, "waited": waited, "sum": x.cpu().tolist()}


def test_bounded_wait_times_out_then_completes():
    r0, r1 = run_distributed(bounded_wait, 2, backend="sim", timeout_s=60,
                             env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    assert "timed out" in r0["message"] and "all_reduce" in r0["message"], r0
    assert 0.5 <= r0["waited"] < 1.5, r0
    assert r1["message"] == "", r1
    assert r0["sum"] == r1["sum"] == [2.0] * 8


EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist
from omnitron.backends import get_backend
be = get_backend("sim")
dist.init_process_group("simccl", store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(8, device=be.device())
dist.all_reduce(x)
x.to("cpu", non_blocking=True)  # starts the asynchronous-copy worker too
if sys.argv[1] == "destroy":
    dist.destroy_process_group()
print("done", flush=True)
"""


def test_interpreter_exits_with_communicator_threads_joined():
    """The communicator's worker and watchdog threads (and the async-copy worker) are joined at
    destroy_process_group and at exit: the interpreter ends instead of hanging in a static destructor."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for how in ("destroy", "exit"):
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, how], capture_output=True, text=True, timeout=90,
                              cwd=root, env={**os.environ, "PYTHONPATH": root})
        assert proc.returncode == 0 and "done" in proc.stdout, (how, proc.stderr[-2000:])
