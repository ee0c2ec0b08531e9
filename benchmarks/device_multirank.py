"""Multi-rank layouts on one GPU against the CPU run of the same layout (scripts/device_bench.sh, step 2).

NCCL refuses two ranks on one device, so the multi-rank layouts run as 2-4 processes sharing the one GPU
with ``OMNITRON_COLLECTIVES=host-staged`` (gloo carrying host copies of the device tensors: every engine
path, real device tensors and streams, only the transport differs). The one-rank layouts run on NCCL.
Each layout trains the bundled Moby Dick GPT for ``--iters`` steps in float32 (TF32 off, torch's
default) on the device and on the CPU; the losses must agree within ``--rtol``.

Bound: both runs compute the same float32 maths in different summation orders (cuBLAS against the CPU
GEMMs, gloo against the staged reductions): each loss differs by a few units of float32 rounding at
step 1 (relative ~1e-6: the log-softmax of 4096 logits summed over 2048 tokens), and the difference
grows with training as the two parameter trajectories separate; over 8 steps of Adam at lr 3e-3 with
warm-up the CPU-only layouts of tests/parallel stay within 1e-4 of one process, so ``--rtol`` 1e-3 leaves
a factor of ten for the device's different kernels (cuBLAS split-K, fused softmax) while a wrong
gradient (a missed reduction, a stale buffer) moves the loss by far more within two steps.

    python3 benchmarks/device_multirank.py --out results/multirank.json
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

CONFIG = "examples/moby_dick_tp2_pp2.yaml"
SINGLE = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
LAYOUTS = {  # name: (processes, flags over the config)
    "tp2-pp2": (4, []),
    "dp2-distopt": (2, SINGLE + ["--use-distributed-optimizer"]),
    "cp2-ring": (2, SINGLE + ["--context-parallel-size", "2"]),
    "ep2-moe": (2, SINGLE + ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]),
    "tp1-nccl": (1, SINGLE),
    "tp1-moe-nccl": (1, SINGLE + ["--num-experts", "4", "--moe-router-topk", "2"]),
}


def warmup_iters(iters: int) -> int:
    """Two warm-up iterations, fewer in a shorter run (the warm-up must end before the decay, as Megatron's
    scheduler asserts; the decay spans ``--train-iters``)."""
    return max(0, min(2, iters - 1))


def train(backend: str, procs: int, flags: list[str], iters: int, workdir: str, tag: str,
          timeout_s: float = 120.0) -> tuple[list[float], float]:
    """Run one training in ``workdir/tag``; returns (losses per iteration, seconds). A launch that fails or
    outlives ``timeout_s`` raises with the end of its output."""
    log_dir = os.path.join(workdir, tag)
    # one torch thread per rank and no JIT build of the C++ CPU kernels: with --jobs, a dozen launches share
    # the host, and on the H200 machine (16 cores, 2026-12-04) their default threads and concurrent kernel
    # builds made the 1.3M-parameter CPU references take 15 s a step, past every limit
    env = dict(os.environ, OMNITRON_BACKEND=backend, PYTHONUNBUFFERED="1", OMNITRON_JIT_BUILD="0")
    if backend != "cpu" and procs > 1:
        env["OMNITRON_COLLECTIVES"] = "host-staged"
    cmd = [sys.executable, "-m", "omnitron", "train", "--config", CONFIG, "--backend", backend,
           "--nproc-per-node", str(procs), "--train-iters", str(iters), "--log-interval", "1",
           "--eval-interval", "0", "--log-dir", log_dir, "--save", os.path.join(workdir, f"ckpt-{tag}"),
           "--lr-warmup-iters", str(warmup_iters(iters)), "--threads-per-process", "1", *flags]
    t0 = time.perf_counter()
    # its own process group, so a launch past the timeout is ended with every rank it started
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise RuntimeError(f"{backend} run timed out after {timeout_s:.0f}s:\n{out[-3000:]}\n{err[-3000:]}")
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{backend} run failed (rc {proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["lm_loss"] for r in rows if "lm_loss" in r and "iteration" in r], dt


def run_layout(name: str, args) -> dict:
    """One layout on the device and on the CPU, side by side (two launches at once); the per-layout result."""
    procs, flags = LAYOUTS[name]
    flags = flags + args.extra.split()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(train, b, procs, flags, args.iters, tmp, tag, args.timeout)
                for b, tag in ((args.device_backend, "device"), ("cpu", "cpu"))]
        got, errors = [], []
        for tag, r in zip(("device", "cpu"), runs):
            try:
                got.append(r.result())
            except RuntimeError as err:  # keep the other run's losses: a device run that worked is news
                got.append(([], 0.0))
                errors.append(f"{tag}: {str(err)[-2000:]}")
        (dev, dev_s), (ref, ref_s) = got
        if errors:
            return {"status": "error", "error": "\n".join(errors), "procs": procs, "device_losses": dev,
                    "cpu_losses": ref, "device_s": dev_s, "cpu_s": ref_s}
    worst = max((abs(a - b) / abs(b) for a, b in zip(dev, ref)), default=float("inf"))
    ok = len(dev) == len(ref) == args.iters and worst <= args.rtol
    return {"status": "ok" if ok else "mismatch", "procs": procs, "device_losses": dev, "cpu_losses": ref,
            "max_rel_diff": worst, "device_s": dev_s, "cpu_s": ref_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file for the per-layout results")
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-3, help="loss agreement bound (derivation in the docstring)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--device-backend", default="cuda")
    ap.add_argument("--extra", default="", help="more `omnitron train` flags for every run (one string)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="layouts run at once (each is two launches, device and CPU, side by side): the "
                         "small model's launches are start-up bound, so a many-core host overlaps them")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one launch may take")
    args = ap.parse_args()
    names = args.layouts.split(",")
    results: dict[str, dict] = {}

    lock = threading.Lock()

    def one(name: str) -> None:  # print and save each layout as it ends: a cut-short run keeps what finished
        r = run_layout(name, args)
        with lock:
            results[name] = r
            report(name, r)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(one, names))
    return 1 if any(r["status"] != "ok" for r in results.values()) else 0


def report(name: str, r: dict) -> None:
    """One line per layout; a failed one also prints the end of its output (the cause is usually there)."""
    if r["status"] == "error":
        lines = r["error"].splitlines()
        print(f"{name:14s} ERROR {lines[0]}\n    " + "\n    ".join(lines[-15:]), flush=True)
        return
    dev = r["device_losses"]
    print(f"{name:14s} {r['status'] if r['status'] == 'ok' else r['status'].upper():8s} procs {r['procs']}  "
          f"max rel diff {r['max_rel_diff']:.2e}  device {r['device_s']:.0f}s cpu {r['cpu_s']:.0f}s  "
          f"last loss {dev[-1] if dev else float('nan'):.4f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
