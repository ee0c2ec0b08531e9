"""The memory plan under --overlap-moe-expert-parallel-comm (omnitron/plan/moe_overlap.py): a combined pair's replay
against hand-derived logs, the schedule walk with pairs by hand, and whole training steps against what they really
allocate (``train_step_peak``) at ep2 and ep2 x pp2, on the backend under test."""
from __future__ import annotations

import pytest

from omnitron.core.parallel.pipeline.combined import combine_1f1b
from omnitron.core.parallel.pipeline.schedules import build_schedule
from omnitron.plan.memory import peak_held
from omnitron.plan.moe_overlap import pair_excess, pair_peak
from omnitron.plan.transients import EXPERTS, EXPERTS_END, EXPERTS_FORWARD, EXPERTS_FORWARD_END, FORWARD_END
from omnitron.testing.distributed import run_distributed
from tests.plan.test_transients import _args, _check_step, step_peaks

# One MoE layer's forward and backward, by hand: attention saves a (10) beside a temporary (5), the experts e (20),
# after the combine u (3); backward makes the head's gradient g (8), frees u, the experts' gradient ge (6) while e
# is freed, then frees ge, g and a. Plain peak: 33 saved + g 8 + ge 6 - u 3 = 44.
_MOE_LAYER = [("a", 10), ("t", 5), (None, 1), (EXPERTS_FORWARD, 0), ("e", 20), (EXPERTS_FORWARD_END, 0), ("u", 3),
              (FORWARD_END, 0), ("g", 8), (None, 6), (EXPERTS, 0), ("ge", 6), (None, 4), (EXPERTS_END, 0),
              (None, 11), (None, 8), (None, 0)]


def _log(events):
    """(events, sizes) as the plan replays them."""
    return events, [float(n) for _, n in events]


def _dense():
    """``_MOE_LAYER`` without its marks (a chunk without MoE layers), its frees renumbered."""
    kept = [i for i, (op, _) in enumerate(_MOE_LAYER)
            if op not in (EXPERTS_FORWARD, EXPERTS_FORWARD_END, EXPERTS, EXPERTS_END)]
    index = {i: j for j, i in enumerate(kept)}
    return [(None, index[n]) if op is None else (op, n) for op, n in (_MOE_LAYER[i] for i in kept)]


def test_pair_replays_the_passes_in_turns_backward_first():
    """By hand (live bytes after each segment): the backward's micro-batch whole, 33; its head's gradient and u
    freed, 38; the forward's attention and temporary, 53 then 48; the backward's experts' gradient, 54 (the peak),
    e freed, 34; the forward's experts, 54; the rest. 54 - 44 = 10 over the plain peak. Run the forward first
    instead and the head's gradient lands on 48: 56, so the order is what is checked, as is that the pair is less
    than two micro-batches held whole (33 + 44 = 77)."""
    log = _log(_MOE_LAYER)
    assert pair_peak(log, log) == 54.0
    assert pair_excess(log, log) == 10.0


def test_pair_without_all_to_alls_on_one_side_runs_it_whole_at_its_turn():
    """A forward chunk with no MoE layer (no hand-over) runs whole after the backward's first segment: 38 + 33 =
    71, then the backward's experts' gradient: 77, 33 over the plain 44. A backward chunk with none runs whole
    first (its plain 44, down to 0), then the forward: nothing over."""
    assert pair_peak(_log(_MOE_LAYER), _log(_dense())) == 77.0
    assert pair_excess(_log(_MOE_LAYER), _log(_dense())) == 33.0
    assert pair_excess(_log(_dense()), _log(_MOE_LAYER)) == 0.0


def test_schedule_walk_holds_a_pair_as_the_held_micro_batches_and_its_excess():
    """No pipelining, 4 micro-batches combined (F0, then F1 with B0, F2 with B1, F3 with B2, B3): the peak is one
    micro-batch (100) and the pair's 7, two micro-batches in flight; 1F1B at pp2, rank 0 of 8 micro-batches
    warms up 3 forwards (``pp - r`` more than 1F1B's 1) and pairs the fourth: 300 + 7, 4 in flight; the logits'
    walk (no excess) holds what was held before the pair: 300."""
    plain = combine_1f1b(build_schedule(None, 1, None, 4))
    assert peak_held(plain, 0, {0: 100.0}, pairs={(0, 0): 7.0}) == (107.0, 2)
    pp2 = combine_1f1b(build_schedule("1f1b", 2, None, 8))
    assert peak_held(pp2, 0, {0: 100.0}, pairs={(0, 0): 7.0}) == (307.0, 4)
    assert peak_held(pp2, 0, {0: 100.0})[0] == 300.0
    assert peak_held(build_schedule("1f1b", 2, None, 8), 0, {0: 100.0}, pairs={(0, 0): 7.0}) == (200.0, 2)


