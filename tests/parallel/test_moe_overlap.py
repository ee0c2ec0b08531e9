"""--overlap-moe-expert-parallel-comm (Megatron's combined 1F1B): in the steady state of the schedule one
micro-batch's forward and another's backward run in turns, each one's MoE all-to-alls (forward dispatch /
combine and their backward all-to-alls) in flight while the other computes.

Every pass executes the same operations on the same data as without the flag, the backwards run in the same
order and the forwards draw their dropout masks in the same order (backward draws none), so losses and every
gradient are equal bit for bit (no floating add is reordered: no bound is needed), at ep2 and ep2 x pp2 (1F1B
and interleaved), on cpu and on sim (where reading an all-to-all's output before its wait raises). The order
test reads the recorded issue / wait / hand-over events and fails when a backward all-to-all is waited without
the other micro-batch's forward having run in between (as it does with the hand-over removed)."""
from __future__ import annotations

import os

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.combined import combine_1f1b
from omnitron.core.parallel.pipeline.p2p import nccl_order_makespan
from omnitron.core.parallel.pipeline.schedules import build_schedule
from omnitron.core.parallel.pipeline.simulate import simulate
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

ITERS = 2
OVERLAP = ("--overlap-moe-expert-parallel-comm",)


def _args(root: str, micro_batches: int, extra=()) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
            "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", str(4 * micro_batches),
            "--log-interval", str(ITERS), "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"),
            "--lr", "1e-2", "--train-iters", str(ITERS), "--clip-grad", "1.0", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2",
            "--hidden-dropout", "0.1", *extra]


