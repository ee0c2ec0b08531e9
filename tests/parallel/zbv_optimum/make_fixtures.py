"""Writes ``fixtures.json`` beside this file: the shortest step any V-shaped zero-bubble table can take on the ideal
clock at ``m < p`` micro-batches, proven by an exact solver (Google OR-Tools' CP-SAT), for zb-v's list schedule to be
compared with (``tests/parallel/test_pipeline_schedules.py``).

Needs ``pip install ortools`` (not a dependency of omnitron; omnitron is not imported). Run from the omnitron root:

    python tests/parallel/zbv_optimum/make_fixtures.py

The model is a relaxation of what omnitron's runtime may run, so its optimum bounds every legal table from below:
``p`` ranks, ``2p`` stages on the V (stage ``s`` on rank ``s`` below ``p``, else ``2p - 1 - s``); every micro-batch's
F, B and W on every stage, priced as ``zb_stage_cost`` (F = B = W = 1; stage 0: B = 0, W = 2); F of stage ``s``
after F of ``s - 1``, the last stage's B after its F, B of ``s`` after B of ``s + 1``, W after its B; one pass at a
time on a rank. No memory cap, no order of micro-batches and no p2p ordering is imposed (each only removes tables).
A case is written only when the solver proves its optimum (status OPTIMAL).
"""
from __future__ import annotations

import json
import os
import time

from ortools.sat.python import cp_model

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [(p, m) for p in range(2, 17) for m in range(1, p)]
LIMIT_S = 900.0


def _cost(stage: int, kind: str) -> int:
    if stage == 0 and kind in ("B", "W"):
        return 0 if kind == "B" else 2
    return 1


def optimum(p: int, m: int) -> tuple[str, int | None, float]:
    """(solver status, shortest makespan or None, the solver's proven lower bound)."""
    md = cp_model.CpModel()
    horizon = 8 * m * p + 8
    start, end, per_rank = {}, {}, {r: [] for r in range(p)}
    for s in range(2 * p):
        for kind in "FBW":
            for j in range(m):
                a, e = md.NewIntVar(0, horizon, ""), md.NewIntVar(0, horizon, "")
                interval = md.NewIntervalVar(a, _cost(s, kind), e, "")
                start[kind, s, j], end[kind, s, j] = a, e
                if _cost(s, kind):
                    per_rank[s if s < p else 2 * p - 1 - s].append(interval)
    for r in range(p):
        md.AddNoOverlap(per_rank[r])
    for j in range(m):
        for s in range(1, 2 * p):
            md.Add(start["F", s, j] >= end["F", s - 1, j])
        md.Add(start["B", 2 * p - 1, j] >= end["F", 2 * p - 1, j])
        for s in range(2 * p - 1):
            md.Add(start["B", s, j] >= end["B", s + 1, j])
        for s in range(2 * p):
            md.Add(start["W", s, j] >= end["B", s, j])
    span = md.NewIntVar(0, horizon, "span")
    for e in end.values():
        md.Add(span >= e)
    md.Minimize(span)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = LIMIT_S
    solver.parameters.num_workers = 1
    status = solver.Solve(md)
    value = solver.Value(span) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    return solver.StatusName(status), value, solver.BestObjectiveBound()


def main() -> None:
    out = []
    for p, m in CASES:
        t = time.perf_counter()
        status, value, bound = optimum(p, m)
        print(f"p={p} m={m}: {status} {value} (bound {bound}, {time.perf_counter() - t:.0f} s)", flush=True)
        if status == "OPTIMAL":
            out.append({"pp": p, "microbatches": m, "optimum": value})
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump({"solver": "ortools CP-SAT " + __import__("ortools").__version__, "cases": out}, f, indent=1)


if __name__ == "__main__":
    main()