@pytest.mark.parametrize("fp8", [["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                                 ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
                                 ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]],
                         ids=["tensorwise", "delayed", "blockwise"])
def test_the_pair_replays_the_fp8_log_the_plain_peak_does(fp8, tmp_path):
    """Under FP8 the pair replays the probe's log as the FP8 linears run it (``fp8_memory.fp8_log``: their saved
    inputs and scales per recipe, their passes' own tensors, the wide inputs they let go), the log whose peak the
    plain transient term takes (``replay_fp8``): the two peaks are equal, the log keeps every mark the pair cuts
    at, in order, and the pair holds at least the plain peak (its backward runs every event of the plain one)."""
    from omnitron.kernels.alloc_log import peak
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import memory
    from omnitron.plan.fp8_memory import chunk_linears, fp8_log, replay_fp8
    from omnitron.plan.fp8_moe import experts_as_run

    s = parse_settings(_args(str(tmp_path), [*_EP2, "--global-batch-size", "8", "--bf16", *fp8]), 2)
    cfg = experts_as_run(s, memory.priced_config(s, memory.model_config(s)))
    wide = memory._probe_log(s, cfg, 2, True, True, True, False)
    linears = chunk_linears(s, cfg, 0)[0]
    log = fp8_log(s, cfg, *wide, linears, False, 2)
    assert peak(*log) == replay_fp8(s, cfg, *wide, linears, False, 2)[0]
    marks = (EXPERTS, EXPERTS_END, EXPERTS_FORWARD, EXPERTS_FORWARD_END, FORWARD_END)
    assert [op for op, _ in log[0] if op in marks] == [op for op, _ in wide[0] if op in marks]
    assert pair_peak(log, log) >= peak(*log) and pair_excess(log, log) > 0


_EP2 = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--expert-model-parallel-size",
        "2", "--overlap-moe-expert-parallel-comm"]


