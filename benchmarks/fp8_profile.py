"""Where one FP8 linear layer's time goes: operator counts, host time per call, host syncs, top kernels.

For each recipe (and ``F.linear`` in BF16 as the baseline) one ``FP8Linear`` forward + backward at
``--tokens`` x ``--hidden`` (BF16 input, BF16 weight) is run:

* every ATen operator it dispatches is counted (a ``TorchDispatchMode``), forward and backward apart,
  and every operator that reads a device value back to the host (``.item()``, ``bool(t)``,
  ``nonzero`` ...) is listed as a host sync;
* the host (CPU) time per call is timed at the full shape, and at a tiny shape (``--tiny``) where the
  arithmetic is negligible, so the second figure is the per-call overhead of the Python and dispatch
  path (what bounds a GPU step when the GEMMs are fast);
* on a GPU (``OMNITRON_BACKEND=cuda``): the time to enqueue one call without waiting (host-bound
  when it exceeds the device time), the device time per call, torch.profiler's top kernels by device
  time, and host syncs as reported by ``torch.cuda.set_sync_debug_mode`` where the device has it.

    python benchmarks/fp8_profile.py [--tokens 2048 --hidden 2048] [--recipes tensorwise,delayed,blockwise]
    OMNITRON_BACKEND=cuda python benchmarks/fp8_profile.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnitron.backends import get_backend  # noqa: E402
from omnitron.core.precision.fp8 import FP8Config, FP8Linear  # noqa: E402
from omnitron.testing.ops import OpCounter  # noqa: E402



def make_call(recipe: str, be, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor):
    """(forward closure, backward closure) of one layer call under ``recipe`` ('bf16' = ``F.linear``)."""
    if recipe == "bf16":
        fwd = lambda: F.linear(x, w)  # noqa: E731
    else:
        ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), be.fp8, name=recipe)
        fwd = lambda: ex(x, w, None)  # noqa: E731
    return fwd, lambda y: y.backward(gy)


def count_ops(fwd, bwd) -> dict:
    """ATen operators of one forward and one backward (after a warm-up call, so caches are primed)."""
    bwd(fwd())
    with OpCounter() as cf:
        y = fwd()
    with OpCounter() as cb:
        bwd(y)
    return {"forward": dict(cf.counts), "backward": dict(cb.counts),
            "syncs": {**cf.syncs, **{f"{k} (bwd)": v for k, v in cb.syncs.items()}}}


def host_ms(fwd, bwd, be, iters: int) -> tuple[float, float]:
    """(host ms per call while enqueueing ``iters`` calls without waiting, wall ms per call incl. the device)."""
    bwd(fwd())
    be.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        bwd(fwd())
    enq = time.perf_counter() - t0
    be.synchronize()
    wall = time.perf_counter() - t0
    return enq / iters * 1e3, wall / iters * 1e3


def tensors(be, tokens: int, k: int, n: int, seed: int = 0):
    dev = be.current_device()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dev, torch.bfloat16).requires_grad_()
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev, torch.bfloat16).requires_grad_()
    gy = torch.randn(tokens, n, generator=g).to(dev, torch.bfloat16)
    return x, w, gy


def device_profile(fwd, bwd, be, iters: int, top: int) -> list[dict]:
    """torch.profiler over ``iters`` calls with the device's activities: top kernels by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + [getattr(ProfilerActivity, a) for a in ("CUDA", "PrivateUse1")
                                     if hasattr(ProfilerActivity, a) and be.device_type != "cpu"][:1]
    bwd(fwd())
    be.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(iters):
            bwd(fwd())
        be.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "self_cuda_time_total", 0.0)
        if dev_us:
            rows.append({"kernel": e.key[:90], "calls": e.count // iters, "device_us_per_call": dev_us / iters})
    rows.sort(key=lambda r: -r["device_us_per_call"])
    return rows[:top]


def sync_debug(fwd, bwd, be) -> list[str] | None:
    """Host syncs the device runtime reports during one call (``set_sync_debug_mode('warn')``); None
    where the device module has no such mode (CPU)."""
    mod = getattr(torch, be.device_type, None)
    if be.device_type == "cpu" or not hasattr(mod, "set_sync_debug_mode"):
        return None
    bwd(fwd())
    be.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod.set_sync_debug_mode("warn")
        try:
            bwd(fwd())
        finally:
            mod.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]


def profile_recipe(recipe: str, be, args) -> dict:
    x, w, gy = tensors(be, args.tokens, args.hidden, args.out_features or args.hidden)
    fwd, bwd = make_call(recipe, be, x, w, gy)
    row = {"recipe": recipe, "ops": count_ops(fwd, bwd)}
    row["host_ms"], row["wall_ms"] = host_ms(fwd, bwd, be, args.iters)
    xs, ws, gs = tensors(be, args.tiny, args.tiny, args.tiny, seed=1)
    f2, b2 = make_call(recipe, be, xs, ws, gs)
    row["tiny_host_ms"], _ = host_ms(f2, b2, be, max(args.iters, 20))
    row["sync_debug"] = sync_debug(fwd, bwd, be)
    if be.device_type != "cpu":
        row["top_kernels"] = device_profile(fwd, bwd, be, args.iters, args.top)
    return row


def report(rows: list[dict], be, args) -> None:
    print(f"# {be.capabilities().device_name} ({be.name}); {be.fp8.describe()}")
    print(f"# one linear forward + backward, tokens {args.tokens}, in {args.hidden}, out "
          f"{args.out_features or args.hidden}, bf16 input and weight; tiny shape {args.tiny}^2")
    print(f"{'recipe':11s} | {'ops fwd':>7s} {'ops bwd':>7s} | {'host ms':>8s} {'wall ms':>8s} | "
          f"{'tiny host ms':>12s} | host syncs")
    for r in rows:
        o = r["ops"]
        runtime = "" if r["sync_debug"] is None else f"; runtime reports {len(r['sync_debug'])} {r['sync_debug'][:2]}"
        print(f"{r['recipe']:11s} | {sum(o['forward'].values()):7d} {sum(o['backward'].values()):7d} | "
              f"{r['host_ms']:8.3f} {r['wall_ms']:8.3f} | {r['tiny_host_ms']:12.3f} | {o['syncs'] or 'none'}{runtime}")
    for r in rows:
        o = r["ops"]
        for phase in ("forward", "backward"):
            ops = sorted(o[phase].items(), key=lambda kv: (-kv[1], kv[0]))
            print(f"  {r['recipe']:11s} {phase:8s} " + ", ".join(f"{k} {v}" for k, v in ops))
    for r in rows:
        if r.get("top_kernels"):
            print(f"\n{r['recipe']}: top kernels by device time (us per call)")
            for k in r["top_kernels"]:
                print(f"  {k['device_us_per_call']:9.1f}  x{k['calls']:<3d} {k['kernel']}")


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048, help="in_features")
    ap.add_argument("--out-features", type=int, default=None, help="default: --hidden")
    ap.add_argument("--recipes", default="bf16,tensorwise,delayed,blockwise")
    ap.add_argument("--iters", type=int, default=None, help="calls timed (default 20 on a GPU, 2 on the CPU)")
    ap.add_argument("--tiny", type=int, default=64, help="side of the overhead-only shape")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per recipe (GPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    be = get_backend()
    if args.iters is None:
        args.iters = 2 if be.device_type == "cpu" else 20
    rows = [profile_recipe(r, be, args) for r in args.recipes.split(",") if r]
    report(rows, be, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": be.capabilities().device_name, "backend": be.name, "args": vars(args), "rows": rows},
                      f, indent=1)
    return rows


if __name__ == "__main__":
    main()
