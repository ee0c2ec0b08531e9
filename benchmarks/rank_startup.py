"""How long a small ``omnitron train`` job takes end to end, by how its processes start (BENCHMARKS.md):

* ranks: forked from the launcher's fork server, which imported torch once (the default,
  ``workers.worker_context``), against spawned (each rank imports torch afresh; the launcher before
  2026-12-04 23:15 UTC), for a 2-iteration tp2 x pp2 job (4 ranks, ``--num-workers 0``);
* loader workers: forked (``sampler.worker_start_method``) against spawned, for a one-process job with
  Megatron's ``--num-workers 2`` (spawned is what a launcher-spawned rank's loader did before).

    python benchmarks/rank_startup.py [--rounds 3]

Each variant runs in a fresh ``python`` whose module attribute is replaced before the command starts; the
variants alternate within each round, so the machine's load falls on both alike. Wall seconds of the whole
command (start to exit), medians over rounds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PATCHES = {
    "ranks forked (fork server)": "",
    "ranks spawned": "import multiprocessing as mp, omnitron.core.training.workers as w; "
                     "w.worker_context = lambda: mp.get_context('spawn')",
    "loader workers forked": "",
    "loader workers spawned": "import omnitron.core.data.sampler as s; s.worker_start_method = lambda: 'spawn'",
}


def _args(tmp: str, ranks: bool) -> list[str]:
    common = ["--model", "gpt2_tiny", "--mock-data", "--train-iters", "2", "--log-interval", "1", "--no-tensorboard",
              "--data-cache-path", os.path.join(tmp, "cache")]
    if ranks:
        return [*common, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                "--nproc-per-node", "4", "--num-workers", "0"]
    return [*common, "--num-workers", "2"]


def _run(patch: str, args: list[str]) -> float:
    code = f"import sys; {patch}\nfrom omnitron.cli import main\nsys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, "train", *args], env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{patch or 'default'}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in PATCHES}
    for r in range(a.rounds):
        for name, patch in PATCHES.items():
            with tempfile.TemporaryDirectory() as tmp:
                times[name].append(_run(patch, _args(tmp, name.startswith("ranks"))))
        print(f"round {r + 1}: " + ", ".join(f"{n} {t[-1]:.1f} s" for n, t in times.items()) +
              f" (load {os.getloadavg()[0]:.1f})", flush=True)
    med = {n: statistics.median(t) for n, t in times.items()}
    print(f"tp2 x pp2, 2 iterations: ranks forked {med['ranks forked (fork server)']:.1f} s, spawned "
          f"{med['ranks spawned']:.1f} s ({med['ranks spawned'] / med['ranks forked (fork server)']:.2f}x)")
    print(f"one process, --num-workers 2: loader workers forked {med['loader workers forked']:.1f} s, spawned "
          f"{med['loader workers spawned']:.1f} s "
          f"({med['loader workers spawned'] / med['loader workers forked']:.2f}x)")


if __name__ == "__main__":
    main()
