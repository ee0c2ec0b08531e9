"""CUDA backend on a real GPU: stream overlap, event timing, memory statistics, NCCL at world size 1.

Run by ``scripts/device_check.sh`` (``pytest -m gpu --backend cuda``); skipped elsewhere.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from backend_collective_checks import collective_suite
from omnitron.testing.distributed import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("OMNITRON_BACKEND") != "cuda", reason="needs --backend cuda")]


@pytest.fixture(scope="module")
def cuda():
    from omnitron.backends import get_backend

    be = get_backend("cuda")
    be.set_device(0)
    return be


def _timed(be, work) -> float:
    """Milliseconds the enclosed GPU work takes, measured by the backend's events."""
    start, end = be.Event(enable_timing=True), be.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def test_two_streams_overlap(cuda):
    cycles = 20_000_000  # torch.cuda._sleep spins a single thread block for this many clocks
    torch.cuda._sleep(1000)
    cuda.synchronize()

    def serial():
        torch.cuda._sleep(cycles)
        torch.cuda._sleep(cycles)

    def parallel():
        main = cuda.current_stream()
        s1, s2 = cuda.Stream(), cuda.Stream()
        for s in (s1, s2):
            s.wait_stream(main)
            with cuda.stream(s):
                torch.cuda._sleep(cycles)
        main.wait_stream(s1)
        main.wait_stream(s2)

    t_serial, t_parallel = _timed(cuda, serial), _timed(cuda, parallel)
    assert t_serial > 1.0, f"sleep kernel too short to time ({t_serial:.3f} ms)"
    assert t_parallel < 0.75 * t_serial, f"no overlap: two streams {t_parallel:.2f} ms vs serial {t_serial:.2f} ms"


def test_event_timing_measures_gemm_below_peak(cuda):
    n = 4096
    a = torch.randn(n, n, device=cuda.device(), dtype=torch.bfloat16)
    b = torch.randn(n, n, device=cuda.device(), dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    reps = 20
    ms = _timed(cuda, lambda: [a @ b for _ in range(reps)])
    tflops = 2 * n**3 * reps / (ms / 1e3) / 1e12
    peak = cuda.capabilities().peak("bf16")
    print(f"bf16 GEMM {n}^3: {tflops:.0f} TFLOP/s (peak in table: {peak and peak / 1e12})")
    assert tflops > 5, f"implausibly slow ({tflops:.1f} TFLOP/s): events mis-timed?"
    if peak:
        assert tflops < 1.05 * peak / 1e12, "measured above the datasheet peak: peak table wrong?"


def test_memory_stats_track_allocations(cuda):
    cuda.empty_cache()
    cuda.reset_peak_memory_stats()
    before = cuda.memory_stats()
    nbytes = 256 * 2**20
    buf = torch.empty(nbytes, dtype=torch.uint8, device=cuda.device())
    during = cuda.memory_stats()
    assert during["allocated"] - before["allocated"] >= nbytes
    assert during["reserved"] >= during["allocated"] and during["peak_allocated"] >= during["allocated"]
    assert 0 < during["free"] < during["total"]
    assert abs(during["total"] - cuda.capabilities().memory_total) < 0.05 * during["total"]
    del buf
    cuda.empty_cache()
    after = cuda.memory_stats()
    assert after["allocated"] <= before["allocated"] and after["peak_allocated"] >= during["allocated"]
    cuda.reset_peak_memory_stats()
    assert cuda.memory_stats()["peak_allocated"] == cuda.memory_stats()["allocated"]


def test_capabilities_on_this_gpu(cuda):
    caps = cuda.capabilities()
    major, minor = torch.cuda.get_device_capability()
    assert caps.arch == f"sm_{major}{minor}" and caps.device_name == torch.cuda.get_device_name()
    assert bool(caps.fp8_formats) == ((major, minor) >= (8, 9))
    print(f"{caps.device_name} {caps.arch} fp8_gemm={caps.fp8_gemm} peak bf16={caps.peak('bf16')}")


def test_nccl_collectives_at_world_size_one(cuda):
    (result,) = run_distributed(collective_suite, 1, backend="cuda", timeout_s=240)
    assert result["dist_backend"] == "nccl" and len(result["checks"]) >= 40, result["checks"]


def test_capture_replays_forward_and_backward_as_eager(cuda):
    """``Backend.capture``: a CUDA-graphed MLP gives eager's output and gradients on fresh inputs. The replay
    runs the kernels eager would, unless cuBLAS picks another algorithm under capture: then fp32 sums of k <= 128
    terms reorder, ~sqrt(k) u = 7e-7 relative; 1e-5 leaves 10x, a stale or unreplayed graph is off by O(1)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).cuda()
    twin = copy.deepcopy(mlp)
    graphed = cuda.capture(twin, (torch.randn(32, 64, device="cuda", requires_grad=True),))
    for _ in range(2):
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        xe = x.detach().clone().requires_grad_(True)
        y, ye = graphed(x), mlp(xe)
        y.square().sum().backward()
        ye.square().sum().backward()
        torch.testing.assert_close(y, ye, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-6)
        for p, q in zip(twin.parameters(), mlp.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
            p.grad = q.grad = None
