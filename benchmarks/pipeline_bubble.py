"""Pipeline bubble: the real runtime with synthetic stages of controlled, equal cost.

Each stage sleeps ``t`` per forward, ``t`` per input-gradient pass and ``t`` per weight-gradient
pass (a full backward costs ``2t``; interleaved and V-shaped chunks cost ``t / v`` each), so the measured idle
time is the schedule's bubble plus communication and Python overhead, not CPU contention. Each rank
records its compute spans; idle fraction = 1 - busy / (common end - common start), averaged over
ranks, printed against theory: 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1), ZB-H1 (p-1)/(3m+p-1),
ZB-V and DualPipeV (p-1)/(6m+p-1) (two chunks per rank in a V), with the step time (common end - common start).
``dualpipe-v-seq`` is DualPipeV's table with its forward/backward pairs run as two consecutive actions (no
receive posted ahead of the forward): the before/after of the pairs' communication overlap, in one run.

    python benchmarks/pipeline_bubble.py [--unit-ms 40]   (shorter units show per-action overhead)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, SEQ, MBS = 8, 4, 1


class _InputPath(torch.autograd.Function):
    """forward: sleep tf, identity; backward: sleep tb, identity (the input-gradient work)."""

    @staticmethod
    def forward(ctx, x, tf, tb):
        ctx.tb = tb
        time.sleep(tf)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tb)
        return g, None, None


class _WeightPath(torch.autograd.Function):
    """forward: zeros that depend on w; backward: sleep tw (the weight-gradient work)."""

    @staticmethod
    def forward(ctx, x, w, tw):
        ctx.tw = tw
        return torch.zeros_like(x) + 0 * w

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.tw)
        return None, torch.zeros(1) + 0 * g.sum(), None


class SleepStage(torch.nn.Module):
    """F, B and W each cost ``t``. Virtual stage 0 has no input gradient to compute (its B is a
    no-op in the runtime), so there W costs ``2t``: every stage then does 3t of work per micro-batch."""

    def __init__(self, t: float, first: bool) -> None:
        super().__init__()
        self.t, self.tw = t, (2 * t if first else t)
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        # the weight path sees a detached input: B (grad w.r.t. x) never runs it, W runs only it
        return _InputPath.apply(x, self.t, self.t) + _WeightPath.apply(x.detach(), self.w, self.tw)


def _step(chunk, batch, hidden):
    return chunk(batch if hidden is None else hidden)


def bench_worker(configs, unit: float):
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline import forward_backward

    coll = get_backend().collectives
    pp = dist.get_world_size()
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=pp), coll)
    out = []
    for name, vp, m in configs:
        import dataclasses

        groups = dataclasses.replace(base, config=ParallelConfig(pipeline_model_parallel_size=pp,
                                                                 virtual_pipeline_model_parallel_size=vp))
        chunks = [SleepStage(unit / (vp or 1), first=dist.get_rank() == 0 and c == 0) for c in range(vp or 1)]
        schedule = _schedule(name, pp, vp, m)
        for attempt in range(2):  # the first run warms up
            data = iter([torch.randn(SEQ, MBS, HIDDEN) for _ in range(m)])
            spans: list = []
            dist.barrier()
            forward_backward(schedule, chunks, data, groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                             hidden_size=HIDDEN, forward_step_fn=_step, timeline=spans)
        busy = sum(e - s for s, e, _ in spans)
        bounds = torch.tensor([-spans[0][0], spans[-1][1]], dtype=torch.float64)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
        step = bounds[1].item() + bounds[0].item()
        t = torch.tensor([1.0 - busy / step], dtype=torch.float64)
        dist.all_reduce(t)
        out.append((name, pp, vp or 1, m, t.item() / pp, step))
    return out


def _schedule(name: str, pp: int, vp: int | None, m: int):
    """The built schedule; ``dualpipe-v-seq``: DualPipeV without its overlapped pairs."""
    import dataclasses

    from omnitron.core.parallel.pipeline import build_schedule

    if name == "dualpipe-v-seq":
        return dataclasses.replace(build_schedule("dualpipe-v", pp, vp, m), pairs={})
    return build_schedule(name, pp, vp, m)


def main() -> None:
    from omnitron.core.parallel.pipeline import theory_bubble
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit-ms", type=float, default=40.0, help="cost of one F (or B, or W) pass of one stage")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"],
                    help="also dualpipe-v-seq (DualPipeV's pairs as consecutive actions)")
    args = ap.parse_args()
    two = ("interleaved", "zb-v", "dualpipe-v", "dualpipe-v-seq")
    print(f"| schedule | p | v | m | measured idle | theory | diff (pp) | step ms |\n|---|---|---|---|---|---|---|---|")
    for pp in args.pp:
        configs = [(n, 2 if n in two else None, m) for m in args.microbatches
                   for n in args.schedules if not n.startswith("dualpipe-v") or m >= 2 * pp]
        for name, p, v, m, idle, step in run_distributed(bench_worker, pp, configs, args.unit_ms / 1000)[0]:
            th = theory_bubble(name.removesuffix("-seq"), p, m, v)
            print(f"| {name} | {p} | {v} | {m} | {idle:.3f} | {th:.3f} | {100 * (idle - th):+.1f} | "
                  f"{1000 * step:.0f} |", flush=True)


if __name__ == "__main__":
    main()
