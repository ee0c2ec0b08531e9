"""Conformance: device API, streams/events, memory statistics, RNG, capabilities, autocast, FP8."""
from __future__ import annotations

import copy

import torch

from omnitron.backends.base import Capabilities
from omnitron.backends.fp8 import scaled_mm_runs

FP8_FORMATS = {"e4m3", "e5m2"}
FP8_RECIPES = {"delayed", "tensorwise", "blockwise"}
PEAK_NAMES = {"fp32", "tf32", "bf16", "fp16", "fp8"}


def test_device_api(suite_backend):
    be = suite_backend
    assert be.device_count() >= 1
    be.set_device(0)
    dev = be.current_device()
    assert isinstance(dev, torch.device), f"current_device() returned {type(dev).__name__}, not torch.device"
    assert dev.type == be.device_type
    x = torch.arange(6.0, device=be.device()).reshape(2, 3)
    assert x.device.type == be.device_type
    torch.testing.assert_close((x @ x.t()).cpu(), torch.tensor([[5.0, 14.0], [14.0, 50.0]]))
    be.synchronize()
    assert be.name and be.dist_backend == be.collectives.dist_backend
    ok, why = type(be).probe()
    assert ok and why
    holder = torch.nn.Linear(2, 2).to(be.device())
    holder.backend = be
    twin = copy.deepcopy(holder)  # a copied model shares the process's backend (sim's holds its extension module)
    assert twin.backend is be and twin.weight.device == holder.weight.device and twin.weight is not holder.weight


def test_streams_and_events(suite_backend):
    be = suite_backend
    side = be.Stream()
    start, end = be.Event(enable_timing=True), be.Event(enable_timing=True)
    x = torch.randn(64, 64, device=be.device())
    start.record()
    side.wait_stream(be.current_stream())  # x is written on the current stream
    with be.stream(side):
        y = x @ x
    be.current_stream().wait_stream(side)
    end.record()
    end.synchronize()
    assert end.query()
    assert start.elapsed_time(end) >= 0.0
    be.synchronize()
    torch.testing.assert_close(y, x @ x)
    ev = be.Event()
    ev.record()
    ev.wait()
    side.wait_event(ev)
    side.synchronize()
    assert side.query()


def test_memory_stats(suite_backend):
    """The six byte counts of docs/backends.md; a count the device cannot say is None in every call (the engine
    leaves it out of its logs), and each count it does say is checked: a 64 MiB buffer shows in ``allocated`` and
    ``peak_allocated`` remembers it after it is freed."""
    be = suite_backend
    keys = {"allocated", "reserved", "peak_allocated", "peak_reserved", "free", "total"}
    be.reset_peak_memory_stats()
    before = be.memory_stats()
    assert set(before) == keys
    nbytes = 64 * 2**20
    buf = torch.ones(nbytes // 4, device=be.device())  # touched, so host RSS grows too
    during = be.memory_stats()
    del buf
    be.empty_cache()
    after = be.memory_stats()
    for k in keys:
        said = [s[k] for s in (before, during, after)]
        assert all(v is None for v in said) or all(isinstance(v, int) and v >= 0 for v in said), (k, said)
    if during["allocated"] is not None:
        assert during["allocated"] >= before["allocated"] + nbytes * 0.9, (before, during)
    if during["peak_allocated"] is not None:
        assert during["peak_allocated"] >= (during["allocated"] or nbytes)
        assert after["peak_allocated"] >= (during["allocated"] or nbytes) * 0.99, "peak must remember the freed buffer"
    if after["total"] is not None and after["free"] is not None:
        assert 0 <= after["free"] <= after["total"]


def test_rng_state_fork_and_restore(suite_backend):
    be = suite_backend
    be.manual_seed(1234)
    a = torch.rand(8, device=be.device())
    be.manual_seed(1234)
    torch.testing.assert_close(torch.rand(8, device=be.device()), a)
    state = be.get_rng_state()
    b = torch.rand(8, device=be.device())
    be.set_rng_state(state)
    torch.testing.assert_close(torch.rand(8, device=be.device()), b)
    be.set_rng_state(state)
    with be.fork_rng():
        be.manual_seed(99)
        inside = torch.rand(8, device=be.device())
    torch.testing.assert_close(torch.rand(8, device=be.device()), b)
    assert not torch.equal(inside, b)


def test_capabilities_are_consistent_facts(suite_backend):
    be = suite_backend
    caps = be.capabilities()
    assert isinstance(caps, Capabilities)
    assert caps.device_name and torch.float32 in caps.dtypes
    assert set(caps.fp8_formats) <= FP8_FORMATS
    if not caps.fp8_formats:
        assert caps.fp8_gemm is None and not caps.fp8_recipes and not caps.fp8_collectives
    assert caps.fp8_collectives == be.collectives.fp8_native or not caps.fp8_formats
    assert (caps.flash_head_dims is not None) == caps.flash_attention
    for dtype, peak in caps.peak_flops.items():
        assert peak is None or peak > 1e9, (dtype, peak)
    # the names Capabilities.peak looks up: another key ("bfloat16") is never read, so MFU and % of peak go missing
    assert set(caps.peak_flops) <= PEAK_NAMES, f"peak_flops keys {sorted(set(caps.peak_flops) - PEAK_NAMES)}: " \
                                               f"use {sorted(PEAK_NAMES)}"
    assert set(caps.fp8_recipes) <= FP8_RECIPES, f"fp8_recipes {caps.fp8_recipes}: a subset of {sorted(FP8_RECIPES)}"
    assert caps.fp8_gemm in (None, "scaled_mm", "emulated"), caps.fp8_gemm
    if caps.fp8_gemm == "scaled_mm":  # docs/backends.md: claimed only where the probe GEMM ran on the device
        assert scaled_mm_runs(be.device()), "fp8_gemm 'scaled_mm' but torch._scaled_mm does not run on the device"
    if be.name.startswith("musa"):
        assert caps.arch.startswith("mp_"), "a MUSA device reports its own mp_XY arch"
    if be.name == "cuda":
        assert caps.arch.startswith("sm_")


def test_autocast_follows_capabilities(suite_backend):
    be = suite_backend
    x = torch.randn(8, 8, device=be.device())
    if torch.bfloat16 in be.capabilities().dtypes:
        with be.autocast(torch.bfloat16):
            assert (x @ x).dtype == torch.bfloat16
    with be.autocast(None):
        assert (x @ x).dtype == torch.float32


def test_fp8_quantize_and_gemm(suite_backend):
    be = suite_backend
    if not be.capabilities().fp8_formats:
        return  # no FP8 on this device: nothing claimed, nothing to check
    dev = be.device()
    torch.manual_seed(0)
    a, b = torch.randn(32, 64, device=dev), torch.randn(64, 48, device=dev)
    sa, sb = 448.0 / a.abs().amax(), 448.0 / b.abs().amax()
    qa, amax = be.fp8.quantize(a, "e4m3", sa)
    qb, _ = be.fp8.quantize(b, "e4m3", sb)
    assert qa.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(amax.float().cpu(), a.abs().amax().cpu())
    out = be.fp8.scaled_mm(qa, qb.t().contiguous().t(), 1 / sa, 1 / sb, out_dtype=torch.float32)
    want = (qa.double() / sa.double()) @ (qb.double() / sb.double())
    torch.testing.assert_close(out.double().cpu(), want.cpu(), atol=1e-3, rtol=1e-3)
    exact = (a.double() @ b.double()).cpu()
    assert (out.double().cpu() - exact).norm() / exact.norm() < 0.1, "FP8 GEMM far from the fp64 product"
