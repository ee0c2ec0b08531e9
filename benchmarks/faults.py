"""Fault-tolerance figures (BENCHMARKS.md): seconds from a frozen rank / a killed launcher / a killed worker to
every process gone, torchrun's restart-to-resumed time, and the watchdog's cost per step.

    python benchmarks/faults.py [--nproc 4] [--only freeze,launcher,worker,startup,store,restart,cost]

The fault runs are a tiny GPT at tp2 x pp2 (4 processes) with ``--distributed-timeout-minutes 1``. The cost
is measured side by side in one process: the same training steps with the watchdog (a real TCPStore, the
shortest heartbeat interval, 0.2 s) and without, alternated over rounds.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnitron.testing.faults import (children, records, start, tiny_train_args, wait_for_iteration,  # noqa: E402
                                    wait_gone)
from omnitron.testing.megatron_log import parse_training_line  # noqa: E402


def _layout(nproc: int) -> list[str]:
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", str(nproc // 2),
            "--global-batch-size", "4"] if nproc >= 4 else ["--tensor-model-parallel-size", str(nproc)]


def _first_worker(proc, nproc: int) -> list[int]:
    """The launcher's workers as soon as rank 1 exists (still importing), rank 1 stopped."""
    workers = children(proc.pid)
    while len(workers) < 2:
        assert proc.poll() is None
        time.sleep(0.005)
        workers = children(proc.pid)
    os.kill(workers[1], signal.SIGSTOP)
    while len(workers) < nproc:
        time.sleep(0.05)
        workers = children(proc.pid)
    return workers


def fault(kind: str, nproc: int) -> float:
    """Seconds from the fault to every process of the job gone (``startup``: rank 1 stopped while importing;
    ``store``: the launcher, which hosts the store, stopped until its workers are gone, then continued)."""
    tmp = tempfile.mkdtemp()
    proc = start(tiny_train_args(tmp, "--train-iters", "100000", "--nproc-per-node", str(nproc),
                                 "--distributed-timeout-minutes", "1", *_layout(nproc)))
    lines: list[str] = []  # drained as it comes: a full pipe would block the ranks' log and dump writes
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    t0 = time.monotonic()
    if kind == "startup":
        workers = _first_worker(proc, nproc)
    else:
        wait_for_iteration(os.path.join(tmp, "logs", "metrics.jsonl"), 3, proc, timeout_s=600)
        workers = children(proc.pid)
        t0 = time.monotonic()
    if kind == "freeze":
        os.kill(workers[1], signal.SIGSTOP)
    elif kind == "worker":
        os.kill(workers[1], signal.SIGKILL)
    elif kind == "store":
        os.kill(proc.pid, signal.SIGSTOP)
        seconds = wait_gone(workers, 300)
        os.kill(proc.pid, signal.SIGCONT)
    elif kind == "launcher":
        os.kill(proc.pid, signal.SIGKILL)
    seconds = wait_gone([proc.pid, *workers], 300) if kind != "store" else seconds
    proc.wait()
    reader.join(timeout=10)
    out = "".join(lines)
    first = next((line for line in out.splitlines() if line.startswith("omnitron train:")), "(no launcher line)")
    print(f"{kind}: all {nproc} workers and the launcher gone {seconds:.1f} s after the fault; {first}", flush=True)
    return seconds


