"""The mixed-precision flags against Megatron-LM's own ``validate_args`` (d98e8a6; fixtures written by its code,
``tests/data/megatron_precision/make_fixtures.py``): the gradient accumulation dtype (``--bf16`` with
``--grad-reduce-in-bf16`` and ``--accumulate-allreduce-grads-in-fp32``), the non-finite check under fp16 loss
scaling, and the loss scaler's settings, each as Megatron sets them, with the warnings it gives."""
from __future__ import annotations

import json
import logging
import pathlib

import pytest

from omnitron.core.precision.loss_scaler import params_dtype
from omnitron.core.training.arguments import parse_settings

FIXTURES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "megatron_precision" /
                       "fixtures.json").read_text())
BASE = FIXTURES["model"] + ["--mock-data"]


def _ours(flags: list[str]) -> dict:
    s = parse_settings(BASE + flags, 1)
    p = s.precision
    return {"accumulate_allreduce_grads_in_fp32": s.ddp.accumulate_allreduce_grads_in_fp32,
            "grad_reduce_in_bf16": s.ddp.grad_reduce_in_bf16,
            "check_for_nan_in_loss_and_grad": s.training.check_for_nan_in_loss_and_grad,
            "loss_scale": p.loss_scale, "initial_loss_scale": p.initial_loss_scale,
            "min_loss_scale": p.min_loss_scale, "loss_scale_window": p.loss_scale_window, "hysteresis": p.hysteresis,
            "clip_grad": s.optim.clip_grad, "params_dtype": str(params_dtype(p)).replace("torch.", "")}


@pytest.mark.parametrize("flags", sorted(FIXTURES["cases"]))
def test_precision_settings_are_megatrons(flags, caplog):
    """Each case's settings equal Megatron's after validate_args; where Megatron warns that it turned the
    non-finite check off, omnitron says so in its log too. Failed before: --bf16 --grad-reduce-in-bf16
    --accumulate-allreduce-grads-in-fp32 was refused (Megatron lets --grad-reduce-in-bf16 win)."""
    want = dict(FIXTURES["cases"][flags])
    warned = want.pop("warnings")
    with caplog.at_level(logging.INFO, logger="omnitron"):
        got = _ours(flags.split())
    assert got == want
    said = any("--check-for-nan-in-loss-and-grad is off" in r.getMessage() for r in caplog.records)
    assert said == any("check_for_nan_in_loss_and_grad to False" in w for w in warned)


def test_bf16_grad_reduce_wins_over_fp32_accumulation_and_says_so(caplog):
    """Megatron drops --accumulate-allreduce-grads-in-fp32 under --bf16 --grad-reduce-in-bf16 without a word (the
    fixture shows no warning); omnitron does the same with one warning line naming both flags."""
    with caplog.at_level(logging.WARNING, logger="omnitron"):
        ddp = parse_settings(BASE + ["--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], 1).ddp
    assert not ddp.accumulate_allreduce_grads_in_fp32 and ddp.grad_reduce_in_bf16
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "--accumulate-allreduce-grads-in-fp32 is off: --grad-reduce-in-bf16" in lines[0]


@pytest.mark.parametrize("named", [["--check-for-nan-in-loss-and-grad"], []])
def test_fp16_dynamic_scaling_turns_the_check_off_even_when_named(named, caplog):
    """Megatron has no flag that turns the check on (only --no-check-for-nan-in-loss-and-grad) and validate_args
    turns it off under --fp16 without --loss-scale whatever the settings held: omnitron's own
    --check-for-nan-in-loss-and-grad is overridden the same way (kept, it stopped the run at the first overflow,
    iteration 1 at the initial scale 2^32), with a warning when it was named."""
    want = FIXTURES["cases"]["--fp16"]
    with caplog.at_level(logging.INFO, logger="omnitron"):
        got = _ours(["--fp16", *named])
    assert got["check_for_nan_in_loss_and_grad"] is want["check_for_nan_in_loss_and_grad"] is False
    level = max(r.levelno for r in caplog.records if "--check-for-nan-in-loss-and-grad is off" in r.getMessage())
    assert level == (logging.WARNING if named else logging.INFO)


@pytest.mark.parametrize("case", range(len(FIXTURES["scalers"])))
def test_dynamic_loss_scale_follows_megatrons_scaler(case):
    """--initial-loss-scale, --min-loss-scale, --loss-scale-window and --hysteresis: omnitron's scaler, built from
    the flags as the run builds it, over the overflow sequence Megatron's own DynamicGradScaler saw, gives its
    scale after every update (its hysteresis counter is reset only by a growth, so once run down every later
    overflow halves). Tolerance 1e-7 relative: Megatron keeps the scale in a float32 tensor, so a --min-loss-scale
    like 0.3 is 0.3 rounded to float32 (2^-24 relative), and doublings and halvings are exact."""
    from omnitron.core.precision import build_loss_scaler

    f = FIXTURES["scalers"][case]
    flags = ["--fp16", "--initial-loss-scale", repr(f["initial"]), "--min-loss-scale", repr(f["min"]),
             "--loss-scale-window", str(f["window"]), "--hysteresis", str(f["hysteresis"])]
    scaler = build_loss_scaler(parse_settings(BASE + flags, 1).precision)
    got = []
    for inf in f["found_inf"]:
        scaler.update(inf)
        got.append(scaler.scale)
    assert got == pytest.approx(f["scales"], rel=1e-7)
