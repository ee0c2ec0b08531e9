"""Cost of strict collective checking and of the flight recorder on the main job (tp2 x pp2, 4 CPU ranks).

Runs ``omnitron train --config examples/moby_dick_tp2_pp2.yaml`` for ``--iters`` iterations in three
modes, alternating them ``--rounds`` times so machine noise hits all alike, and reports the median of
the logged ms/step (the first log interval, warm-up, dropped):
- ``bare``: flight recorder off (``OMNITRON_FLIGHT_RECORDER_SIZE=0``), strict off;
- ``default``: the default (recorder on, strict off);
- ``strict``: ``OMNITRON_STRICT_COLLECTIVES=1`` (fingerprint exchange per collective, NCCL-ordered p2p).

    python benchmarks/strict_overhead.py [--iters 40 --rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from omnitron.testing.megatron_log import parse_training_line  # noqa: E402
MODES = {"bare": {"OMNITRON_FLIGHT_RECORDER_SIZE": "0", "OMNITRON_STRICT_COLLECTIVES": "0"},
         "default": {"OMNITRON_STRICT_COLLECTIVES": "0"},
         "strict": {"OMNITRON_STRICT_COLLECTIVES": "1"}}


def run_once(mode: str, iters: int, log_interval: int) -> list[float]:
    """ms/step (Megatron's ``elapsed time per iteration (ms)``) of every log line after the first interval's (the
    process's first iteration has a line of its own, and the first interval's holds the warm-up)."""
    env = {**os.environ, **MODES[mode], "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as save:
        cmd = [sys.executable, "-m", "omnitron", "train", "--config", "examples/moby_dick_tp2_pp2.yaml",
               "--train-iters", str(iters), "--log-interval", str(log_interval), "--eval-interval", "0",
               "--save", save, "--save-interval", str(10 * iters), "--sample-tokens", "0"]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{mode}: train failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    lines = [parse_training_line(ln) for ln in (out.stdout + out.stderr).splitlines()]
    return [p["elapsed_ms"] for p in lines if p and p["iteration"] > log_interval]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            got[mode] += run_once(mode, args.iters, args.log_interval)
    med = {m: statistics.median(v) for m, v in got.items()}
    for m, v in got.items():
        print(f"{m:8s} median {med[m]:7.1f} ms/step  ratio to bare {med[m] / med['bare']:.3f}  samples {v}")


if __name__ == "__main__":
    main()
