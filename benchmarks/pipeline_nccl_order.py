"""A schedule's step under NCCL's in-order point-to-point, on the ideal clock (no processes).

The exchange plan (``p2p.py``) is checked deadlock-free under NCCL's rule that a rank's batches on one
communicator complete in the order posted (``tests/parallel/test_pipeline_schedules.py``). This prices that rule:
each rank posts batch i when it reaches exchange i (after action i - 1), its stream starts the batch once the
previous one completed, the batch completes once every peer's matching batch has started (transfers take no
time), and action i starts once the batch holding its input completed. Costs: ``zb_stage_cost`` (F = B = W = 1).
Compared with the ideal clock (``simulate``), the difference is waiting caused by the in-order rule alone.

    python benchmarks/pipeline_nccl_order.py [--pp 2 4 8] [--microbatches 8 16]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnitron.core.parallel.pipeline import build_schedule, simulate  # noqa: E402
from omnitron.core.parallel.pipeline.p2p import nccl_order_makespan  # noqa: E402
from omnitron.core.parallel.pipeline.schedules import zb_stage_cost  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    args = ap.parse_args()
    print("| schedule | p | m | ideal clock | NCCL order |\n|---|---|---|---|---|")
    for pp in args.pp:
        for m in args.microbatches:
            rows = [("zb-v", build_schedule("zb-v", pp, 2, m))]
            if m >= 2 * pp:
                dual = build_schedule("dualpipe-v", pp, 2, m)
                rows += [("dualpipe-v, pairs consecutive", dataclasses.replace(dual, pairs={})), ("dualpipe-v", dual)]
            for name, s in rows:
                print(f"| {name} | {pp} | {m} | {simulate(s, stage_cost=zb_stage_cost).makespan:g} | "
                      f"{nccl_order_makespan(s):g} |", flush=True)


if __name__ == "__main__":
    main()
