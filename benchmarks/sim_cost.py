"""Cost of the simulated accelerator against cpu on the parity tests' workers (side by side, one run).

Runs the workers of tests/parallel/test_parity_3d.py (pp2: every schedule; 3d4: (1,4,1) (2,2,1) (1,2,2)
(2,1,2)), tests/optim/test_distributed_optimizer.py (4 ranks) and the README's main job for 3 steps (``main``:
tests/training/test_main_job.py's command, tp2 x pp2 through ``omnitron train``) on ``cpu`` and on ``sim``, alternating
the backends per case so machine noise hits both alike (after a warm-up that starts the fork server),
and prints each case's wall time and the
sim/cpu ratio (process start-up included: it is what CI pays).

    python benchmarks/sim_cost.py [--cases pp2,3d4,distopt,main]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("tests/parallel", "tests/optim"):
    sys.path.insert(0, os.path.join(ROOT, sub))


def _cases() -> dict:
    import test_distributed_optimizer as distopt
    import test_parity_3d as p3d

    from omnitron.testing.distributed import REFERENCE_KERNELS

    return {
        "pp2": (p3d.parity_worker, 2, ([(1, 2, 1)],), REFERENCE_KERNELS),
        "3d4": (p3d.parity_worker, 4, ([(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)],), REFERENCE_KERNELS),
        "distopt": (distopt._worker, 4, None, None),
        "main": None,  # a subprocess: :func:`main_job`
    }


def main_job(backend: str, root: str) -> None:
    """The main job for 3 steps on ``backend`` (the command of tests/training/test_main_job.py)."""
    import subprocess

    cmd = [sys.executable, "-m", "omnitron", "train",
           "--config", os.path.join(ROOT, "examples", "moby_dick_tp2_pp2.yaml"),
           "--train-iters", "3", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1", "--lr-warmup-iters", "0",
           "--save", os.path.join(root, "run"), "--sample-tokens", "4", "--no-tensorboard", "--backend", backend]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900, cwd=ROOT,
                   env=dict(os.environ, PYTHONPATH=ROOT))


def timed(backend: str, case) -> float:
    from omnitron.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        if case is None:
            main_job(backend, root)
            return time.perf_counter() - t0
        fn, world, args, env = case
        run_distributed(fn, world, *(args if args is not None else (root,)), backend=backend, env=env,
                        timeout_s=900)
        return time.perf_counter() - t0


def _noop() -> int:
    return 0


def warm_up() -> None:
    """Start the fork server (it imports torch once) and load each backend once, outside the timings."""
    from omnitron.testing.distributed import run_distributed

    for backend in ("cpu", "sim"):
        run_distributed(_noop, 1, backend=backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="pp2,3d4,distopt,main")
    names = ap.parse_args().cases.split(",")
    cases, total = _cases(), {"cpu": 0.0, "sim": 0.0}
    warm_up()
    print(f"{'case':8s} {'cpu s':>8s} {'sim s':>8s} {'sim/cpu':>8s}")
    for name in names:
        got = {b: timed(b, cases[name]) for b in ("cpu", "sim")}
        for b in total:
            total[b] += got[b]
        print(f"{name:8s} {got['cpu']:8.1f} {got['sim']:8.1f} {got['sim'] / got['cpu']:8.2f}", flush=True)
    print(f"{'total':8s} {total['cpu']:8.1f} {total['sim']:8.1f} {total['sim'] / total['cpu']:8.2f}")


if __name__ == "__main__":
    main()
