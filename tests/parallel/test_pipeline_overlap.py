"""DualPipeV's overlapped pairs, read from the runtime's recorded order of posts, waits and computes (the
session's backend, strict NCCL-order checking on as everywhere in the suite): in a pair (forward of one
micro-batch, backward of another), the backward's receive is posted before the forward computes and waited only
after it, and the forward's send is posted before the backward computes and waited only after it. Two
consecutive actions (the runtime before the pairs) post the backward's receive after the forward: the first
assertion fails on them.
"""
import dataclasses

import pytest
import torch

from omnitron.core.parallel.pipeline.p2p import input_message, plan_exchanges
from omnitron.testing.distributed import run_distributed

pytestmark = pytest.mark.multiprocess
SEQ, MBS, HIDDEN = 4, 1, 8


def _step(chunk, batch, hidden):
    return chunk(batch if hidden is None else hidden)  # [s, b, h]; the last stage's output summed as the loss


def trace_worker(m: int) -> dict:
    """This rank's trace of one DualPipeV step, with the pairs and with the same table as consecutive actions."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline import build_schedule, forward_backward

    pp, be = dist.get_world_size(), get_backend()
    dev = be.device()  # the host on cpu; sim tensors on sim (simccl groups take no host tensors)
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=pp), backend=be)
    groups = dataclasses.replace(base, config=ParallelConfig(pipeline_model_parallel_size=pp,
                                                             virtual_pipeline_model_parallel_size=2))
    torch.manual_seed(dist.get_rank())
    chunks = [torch.nn.Linear(HIDDEN, HIDDEN).to(dev) for _ in range(2)]
    paired = build_schedule("dualpipe-v", pp, 2, m)
    out = {}
    for name, schedule in [("paired", paired), ("sequential", dataclasses.replace(paired, pairs={}))]:
        data = iter([torch.randn(SEQ, MBS, HIDDEN).to(dev) for _ in range(m)])
        out[name] = []
        forward_backward(schedule, chunks, data, groups, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS,
                         hidden_size=HIDDEN, forward_step_fn=_step, trace=out[name])
    return out


def _check_pairs(schedule, rank: int, trace: list) -> tuple[int, int]:
    """Assert the overlap of every pair of ``rank``; returns (pairs with a receive, pairs with a send) checked."""
    at = {ev: i for i, ev in enumerate(trace)}
    received = {msg for batch in plan_exchanges(schedule)[rank] for kind, _, msg in batch if kind == "recv"}
    table, counts = schedule.tables[rank], [0, 0]
    for i in sorted(schedule.pairs[rank]):
        f, b = str(table[i]), str(table[i + 1])
        f_end, b_start, b_end = at[("end", "compute", f)], at[("start", "compute", b)], at[("end", "compute", b)]
        grad = input_message(schedule, rank, table[i + 1])
        if grad in received:  # the backward's input is in flight while the forward computes
            assert at[("post", "recv", grad)] < at[("start", "compute", f)], (rank, f, b, "receive posted late")
            assert f_end < at[("wait", "recv", grad)] < b_start, (rank, f, b)
            counts[0] += 1
        k = schedule.stage(rank, table[i].chunk)
        out = ("act", k + 1, table[i].microbatch)
        if ("post", "send", out) in at:  # the forward's output is in flight while the backward computes
            assert f_end < at[("post", "send", out)] < b_start, (rank, f, b)
            assert at[("wait", "send", out)] > b_end, (rank, f, b, "send waited before the backward")
            counts[1] += 1
    return counts[0], counts[1]


@pytest.mark.parametrize("pp,m", [(2, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_dualpipe_v_pairs_overlap_communication_with_compute(pp, m):
    from omnitron.core.parallel.pipeline import build_schedule

    schedule = build_schedule("dualpipe-v", pp, 2, m)
    out = run_distributed(trace_worker, pp, m)
    counts = [_check_pairs(schedule, r, res["paired"]) for r, res in enumerate(out)]
    assert sum(c[0] for c in counts) > 0 and sum(c[1] for c in counts) > 0, counts  # both directions were checked
    # the same table run as consecutive actions (the exchange plan without pairs): the receive comes late
    with pytest.raises(AssertionError, match="receive posted late"):
        for r, res in enumerate(out):
            _check_pairs(schedule, r, res["sequential"])

