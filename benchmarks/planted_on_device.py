"""Do the planted stream bugs that `sim` catches show on a real device? (issue 31's ground truth; step
"planted" of scripts/device_bench.sh)

tests/sim/test_sim_planted.py plants the bugs a GPU shows and a CPU hides, and asserts that `sim` names each
one. This script runs the one-process cases on any backend, many times, and counts how often the bug
*manifests* (wrong numbers reach the program) or is *caught* (the backend stops it with a message):

* ``early-host-read``: a ``non_blocking`` device-to-host copy, queued behind a long kernel, read on the host
  before synchronizing. A GPU hands back whatever the pinned buffer held (stale or zero values).
* ``freed-without-record-stream``: a tensor read by a kernel on a side stream, freed on the main stream
  without ``record_stream``, its block reused and overwritten by the main stream while the side stream's
  work is still queued. A GPU's caching allocator hands the block out at once: the side stream reads the
  new values.

Expected: cuda manifests (the bugs are real and silent there), sim catches (every run, naming the cause),
cpu neither (no streams: the program is right by accident). The two-rank cases (a collective read before
``wait()``, opposite collective orders, a background thread's collectives) need two devices under NCCL and
are not run on a one-GPU machine.

    OMNITRON_BACKEND=cuda python3 benchmarks/planted_on_device.py --json out.json
    python benchmarks/planted_on_device.py --backend sim --trials 3
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("early-host-read", "freed-without-record-stream")


def _busy(be, rounds: int = 50) -> None:
    """Queue ``rounds`` 2048^2 matrix products on the current stream (about 15 ms on a GPU in float32): what is
    queued behind them has not run when the host looks. Host-run backends (cpu, sim) get 64^2 products: they
    run work when it is issued, so the size only costs time there."""
    size = 64 if be.device_type in ("cpu", "sim") else 2048
    a = torch.randn(size, size, device=be.device())
    for _ in range(rounds):
        a = torch.tanh(a @ a * (1.0 / size))


def early_host_read(be, n: int) -> bool:
    """True when the early read differs from the value that lands (the bug manifested)."""
    x = torch.randn(n, device=be.device())
    _busy(be)
    host = x.to("cpu", non_blocking=True)  # pinned destination on a device backend; the copy is queued
    early = host[-4096:].clone()  # the bug: a host read before synchronizing
    be.synchronize()
    return not torch.equal(early, host[-4096:])


def freed_without_record_stream(be, n: int) -> bool:
    """True when the side stream read the main stream's overwrite instead of x (the bug manifested)."""
    x = torch.full((n,), 1.0, device=be.device())
    side = be.Stream()
    side.wait_stream(be.current_stream())
    with be.stream(side):
        _busy(be)
        y = x * 2  # queued behind the busy work on the side stream
    del x  # the bug: no x.record_stream(side); the block is free for the main stream at once
    z = torch.full((n,), 7.0, device=be.device())  # same size: the allocator hands back x's block
    be.current_stream().wait_stream(side)
    wrong = not bool((y == 2.0).all())
    del z
    return wrong


def run_case(name: str, trials: int, n: int) -> dict:
    """In this process: ``trials`` runs of case ``name``; a raised error means the backend caught it."""
    from omnitron.backends import get_backend

    be = get_backend()
    fn = {"early-host-read": early_host_read, "freed-without-record-stream": freed_without_record_stream}[name]
    manifested = 0
    for _ in range(trials):
        try:
            manifested += fn(be, n)
        except RuntimeError as err:
            return {"case": name, "outcome": "caught", "message": str(err).splitlines()[0][:300], "trials": trials}
    return {"case": name, "outcome": "manifested" if manifested else "silent", "manifested": manifested,
            "trials": trials}


def in_child(name: str, backend: str, trials: int, n: int) -> dict:
    """One case in its own process: sim ends a process that reads a guarded page (that, too, is caught)."""
    env = dict(os.environ, OMNITRON_BACKEND=backend, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--trials", str(trials), "--elements", str(n)],
                          capture_output=True, text=True, env=env, timeout=300)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return {"case": name, "outcome": "caught" if proc.returncode else "error", "exit": proc.returncode,
            "message": (tail[-1] if tail else "")[:300], "trials": trials}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=os.environ.get("OMNITRON_BACKEND", "cpu"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--elements", type=int, default=1 << 24, help="floats per planted tensor (64 MiB)")
    ap.add_argument("--json", help="write the per-case results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_case(args.child, args.trials, args.elements)), flush=True)
        return 0
    rows = [in_child(name, args.backend, args.trials, args.elements) for name in CASES]
    for r in rows:
        detail = f"{r.get('manifested', 0)}/{r['trials']} runs" if r["outcome"] != "caught" else r.get("message", "")
        print(f"{args.backend:6s} {r['case']:30s} {r['outcome']:10s} {detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "rows": rows}, f, indent=1)
    return 1 if any(r["outcome"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