def restart(nproc: int) -> float:
    """torchrun --max-restarts 1, one worker killed: seconds from the kill to the first resumed iteration."""
    tmp = tempfile.mkdtemp()
    save = os.path.join(tmp, "ck")
    args = tiny_train_args(tmp, "--train-iters", "40", "--save", save, "--load", save, "--save-interval", "5",
                           *_layout(nproc))
    proc = start(["--nproc-per-node", str(nproc), "--max-restarts", "1", "--monitor-interval", "0.2", "-m",
                  "omnitron", "train", *args], launcher=("-m", "torch.distributed.run"))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in proc.stdout], daemon=True)
    reader.start()
    metrics = os.path.join(tmp, "logs", "metrics.jsonl")
    while not [ln for _, ln in lines if (parse_training_line(ln) or {}).get("iteration") == 7]:
        assert proc.poll() is None and not [ln for _, ln in lines if "Traceback" in ln], "".join(ln for _, ln in lines)
        time.sleep(0.05)
    workers = children(proc.pid)  # torchrun's agent is the launched process itself
    t0 = time.monotonic()
    os.kill(workers[-1], signal.SIGKILL)
    proc.wait(timeout=600)
    reader.join(timeout=10)
    resumed = [i for i, (_, ln) in enumerate(lines) if ln.startswith("resumed from")]
    after = [t for t, ln in lines[resumed[-1]:] if parse_training_line(ln)] if resumed else []
    assert proc.returncode == 0 and after, "".join(ln for _, ln in lines)
    print(f"restart: first resumed iteration {after[0] - t0:.1f} s after the kill ({lines[resumed[-1]][1].strip()}); "
          f"{metrics}", flush=True)
    return after[0] - t0


def cost(rounds: int = 8, iters: int = 30) -> tuple[float, float]:
    """Median ms/step (the loop's own step times) without and with the watchdog, alternated over ``rounds``."""
    import datetime

    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train
    from omnitron.core.training.watchdog import NullWatchdog, Watchdog
    from omnitron.core.training.workers import host_store

    host = host_store(1, 60.0)
    port = host.port
    connect = lambda: dist.PrefixStore("bench/", dist.TCPStore("127.0.0.1", port, 1, False,  # noqa: E731
                                                               datetime.timedelta(seconds=60)))
    per = {"off": [], "on": []}
    for r in range(rounds):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            tmp = tempfile.mkdtemp()
            settings = parse_settings(tiny_train_args(tmp, "--train-iters", str(iters), "--hidden-size", "64"), 1)
            wd = Watchdog(0, 1, 60.0, connect, interval_s=0.2).start() if mode == "on" else NullWatchdog()
            train(settings, get_backend("cpu"), watchdog=wd)
            wd.stop()
            steps = [rec["step_time_s"] for rec in records(os.path.join(tmp, "logs", "metrics.jsonl"))[1:]]
            per[mode].append(statistics.median(steps) * 1e3)  # the step loop only (the first step left out)
    idle = {}
    for mode in ("off", "on"):  # CPU the watchdog's threads take per second of an otherwise idle process
        wd = Watchdog(0, 1, 60.0, connect, interval_s=0.2).start() if mode == "on" else NullWatchdog()
        c0, t0 = time.process_time(), time.perf_counter()
        time.sleep(5.0)
        idle[mode] = (time.process_time() - c0) / (time.perf_counter() - t0)
        wd.stop()
    wd, n = Watchdog(0, 1, 60.0, connect, interval_s=0.2), 100000
    t0 = time.perf_counter()
    for _ in range(n):
        with wd.deadline("step"):
            pass
    print(f"watchdog threads: {1e3 * (idle['on'] - idle['off']):.2f} ms CPU per second (heartbeat every 0.2 s); "
          f"deadline enter+exit {1e6 * (time.perf_counter() - t0) / n:.2f} us", flush=True)
    del host
    off, on = statistics.median(per["off"]), statistics.median(per["on"])
    print(f"watchdog cost: {off:.2f} ms/step without, {on:.2f} ms/step with (ratio {on / off:.3f}); "
          f"rounds off {['%.2f' % v for v in per['off']]} on {['%.2f' % v for v in per['on']]}", flush=True)
    return off, on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--only", default="freeze,launcher,worker,restart,cost")
    a = ap.parse_args()
    os.environ.setdefault("OMNITRON_KERNELS", "reference")
    for what in a.only.split(","):
        if what in ("freeze", "launcher", "worker", "startup", "store"):
            fault(what, a.nproc)
        elif what == "restart":
            restart(a.nproc)
        elif what == "cost":
            cost()


if __name__ == "__main__":
    main()
