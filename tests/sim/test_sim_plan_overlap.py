"""The communication ``omnitron plan --assume-overlap all`` hides is the communication the engine runs beside compute.
The reference is a real training step on the sim device (2 ranks), where a collective is in flight from the call
that issues it to the wait that ends it (a synchronous call: its return): the GEMM kernels any thread issues in that
window are the compute it can hide behind (:mod:`tests.sim.overlap_windows`). The plan's claim is read from its
own stage costs of the same flags: a communication is hidden when a pass's time under ``all`` is less than its work
plus that communication."""
from __future__ import annotations

import os

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.sim.overlap_windows import windows

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.slow]
LAYERS = 4
CASES = {"tp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "2"],
         "cp2": ["--context-parallel-size", "2", "--global-batch-size", "2"],
         "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--global-batch-size", "2"],
         "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
         "ep2": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "4"],
         "ep2-combined": ["--num-experts", "4", "--expert-model-parallel-size", "2", "--global-batch-size", "8",
                          "--overlap-moe-expert-parallel-comm"]}


def _argv(root: str, extra: list[str]) -> list[str]:
    """A 4-layer GPT-2 at h64, s32 (every layer MoE where experts are given)."""
    return ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--micro-batch-size", "1", "--num-workers", "0", "--train-iters", "3", "--no-tensorboard",
            "--data-cache-path", os.path.join(root, "cache"), *extra]


def _plan(argv: list[str], tmp_path):
    """(the plan's stage costs under ``all`` of these flags on 2 ranks, their settings), at constant rates with links
    slow enough that every communication could hide behind the work beside it only if the model says it does."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.speed import _stage_costs
    from tests.plan.conftest import _constant_rates

    s = parse_settings(argv, 2)
    return _stage_costs(s, _constant_rates(tmp_path, 0.05, 0.001), "all")[2], s


def _hides(cost, kind: str, key: str) -> bool:
    """Whether the plan hides ``key``'s communication of a pass under ``all`` (its time less than work + all comm)."""
    work, comm, _ = cost._parts(kind)
    d = cost.f if kind == "F" else cost.b
    assert d[key] > 0, (kind, key)
    return cost.total(kind, "all") < work + comm


@pytest.mark.parametrize("case", list(CASES))
def test_plan_hides_what_the_sim_step_runs_beside_compute(case, tmp_path):
    argv = _argv(str(tmp_path), CASES[case])
    ranks = run_distributed(windows, 2, argv, 2, backend="sim", timeout_s=300, env={"OMNITRON_PLAN_CACHE": "off"})
    from omnitron.plan import work
    from omnitron.plan.memory import model_config

    costs, s = _plan(argv, tmp_path)
    for rank, got in enumerate(ranks):
        ran_beside = {}
        for op, group, gemms in got:
            ran_beside.setdefault((op.removesuffix("@bwd"), group), []).append(gemms > 0)
        if case == "tp2":  # every tensor-parallel all-reduce waited where issued; the plan charges it in full
            assert not any(ran_beside[("all_reduce", "tp")])
            assert not _hides(costs[0], "F", "tp") and not _hides(costs[0], "B", "tp")
        elif case == "cp2":  # the ring's hops beside its blocks, but for each backward's last (gradients home)
            sends = ran_beside[("send", "cp")]
            hops_f, hops_b = work.cp_ring(work.local_shapes(model_config(s), 1, 2, 1), 4)
            passes = s.num_microbatches * LAYERS
            assert len(sends) == passes * (len(hops_f) + len(hops_b)), len(sends)
            assert sum(sends) == passes * (len(hops_f) + len(hops_b) - 1), rank
            c = costs[0]
            assert _hides(c, "F", "cp") and _hides(c, "B", "cp")  # the plan: hops beside, the last one exposed
            work_b, comm_b, _ = c._parts("B")
            last = c.b["cp"] - c.ring["B"]
            assert last > 0 and c.total("B", "all") >= work_b + last
        elif case == "cp2-a2a":  # Ulysses' all-to-alls waited where issued
            assert not any(ran_beside[("all_to_all", "cp")]), rank
            assert not _hides(costs[0], "F", "cp") and not _hides(costs[0], "B", "cp")
        elif case == "pp2":  # a send runs beside the sender's next action (the step's last has none: waited at
            # the step's end, while its receiver computes); the message can only arrive a transfer after the pass
            # that sends it, posted early or not: the plan's lag
            assert all(ran_beside[("send", "pp")][:-1]), rank
            kind = "F" if rank == 0 else "B"
            assert _hides(costs[rank], kind, "pp")
            assert costs[rank].lag(kind) == (costs[rank].f if kind == "F" else costs[rank].b)["pp"]
        else:
            a2a = [x for op, group, x in ((o.removesuffix("@bwd"), g, n) for o, g, n in got)
                   if op == "all_to_all" and group == "ep"]
            assert not _hides(costs[0], "F", "ep") and not _hides(costs[0], "B", "ep")
            if case == "ep2":  # each all-to-all waited where issued
                assert not any(a2a), rank
                continue
            # combined pairs: the forward's dispatch and combine and the backward's two run beside the other pass
            # (each MoE layer's token-count exchange stays synchronous), as the plan's pair credit says
            from omnitron.plan.moe_overlap import planned_schedule
            from omnitron.plan.speed import pair_credit

            pairs = len(planned_schedule(s).pairs.get(0, ()))  # one pipeline stage: every rank runs its table
            assert pairs > 0 and sum(x > 0 for x in a2a) == pairs * LAYERS * 4, (rank, pairs, a2a)
            assert pair_credit(costs, "all")(0, 0) > 0