def train_moe(root: str, micro_batches: int, extra: tuple, record: bool = False, no_handoff: bool = False) -> dict:
    """Worker: train at ep2 with ``extra`` flags; the losses, the last step's gradients by parameter name, the
    schedule's name and (``record``) the overlap's recorded events. ``no_handoff``: the pair's passes run one
    after the other (the order test's counter-example)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train
    from omnitron.core.transformer.moe import overlap

    torch.set_num_threads(1)
    if no_handoff:
        overlap.handoff = lambda: None
    settings = parse_settings(_args(os.path.join(root, str(extra)), micro_batches, extra), dist.get_world_size())
    with overlap.recording() if record else contextlib.nullcontext() as events:
        res = train(settings, get_backend())
    grads = {f"{i}.{n}": (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().cpu().clone()
             for i, m in enumerate(res["components"].modules) for n, p in m.named_parameters()}
    return {"losses": res["losses"], "grads": grads, "schedule": res["components"].schedule.name,
            "events": events}


def _check_equal(backend: str, tmp_path, world: int, micro_batches: int, extra=()) -> None:
    plain = run_distributed(train_moe, world, str(tmp_path), micro_batches, tuple(extra), backend=backend)
    combined = run_distributed(train_moe, world, str(tmp_path), micro_batches, (*extra, *OVERLAP), backend=backend)
    assert combined[0]["schedule"] == plain[0]["schedule"] + "+combined"
    for p, q in zip(plain, combined):
        assert len(p["losses"]) == ITERS and q["losses"] == p["losses"], "the combined pairs changed the losses"
        assert p["grads"].keys() == q["grads"].keys()
        for name, g in p["grads"].items():
            assert g.dtype == q["grads"][name].dtype and bool((g == q["grads"][name]).all()), name


@pytest.mark.multiprocess
def test_combined_keeps_losses_and_gradients_at_ep2_on_cpu(tmp_path):
    _check_equal("cpu", tmp_path, 2, 3)


@requires_sim()
@pytest.mark.multiprocess
def test_combined_keeps_losses_and_gradients_at_ep2_on_sim(tmp_path):
    _check_equal("sim", tmp_path, 2, 3)


@requires_sim()
@pytest.mark.multiprocess
def test_combined_with_selective_recomputation_at_ep2_on_sim(tmp_path):
    """Megatron runs the overlap under selective recomputation (it refuses full recomputation and moe among
    --recompute-modules only): the recomputed core attention, its dropout mask drawn again from the saved
    generator state, keeps losses and gradients bit for bit while the other micro-batch's forward draws between."""
    _check_equal("sim", tmp_path, 2, 3, ("--recompute-granularity", "selective", "--attention-dropout", "0.1"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_combined_keeps_losses_and_gradients_at_ep2_pp2_1f1b_on_cpu(tmp_path):
    _check_equal("cpu", tmp_path, 4, 4, ("--pipeline-model-parallel-size", "2"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=requires_sim())])
def test_combined_keeps_losses_and_gradients_at_ep2_pp2_interleaved(tmp_path, backend):
    _check_equal(backend, tmp_path, 4, 4, ("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                           "--num-layers-per-virtual-pipeline-stage", "1"))


@pytest.mark.slow
@requires_sim()
@pytest.mark.multiprocess
def test_combined_keeps_losses_and_gradients_at_ep2_pp2_1f1b_on_sim(tmp_path):
    _check_equal("sim", tmp_path, 4, 4, ("--pipeline-model-parallel-size", "2"))


def _pairs(events: list) -> list[list]:
    """The recorded events cut at each pair's start."""
    starts = [i for i, ev in enumerate(events) if ev == ("pair", "start")] + [len(events)]
    return [events[a:b] for a, b in zip(starts, starts[1:])]


def _check_overlap(events: list) -> int:
    """Assert that while each all-to-all of a pair is in flight the other pass ran and issued one of its own (it
    computed in between), as long as the other pass had one left to issue; returns how many windows were
    checked."""
    checked = 0
    for pair in _pairs(events):
        at = {ev: i for i, ev in enumerate(pair)}
        for side, other in (("B", "F"), ("F", "B")):
            last = max((i for i, ev in enumerate(pair) if ev[:2] == ("issue", other)), default=-1)
            for i, ev in enumerate(pair):
                if ev[:2] != ("issue", side) or i > last:  # not an issue, or the other pass has none left
                    continue
                window = pair[i + 1:at[("wait", side, ev[2])]]
                assert ("run", other) in window and any(e[:2] == ("issue", other) for e in window), \
                    (f"{side} all-to-all {ev[2]} was waited before the other micro-batch computed", window)
                checked += 1
    return checked


@pytest.mark.multiprocess
def test_backward_all_to_all_in_flight_while_the_other_forward_computes(tmp_path):
    out = run_distributed(train_moe, 2, str(tmp_path), 2, OVERLAP, True)
    checked = [_check_overlap(r["events"]) for r in out]
    assert all(c >= 2 * ITERS * 3 for c in checked), checked  # a pair a step; 2 MoE layers x 2 all-to-alls a pass
    bare = run_distributed(train_moe, 2, str(tmp_path / "bare"), 2, OVERLAP, True, True)
    with pytest.raises(AssertionError, match="waited before the other micro-batch computed"):
        _check_overlap(bare[0]["events"])


@pytest.mark.parametrize("name,pp,vp", [("none", 1, 1), ("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2),
                                        ("interleaved", 4, 2)])
@pytest.mark.parametrize("m", [4, 8])
def test_combined_tables(name, pp, vp, m):
    """Same work, backwards in the same order, every pair's passes independent (the backward's forward ran
    earlier), deadlock-free, no slower than the plain table on the ideal clock and under NCCL's in-order rule,
    at most twice its micro-batches held."""
    plain = build_schedule(name, pp, vp, m)
    combined = combine_1f1b(plain)
    assert combined.combined and sum(map(len, combined.pairs.values())) > 0  # m == pp too: later ranks pair
    for r, table in combined.tables.items():
        assert [a for a in table if a.kind == "B"] == [a for a in plain.tables[r] if a.kind == "B"]
        assert sorted(map(str, table)) == sorted(map(str, plain.tables[r]))
        for i in combined.pairs[r]:
            f, b = table[i], table[i + 1]
            assert (f.chunk, f.microbatch) != (b.chunk, b.microbatch) and table.index(
                type(b)(b.chunk, "F", b.microbatch)) < i
    t, t0 = simulate(combined), simulate(plain)
    assert t.makespan <= t0.makespan and nccl_order_makespan(combined) <= nccl_order_makespan(plain)
    assert max(t.peak_inflight.values()) <= 2 * max(t0.peak_inflight.values())


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_dualpipe_v_pairs_combined(pp, m):
    """DualPipeV's own pairs, combined: deadlock-free on the ideal clock and under NCCL's in-order rule, at most
    pp - 1 units longer than the plain table (its forward's output now leaves at the pair's end)."""
    plain = build_schedule("dualpipe-v", pp, 2, m)
    combined = combine_1f1b(plain)
    assert combined.combined and combined.pairs == plain.pairs and combined.tables == plain.tables
    assert simulate(combined).makespan <= simulate(plain).makespan + pp - 1
    assert nccl_order_makespan(combined) <= nccl_order_makespan(plain) + pp - 1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_combined_keeps_losses_and_gradients_at_ep2_pp2_dualpipe_v_on_cpu(tmp_path):
    _check_equal("cpu", tmp_path, 4, 4, ("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                           "--num-layers-per-virtual-pipeline-stage", "1",
                                           "--pipeline-schedule", "dualpipe-v"))


@pytest.mark.parametrize("extra, message", [
    (("--expert-model-parallel-size", "1"), "needs --num-experts and --expert-model-parallel-size >= 2"),
    (("--recompute-granularity", "full", "--recompute-method", "uniform"), "drop one"),
    (("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"),
     "drop moe from --recompute-modules"),
    (("--moe-token-dispatcher-type", "allgather"), "use --moe-token-dispatcher-type alltoall"),
    (("--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-overlap"),
     "drop --moe-shared-expert-overlap"),
    (("--position-embedding-type", "rope", "--mtp-num-layers", "2"), "at most one MTP layer"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"),
     "--overlap-moe-expert-parallel-comm pairs the forwards and backwards of --pipeline-schedule none, 1f1b, "
     "interleaved, dualpipe-v, not zb-h1"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v", "--num-layers", "4",
      "--num-layers-per-virtual-pipeline-stage", "1"), "not zb-v; use one of those or drop the flag"),
])
def test_refused_layouts(tmp_path, extra, message):
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match=message):
        parse_settings(_args(str(tmp_path), 2, (*OVERLAP, *extra)), 4)


@pytest.mark.parametrize("extra", [("--moe-token-dispatcher-type", "alltoall"), ("--moe-token-dispatcher-type", "flex"),
                                   ("--recompute-granularity", "selective", "--recompute-modules", "core_attn"),
                                   ("--position-embedding-type", "rope", "--mtp-num-layers", "1")])
def test_megatron_accepted_layouts(tmp_path, extra):
    """What Megatron runs beside the overlap is not refused (its refusals above are the exceptions)."""
    from omnitron.core.training.arguments import parse_settings

    assert parse_settings(_args(str(tmp_path), 2, (*OVERLAP, *extra)), 4).parallel.overlap_moe_expert_parallel_comm


HANDOVER_LIMIT_S = 60.0
"""The hand-over checks take milliseconds; a lost hand-over (a backward never resumed, an abort that waits on a
helper that never ends) blocks for ever: past this, the test fails naming it (the 2-core CI machine's load can
slow a thread switch by seconds, never by a minute)."""


def _within_limit(check) -> None:
    """Run ``check`` in a daemon thread; fail in a line if it has not ended within HANDOVER_LIMIT_S, else re-raise
    its error."""
    import threading

    errors = []

    def run():
        try:
            check()
        except BaseException as err:  # noqa: BLE001  re-raised in the test's thread
            errors.append(err)

    thread = threading.Thread(target=run, name="combined-turns-check", daemon=True)
    thread.start()
    thread.join(HANDOVER_LIMIT_S)
    if thread.is_alive():
        pytest.fail(f"run_combined hung for {HANDOVER_LIMIT_S:.0f} s: a hand-over or an abort never came back "
                    "(the pair's semaphores)", pytrace=False)
    if errors:
        raise errors[0]


def test_run_combined_turns_and_errors():
    """The hand-over protocol alone: the backward starts, the two alternate at each hand-over, the forward's
    result comes back; a backward's error reaches the caller; a forward's error ends the paused backward."""
    _within_limit(_check_combined_turns_and_errors)


def _check_combined_turns_and_errors():
    import threading

    from omnitron.core.transformer.moe import overlap

    order = []

    def side(name: str, turns: int, fail_at: int | None = None):
        def run():
            for i in range(turns):
                if i == fail_at:
                    raise ValueError(f"{name} failed")
                order.append(f"{name}{i}")
                overlap.handoff()
            return name
        return run

    assert overlap.run_combined(side("F", 3), side("B", 2)) == "F"
    assert order == ["B0", "F0", "B1", "F1", "F2"]
    with pytest.raises(ValueError, match="B failed"):
        overlap.run_combined(side("F", 3), side("B", 3, fail_at=1))
    before = threading.active_count()
    with pytest.raises(ValueError, match="F failed"):
        overlap.run_combined(side("F", 3, fail_at=1), side("B", 3))
    assert threading.active_count() <= before and overlap._active is None
    overlap.handoff()  # outside a pair: nothing