def _check_overlap(tmp_path, world: int, extra: list[str]) -> None:
    """``_check_step``'s 10% bound on every rank (dropless routing moves a rank's rows, and so its peak, by a few
    percent: measured 2026-12-07 +-2%). Before the pair was modelled the plan priced the plain schedule: at ep2
    -12.5% / -9.6% (sim), -12.7% / -10.5% (cpu) under the step peaks, at ep2 x pp2 -38% on stage 0, whose 1F1B
    warm-up the combined table deepens (4 micro-batches in flight against 2); walking the combined table with each
    pair's two micro-batches held whole puts it about one micro-batch over (+70% at ep2)."""
    args = _args(str(tmp_path), _EP2 + extra)
    measured = run_distributed(step_peaks, world, [args], world, str(tmp_path),
                               env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    _check_step(args, world, [rank[0] for rank in measured], rel=0.10)


@pytest.mark.multiprocess
def test_step_peak_with_the_overlap_at_ep2(tmp_path):
    """4 GPT-2 MoE layers (8 experts, top 2, h128, s128), ep2 over 2 ranks, 4 micro-batches of 1."""
    _check_overlap(tmp_path, 2, ["--global-batch-size", "8"])


# The FP8 ep2 case's bound, counted from shapes (h = 128, s = 128, b = 1, top-2: A = s k = 256 assignment rows
# leave a rank per MoE layer; --bf16: e = 2 bytes). At --moe-expert-capacity-factor 1.0 with padding to capacity
# every local expert's rows are the capacity's whatever the router picks (as test_transients'
# test_step_peak_moe_two_ranks), so the plan's balanced routing is exact and no routing noise enters. What the plan
# leaves out, each bounded by its bytes:
# - the step's work besides the chunk's forward and backward: _check_step's two [s, b, h] fp32 tensors, 128 KiB;
# - the dispatch exchange's send and receive buffers, 2 [A, h] e = 128 KiB, which gloo's worker may drop after
#   wait() returns or hold at the peak (test_step_peak_moe_two_ranks; 2026-12-07, the block-wise step without the
#   overlap measured its two ranks exactly one [A, h] bf16 apart, 65,536 bytes);
# - the all-to-alls in flight at a hand-over of the pair (plan/moe_overlap.py: not modelled), the other
#   micro-batch's dispatch send and receive, 2 [A, h] e = 128 KiB more.
# EXCHANGE = 2 [A, h] e: the absolute check allows EXCHANGE x 2 on top of _check_step's 128 KiB; the overlap's
# extra (the step peak with the overlap less the same step without it, same weights, data and rows: the rest of
# the step cancels) allows the hand-over's EXCHANGE and each run's exchange held or not, EXCHANGE x 3. Dropping
# the pair from the plan (the estimate of the plain schedule) is 1.38 MB under: 1.2 MB under the tensorwise step
# here, and -8.0% to -9.7% under the dropless steps, which the 10% bound these cases had passed.
_S, _H, _K, _E = 128, 128, 2, 2
EXCHANGE = 2 * (_S * _K) * _H * _E


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("fp8", [
    ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"],
    pytest.param(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"], marks=pytest.mark.xfail(
        strict=True, reason="block-wise, the overlap's extra is priced 1.33 MB where the step holds 0.83 MB "
                            "(measured 2026-12-07 on cpu; the step itself +369 KB, inside its slack): the pair "
                            "replays the FP8 log (plan/moe_overlap.py), which took 53 KB off the wide log's 1.38 "
                            "MB; the rest is not FP8's: a Timeline of the real steps puts both peaks in the top "
                            "layer's experts' backward, the plain one at two [512, 128] fp32 clones (expert weight "
                            "gradients) 0.26 MB higher over the forward's end than the replay's, the pair's 0.24 MB "
                            "lower, while the pair's first segments match (+1.16 MB real, +1.20 MB replayed)"))],
    ids=["tensorwise", "delayed", "blockwise"])
def test_step_peak_with_the_overlap_at_ep2_fp8(fp8, tmp_path):
    """The ep2 case with FP8 experts (bf16) at routing padded to capacity (the bound above, derived): every rank's
    step peak against the estimate, and what the overlap adds (the same step's peak without it subtracted) against
    what the plan's combined pair adds. Measured 2026-12-07 on cpu, the pair replaying the FP8 log: tensorwise and
    delayed +220 KB on the step (slack 384 KiB), the extra priced 230 KB over (slack 384 KiB); block-wise +369 KB
    and 501 KB over (the expected failure). Replaying the wide log: tensorwise +176 KB and 185 KB over; block-wise
    +422 KB and 555-620 KB over."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import fp8_state_bytes
    from omnitron.plan.memory import estimate, model_config

    base = [*_EP2[:-1], "--global-batch-size", "8", "--bf16", "--moe-expert-capacity-factor", "1.0",
            "--moe-pad-expert-input-to-capacity", *fp8]
    argvs = [_args(str(tmp_path), [*base, _EP2[-1]]), _args(str(tmp_path), base)]  # with the overlap, without
    measured = run_distributed(step_peaks, 2, argvs, 2, str(tmp_path),
                               env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    _check_step(argvs[0], 2, [rank[0] for rank in measured], slack=2 * EXCHANGE)
    predicted = []
    for args in argvs:
        s = parse_settings(args, 2)
        e = estimate(s)[0]
        predicted.append(e.total - e.params - e.grads - e.optimizer - fp8_state_bytes(s, model_config(s), 0))
    for rank in measured:
        extra = rank[0][1] - rank[1][1]
        print(f"overlap's extra: predicted {predicted[0] - predicted[1]}, measured {extra}")
        assert abs(predicted[0] - predicted[1] - extra) <= 3 * EXCHANGE, (predicted, rank)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_step_peak_with_the_overlap_at_ep2_pp2(tmp_path):
    """The same at pp2 (4 ranks, 1F1B combined), 8 micro-batches of 1 a pipeline."""
    _check_overlap(tmp_path, 4, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "16"])
