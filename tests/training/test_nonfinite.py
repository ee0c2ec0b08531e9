"""--check-for-nan-in-loss-and-grad and --max-consecutive-skipped-iterations: a run that goes non-finite stops
before the optimizer step with a line naming iteration, rank and what, writes no checkpoint of the bad weights
and exits non-zero; clipping is not switched off by a non-finite norm."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim import MixedPrecisionOptimizer
from omnitron.core.optim.clip import clip_coefficient
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.precision import DynamicLossScaler, build_loss_scaler
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.loop import train
from omnitron.core.training.nonfinite import NonFiniteError, TrainingStopped, check_grad_norm
from omnitron.testing.faults import records, start, tiny_train_args


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))


def test_clip_coefficient_is_not_switched_off_by_a_non_finite_norm():
    assert math.isnan(clip_coefficient(float("nan"), 1.0))
    assert clip_coefficient(float("inf"), 1.0) == 0.0
    assert clip_coefficient(float("nan"), 0.0) == 1.0  # --clip-grad 0: clipping is off by request


def test_overflowing_fp32_norm_is_recounted_and_clips():
    """|g| ~ 1e20: fp32 squares overflow (inf) although every gradient is finite; the norm must still be the
    float64 one (rel 1e-6: fp32 gradients, exact float64 squares, one rounding of the sqrt) and clip the step."""
    model = _model(seed=int(torch.randint(0, 2**31 - 1, ())))
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * 1e20).float()
    ref = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, sgd_momentum=0.0, clip_grad=1.0)
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    res = opt.step(1.0)
    assert res.grad_norm == pytest.approx(ref, rel=1e-6)
    # the applied update is the clipped gradient: norm 1 (up to the 1e-6 of clip_coefficient's epsilon)
    moved = math.sqrt(sum(float((b.double() - p.detach().double()).square().sum())
                          for b, p in zip(before, model.parameters())))
    assert moved == pytest.approx(1.0, rel=1e-5)


def test_non_finite_norm_stops_before_the_update():
    model = _model(seed=3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    next(model.parameters()).grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = MixedPrecisionOptimizer(model.named_parameters(), OptimizerConfig(), ParallelGroups.single(),
                                  backend=get_backend("cpu"))
    with pytest.raises(NonFiniteError, match="the gradient norm is nan"):
        opt.step(1e-3, check_norm=check_grad_norm)
    assert opt.step_count == 0 and all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.equal(s, torch.zeros_like(s)) for s in opt.state["exp_avg"])


def _args(tmp_path, *extra):
    return tiny_train_args(tmp_path, "--micro-batch-size", "2", "--global-batch-size", "4", *extra)


def test_bf16_huge_lr_stops_naming_iteration_and_rank(tmp_path):
    save = tmp_path / "ck"
    settings = parse_settings(_args(tmp_path, "--bf16", "--lr", "1e10", "--train-iters", "6", "--save", str(save),
                                    "--save-interval", "1"), 1)
    with pytest.raises(NonFiniteError) as info:
        train(settings, get_backend("cpu"))
    msg = str(info.value)
    m = re.match(r"iteration (\d+), rank 0: the (loss|gradient norm) is (nan|inf)", msg)
    assert m and "before the optimizer step" in msg, msg
    stopped_at = int(m.group(1))
    done = [r["iteration"] for r in records(str(tmp_path / "logs" / "metrics.jsonl"))]
    assert done == list(range(1, stopped_at)) and 2 <= stopped_at < 6
    assert open(save / "latest").read() == f"iter_{stopped_at - 1:07d}"  # nothing at or after the bad step
    assert sorted(os.listdir(save)) == [f"iter_{i:07d}" for i in range(1, stopped_at)] + ["latest"]


def test_non_finite_weights_are_never_saved(tmp_path):
    """--lr 1e39 overflows fp32 in the update itself (finite loss and norm): the save is refused."""
    save = tmp_path / "ck"
    settings = parse_settings(_args(tmp_path, "--lr", "1e39", "--train-iters", "4", "--save", str(save),
                                    "--save-interval", "1"), 1)
    with pytest.raises(NonFiniteError, match=r"^iteration 1, rank 0: a weight is not finite, found before saving: the "
                                             r"checkpoint was not written"):
        train(settings, get_backend("cpu"))
    assert not os.path.exists(save / "iter_0000001") and not os.path.exists(save / "latest")


def test_fp16_skip_limit_stops_with_a_message(tmp_path):
    settings = parse_settings(_args(tmp_path, "--fp16", "--loss-scale", "1e10", "--train-iters", "20",
                                    "--max-consecutive-skipped-iterations", "3", "--no-check-for-nan-in-loss-and-grad"),
                              1)
    with pytest.raises(TrainingStopped, match=r"iteration 3, rank 0: 3 consecutive steps skipped on gradient "
                                              r"overflow \(loss scale 1e\+?10"):
        train(settings, get_backend("cpu"))
    recs = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [r["skipped_iters"] for r in recs] == [1, 1, 1]


def test_two_ranks_stop_together_and_exit_nonzero(tmp_path):
    """fp32 at tp2 under the launcher: both ranks stop at the same iteration, the launcher's first line
    names it, the exit code is 1, and no checkpoint holds the bad step."""
    save = tmp_path / "ck"
    proc = start(_args(tmp_path, "--lr", "1e10", "--train-iters", "6", "--nproc-per-node", "2",
                       "--tensor-model-parallel-size", "2", "--save", str(save), "--save-interval", "1"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, out
    lines = [line for line in out.splitlines() if line.startswith("omnitron train:")]
    m = re.match(r"omnitron train: rank 0 \(pid \d+\) stopped: iteration (\d+), rank 0: the (loss|gradient norm) "
                 r"is (nan|inf)", lines[0])
    assert m, out
    assert lines[1] == "omnitron train: rank 1 stopped the same way", out
    assert "Traceback" not in out
    assert open(save / "latest").read() == f"iter_{int(m.group(1)) - 1:07d}"


def test_fp16_dynamic_scaling_skips_a_non_finite_forward_as_megatron(tmp_path):
    """Megatron's validate_args turns --check-for-nan-in-loss-and-grad off under --fp16 without --loss-scale: a
    forward that overflows fp16 (weights of std 300) is skipped and counted, not a reason to stop. Each line then
    shows a skipped step with a non-finite loss (Megatron's nan iterations), and the scale follows its
    DynamicGradScaler rule: hysteresis 2 keeps 2^32 for the first overflow, halves at the second."""
    overflow = ("--fp16", "--init-method-std", "300", "--train-iters", "3")
    res = train(parse_settings(_args(tmp_path, *overflow), 1), get_backend("cpu"))
    recs = records(str(tmp_path / "logs" / "metrics.jsonl"))
    assert [(r["skipped_iters"], r["nan_iters"]) for r in recs] == [(1, 1)] * 3
    assert [r["loss_scale"] for r in recs] == [2.0 ** 32, 2.0 ** 32, 2.0 ** 31]
    assert res["components"].optimizer.step_count == 0 and res["components"].optimizer.loss_scaler.scale == 2.0 ** 30
    # named, the check is still off under dynamic scaling (as Megatron's validate_args sets it): the same run
    res = train(parse_settings(_args(tmp_path / "named", *overflow, "--check-for-nan-in-loss-and-grad"), 1),
                get_backend("cpu"))
    assert [r["loss_scale"] for r in records(str(tmp_path / "named" / "logs" / "metrics.jsonl"))] == \
        [2.0 ** 32, 2.0 ** 32, 2.0 ** 31]
    with pytest.raises(NonFiniteError, match=r"^iteration 1, rank 0: the loss is nan"):  # a constant scale keeps it
        train(parse_settings(_args(tmp_path / "kept", *overflow, "--loss-scale", "1024"), 1), get_backend("cpu"))


def test_fp16_constant_scale_overflow_stops_under_the_check_as_megatron(tmp_path):
    """With a constant --loss-scale Megatron keeps --check-for-nan-in-loss-and-grad on, and its check of the
    gradients (DDP's check_grads, before its scaler) stops at the first overflow: so does omnitron, before the
    optimizer step and the scaler's update; without the check the step is skipped (previous test)."""
    save = tmp_path / "ck"
    settings = parse_settings(_args(tmp_path, "--fp16", "--loss-scale", "1e10", "--train-iters", "3", "--save",
                                    str(save), "--save-interval", "1"), 1)
    with pytest.raises(NonFiniteError, match=r"^iteration 1, rank 0: the gradient norm is (inf|nan), stopped before"
                       r".*; the gradients were scaled by 1e\+10 \(a smaller --loss-scale") as info:
        train(settings, get_backend("cpu"))
    assert "\n" not in str(info.value)  # one line, naming the scale that overflowed and what to change
    assert not os.path.exists(save / "latest") and records(str(tmp_path / "logs" / "metrics.jsonl")) == []
    # the optimizer alone: weights, step count and the dynamic scaler's trackers as they were
    model = _model(0).half()
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    next(model.parameters()).grad[0, 0] = float("inf")
    scaler = DynamicLossScaler(initial_scale=8.0, hysteresis=1)
    opt = MixedPrecisionOptimizer(model.named_parameters(), OptimizerConfig(), ParallelGroups.single(),
                                  backend=get_backend("cpu"), loss_scaler=scaler)
    with pytest.raises(NonFiniteError, match="the gradient norm is inf"):
        opt.step(1e-3, check_norm=check_grad_norm)
    assert opt.step_count == 0 and scaler.state_dict() == DynamicLossScaler(8.0, hysteresis=1).state_dict()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert opt.step(1e-3).skipped and scaler.scale == 4.0  # no check: skipped, backed off


def test_loss_scale_applies_where_megatron_builds_a_constant_scaler(tmp_path):
    """Megatron's get_megatron_optimizer (d98e8a6) builds ConstantGradScaler(--loss-scale) under --fp16, --bf16 or
    --use-distributed-optimizer, DynamicGradScaler under --fp16 alone, else none. A power-of-two scale is exact in
    bf16 (same exponent range as fp32, far from overflow here): the run is the unscaled one bit for bit, with the
    scale in its records. Non-finite gradients are then skipped without the check (and stop the run with it), where
    without a scaler the step would write NaN weights."""
    def run(path, *extra):
        res = train(parse_settings(_args(tmp_path / path, "--bf16", "--train-iters", "2", *extra), 1),
                    get_backend("cpu"))
        return res, records(str(tmp_path / path / "logs" / "metrics.jsonl"))

    def scaler(*flags):
        s = parse_settings(_args(tmp_path, "--train-iters", "1", *flags), 1)
        return type(build_loss_scaler(s.precision, getattr(s.ddp, "use_distributed_optimizer", False))).__name__
    assert [scaler("--bf16", "--loss-scale", "8"), scaler("--loss-scale", "8"), scaler("--fp16"),
            scaler("--loss-scale", "8", "--use-distributed-optimizer")] == \
        ["ConstantLossScaler", "NoneType", "DynamicLossScaler", "ConstantLossScaler"]
    (plain, plain_recs), (scaled, scaled_recs) = run("plain"), run("scaled", "--loss-scale", "1024")
    assert scaled["losses"] == plain["losses"] and [r["loss_scale"] for r in scaled_recs] == [1024.0] * 2
    assert [r["grad_norm"] for r in scaled_recs] == [r["grad_norm"] for r in plain_recs]
    overflow = ("--loss-scale", "1", "--init-method-std", "1e20")  # a finite loss, non-finite gradients
    _, recs = run("skips", *overflow, "--no-check-for-nan-in-loss-and-grad")
    assert [r["skipped_iters"] for r in recs] == [1, 1] and [r["loss_scale"] for r in recs] == [1.0, 1.0]
    with pytest.raises(NonFiniteError, match=r"^iteration 1, rank 0: the gradient norm is (nan|inf)"):
        run("stops", *overflow)


def test_the_reported_loss_is_the_unscaled_one_as_megatron(tmp_path):
    """Megatron multiplies the loss it differentiates by the scale but reports the loss function's value. At
    --loss-scale 2^127 the scaled fp32 loss sum overflows (~150 x 1.7e38) while the gradients do not (the step is
    taken): the reported loss stays finite and, the scale being a power of two (exact in bf16), the run is the
    unscaled one bit for bit."""
    def run(path, *extra):
        return train(parse_settings(_args(tmp_path / path, "--bf16", "--train-iters", "2", *extra), 1),
                     get_backend("cpu"))["losses"]
    assert run("huge", "--loss-scale", str(2.0 ** 127)) == run("plain")


def test_skip_counter_stops_at_the_limit_th_consecutive_skip_and_a_taken_step_resets_it():
    """--max-consecutive-skipped-iterations counts skips in a row: on random skip / take sequences the counter
    raises at the first iteration closing a run of ``limit`` consecutive skips (reference: the run lengths counted
    in plain Python), never earlier, and a limit of 0 never raises."""
    import random

    from omnitron.core.training.nonfinite import SkipCounter

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(200):
        limit = rng.randrange(0, 5)
        steps = [rng.random() < 0.6 for _ in range(rng.randrange(1, 30))]
        want, run = None, 0
        for i, skipped in enumerate(steps):
            run = run + 1 if skipped else 0
            if limit and run == limit:
                want = i
                break
        counter, got = SkipCounter(limit), None
        for i, skipped in enumerate(steps):
            try:
                counter.update(skipped, i, 0, 1024.0)
            except TrainingStopped as err:
                got = i
                assert f"{limit} consecutive steps skipped" in str(err), (seed, err)
                break
        assert got == want, (seed, limit, steps)


def weights_finite_with_one_bad_rank(cases: list) -> list[bool]:
    """weights_finite on every rank for each case: the rank named there (None: no rank) holds one non-finite
    master among three finite ones."""
    import torch.distributed as dist

    from omnitron.core.training.nonfinite import weights_finite

    be = get_backend()
    device, rank = be.current_device(), dist.get_rank()
    out = []
    for bad in cases:
        flags = [torch.tensor(True, device=device) for _ in range(3)]
        if bad == rank:
            flags[1] = torch.tensor(False, device=device)
        out.append(weights_finite(flags, be.collectives, device))
    return out


def test_weights_finite_is_false_on_every_rank_when_any_rank_holds_a_non_finite_master(backend_name):
    """The weight check before a save is one verdict for all ranks (else one rank stops and the others wait in the
    save's collectives): False everywhere when any one rank's masters are not all finite, True only when every
    rank's are (reference: the definition, every flag of every rank true). 3 ranks, each rank bad in turn."""
    from omnitron.testing.distributed import run_distributed

    cases = [None, 0, 1, 2]
    results = run_distributed(weights_finite_with_one_bad_rank, 3, cases, backend=backend_name, timeout_s=120)
    assert results == [[bad is None for bad in cases]] * 3, results


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_an_infinite_or_nan_loss_stops_and_a_finite_one_does_not(value):
    """check_loss stops on every non-finite loss, an overflow to +-inf as well as NaN (reference: math.isfinite),
    and lets a finite one through, however large; switched off, nothing stops."""
    from omnitron.core.training.nonfinite import check_loss

    with pytest.raises(NonFiniteError, match=f"the loss is {value}"):
        check_loss(value, True)
    check_loss(value, False)
    check_loss(1e308, True)
