"""Every pipeline schedule on every micro-batch count it takes from 1 to 2 pp + 1 (interleaving at vp 2 and 3, the
V schedules at two chunks per rank; interleaving also in groups of N = pp + 1 micro-batches,
``--microbatch-group-size-per-virtual-pipeline-stage``, on every count Megatron takes up to 3 pp + 1) finishes
under strict in-order point-to-point (sim: NCCL's rule) and gives the loss and every stage's gradients of one
process in float64.

Reference: the same stages (Linear + Tanh, seeded by the global stage index) applied one after another in one
process, loss = mean over micro-batches of the per-token squared error's mean, back-propagated once. The pipeline
computes the same sums in another order only (per micro-batch contributions accumulated in schedule order): the
difference is a few ulps of the gradients' size (|g| < 10 here, m <= 10 terms: < 10 x 2^-52 x 10 ~ 2e-14); ATOL
leaves a factor 45.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

S, B, H = 4, 2, 8
ATOL = 1e-12


def _stage(k: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1000 + k)
    lin = torch.nn.Linear(H, H).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5)
        lin.bias.copy_(torch.randn(H, generator=g, dtype=torch.float64))
    return torch.nn.Sequential(lin, torch.nn.Tanh())


def _data(m: int) -> list[dict]:
    g = torch.Generator().manual_seed(7 + m)
    return [{"x": torch.randn(S, B, H, generator=g, dtype=torch.float64),
             "y": torch.randn(S, B, H, generator=g, dtype=torch.float64)} for _ in range(m)]


def _reference(stages: int, m: int) -> tuple[list[list[torch.Tensor]], float]:
    mods = [_stage(k) for k in range(stages)]
    loss = 0
    for b in _data(m):
        x = b["x"]
        for mod in mods:
            x = mod(x)
        loss = loss + ((x - b["y"]) ** 2).mean() / m
    loss.backward()
    return [[p.grad for p in mod.parameters()] for mod in mods], loss.item()


def cases(pp: int) -> list[tuple[str, int, int, int | None]]:
    """(schedule, chunks per rank, micro-batches, interleaving's group size): each schedule at every count it
    accepts; groups of pp + 1 where Megatron takes them (a last group of 0 or >= pp micro-batches)."""
    out = []
    for m in range(1, 2 * pp + 2):
        out += [("1f1b", 1, m, None), ("zb-h1", 1, m, None), ("zb-v", 2, m, None)]
        out += [("interleaved", v, m, None) for v in (2, 3) if m % pp == 0]
        out += [("dualpipe-v", 2, m, None)] if m >= 2 * pp else []
    n = pp + 1
    out += [("interleaved", v, m, n) for v in (2, 3) for m in range(n, 3 * pp + 2) if m % n == 0 or m % n >= pp]
    return out


def run_cases(todo) -> dict:
    """Per case: this rank's gradients by global stage, and the step's loss."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline import forward_backward
    from omnitron.core.parallel.pipeline.schedules import schedule_style, virtual_stage

    be = get_backend()
    dev = be.device()
    pp = torch.distributed.get_world_size()
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=pp), backend=be)
    out = {}
    for case in todo:
        sched, vp, m, n = case
        groups = dataclasses.replace(base, config=ParallelConfig(
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
            microbatch_group_size_per_vp_stage=n))
        stages = [virtual_stage(groups.pp.rank, c, pp, schedule_style(sched)) for c in range(vp)]
        chunks = [_stage(k).to(dev) for k in stages]
        last = {id(c) for c, k in zip(chunks, stages) if k == pp * vp - 1}

        def step(chunk, batch, hidden, last=last):
            y = chunk(batch["x"] if hidden is None else hidden)
            return ((y - batch["y"]) ** 2).mean(-1) if id(chunk) in last else y

        data = [{k: v.to(dev) for k, v in b.items()} for b in _data(m)]
        res = forward_backward(sched, chunks, iter(data), groups, num_microbatches=m, seq_length=S,
                               micro_batch_size=B, hidden_size=H, forward_step_fn=step, dtype=torch.float64)
        out[case] = ({k: [p.grad.cpu() for p in c.parameters()] for k, c in zip(stages, chunks)},
                               res["loss"])
    return out


def _check(pp: int, backend: str) -> None:
    todo = cases(pp)
    per_rank = run_distributed(run_cases, pp, todo, backend=backend, env={"OMNITRON_STRICT_COLLECTIVES": "1"})
    for case in todo:
        ref, ref_loss = _reference(pp * case[1], case[2])
        grads = {k: g for res in per_rank for k, g in res[case][0].items()}
        assert sorted(grads) == list(range(len(ref))), case
        for k, want in enumerate(ref):
            for got, w in zip(grads[k], want):
                torch.testing.assert_close(got, w, rtol=0, atol=ATOL, msg=f"{case} stage {k}")
        assert all(abs(res[case][1] - ref_loss) <= ATOL for res in per_rank), case


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=requires_sim())])
def test_every_schedule_and_count_at_pp2(backend):
    _check(2, backend)


@pytest.mark.slow
@requires_sim()
@pytest.mark.parametrize("pp", [3, 4])
def test_every_schedule_and_count_at_pp3_and_pp4_on_sim(pp):
    _check(pp, "sim")
