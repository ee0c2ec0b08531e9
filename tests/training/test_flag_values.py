"""Values a run cannot mean stop the command line in one line naming the flag, where they used to be accepted
(found by fuzzing ``omnitron train`` command lines, 2026-12-07): NaN anywhere (every range check written as a
comparison let it through), sizes of 0 read as "not given" or negative ones that failed in the model build, and
optimizer values that the reference implementations (torch's AdamW / SGD / ``normal_``, Megatron's scheduler
and loss scaler) refuse."""
from __future__ import annotations

import importlib.util
import math
import os
import random
import re
import sys
import types

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import options, parse_settings

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
MEGATRON = "/tmp/megatron"


def _megatron_module(relpath: str, monkeypatch):
    """One module of Megatron-Core's source, loaded alone (importing megatron.core takes a minute here); its one
    megatron import, ``megatron.core.utils.log_single_rank``, is a stub that logs nothing."""
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "megatron.core.utils", utils)
    spec = importlib.util.spec_from_file_location(relpath.replace("/", "_"), os.path.join(MEGATRON, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nan_is_refused_for_every_float_flag():
    """Every float flag, drawn afresh: NaN stops the command line naming it (``--min-loss-scale nan --fp16`` ran
    with every step skipped, ``--moe-aux-loss-coeff nan`` without the balancing loss, both silently)."""
    floats = sorted(o.flag for o in options().values() if o.kind == "float")
    for flag in random.sample(floats, 8) + ["--min-loss-scale", "--initial-loss-scale", "--clip-grad"]:
        with pytest.raises(ConfigError, match=f"^{flag} nan: not a number"):
            parse_settings(BASE + [flag, "nan"], 1)


@pytest.mark.parametrize("extra, flag", [
    (["--num-experts", "4", "--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff"),  # a list of numbers
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss", "--moe-aux-loss-coeff",
      "0.01", "NaN"], "--moe-aux-loss-coeff"),
    (["--norm-epsilon", "nan"], "--norm-epsilon"),  # Megatron's aliases
    (["--lr-warmup-fraction", "nan"], "--lr-warmup-fraction"),
])
def test_nan_is_refused_in_lists_and_aliases(extra, flag):
    with pytest.raises(ConfigError, match=f"^{flag} nan: not a number"):
        parse_settings(BASE + extra, 1)


def test_nan_in_a_config_file_is_refused(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("moe-router-bias-update-rate: .nan\n")
    with pytest.raises(ConfigError, match=r"^--moe-router-bias-update-rate nan \(in --config .*run.yaml\)"):
        parse_settings(BASE + ["--config", str(cfg)], 1)
    cfg.write_text("moe-router-bias-update-rate: 0.01\nclip-grad: .inf\n")  # a number, even infinite, is a number
    assert math.isinf(parse_settings(BASE + ["--config", str(cfg)], 1).optim.clip_grad)


@pytest.mark.skipif(not os.path.isdir(MEGATRON), reason="Megatron-LM's source is not unpacked here")
def test_megatrons_loss_scaler_refuses_nan_as_omnitron_does(monkeypatch):
    """The independent side: Megatron's DynamicGradScaler asserts its scales are > 0, which NaN fails."""
    DynamicGradScaler = _megatron_module("megatron/core/optimizer/grad_scaler.py", monkeypatch).DynamicGradScaler
    for initial, minimum in ((float("nan"), 1.0), (2.0 ** 16, float("nan"))):
        with pytest.raises(AssertionError):
            DynamicGradScaler(initial_scale=initial, min_scale=minimum, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=1000, hysteresis=2)
    for flag in ("--initial-loss-scale", "--min-loss-scale"):
        with pytest.raises(ConfigError, match=f"^{flag} nan"):
            parse_settings(BASE + ["--fp16", flag, "nan"], 1)


@pytest.mark.parametrize("flag", ["--num-query-groups", "--kv-channels", "--ffn-hidden-size", "--padded-vocab-size"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_a_model_size_given_as_zero_or_negative_is_refused(flag, value):
    """0 was read as not given (``--num-query-groups 0`` trained multi-head attention, ``--padded-vocab-size 0``
    padded per --make-vocab-size-divisible-by), -1 failed in the model build with a negative tensor dimension."""
    with pytest.raises(ConfigError, match=f"^{flag} must be a positive integer, got {value}"):
        parse_settings(BASE + [flag, value], 1)


def test_optimizer_values_torch_refuses_are_refused():
    """torch's AdamW and SGD (Megatron's optimizers without Transformer Engine or Apex) and ``normal_`` (Megatron's
    initialisation) raise on these values; omnitron ran with them (a negative std drew weights of std |std|)."""
    eps, momentum, std = -random.uniform(1e-9, 1.0), -random.uniform(1e-3, 1.0), -random.uniform(1e-3, 1.0)
    p = [torch.nn.Parameter(torch.zeros(2))]
    for make in (lambda: torch.optim.AdamW(p, eps=eps), lambda: torch.optim.SGD(p, lr=0.1, momentum=momentum),
                 lambda: torch.nn.init.normal_(torch.empty(2), std=std)):
        with pytest.raises((ValueError, RuntimeError)):
            make()
    for extra, flag in ((["--adam-eps", str(eps)], "--adam-eps"),
                        (["--optimizer", "sgd", "--sgd-momentum", str(momentum)], "--sgd-momentum"),
                        (["--init-method-std", str(std)], "--init-method-std")):
        with pytest.raises(ConfigError, match=flag):
            parse_settings(BASE + extra, 1)
    assert parse_settings(BASE + ["--adam-eps", "0", "--init-method-std", "0"], 1).optim.adam_eps == 0.0


@pytest.mark.skipif(not os.path.isdir(MEGATRON), reason="Megatron-LM's source is not unpacked here")
@pytest.mark.parametrize("extra, flag", [(["--lr-decay-iters", "0"], "--lr-decay-iters"),
                                         (["--lr-decay-iters", "-3"], "--lr-decay-iters"),
                                         (["--train-iters", "4", "--train-samples", "8", "--lr-decay-samples", "0"],
                                          "--lr-decay-samples")])
def test_a_decay_of_no_steps_is_refused_as_megatrons_scheduler_refuses_it(extra, flag, monkeypatch):
    """``--lr-decay-iters 0`` was read as not given (the decay over the whole run), -3 was accepted; Megatron's
    OptimizerParamScheduler asserts ``lr_decay_steps > 0``."""
    scheduler = _megatron_module("megatron/core/optimizer_param_scheduler.py", monkeypatch)
    OptimizerParamScheduler = scheduler.OptimizerParamScheduler
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(AssertionError):
        OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.1, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=0,
                                lr_decay_style="linear", start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
                                wd_incr_style="constant")
    argv = BASE + extra
    if "--train-samples" in extra:
        argv = [a for i, a in enumerate(argv) if "--train-iters" not in argv[max(i - 1, 0):i + 1]]
    with pytest.raises(ConfigError, match=f"^{flag} must be >= 1"):
        parse_settings(argv, 1)


@pytest.mark.parametrize("flag, value", [("--moe-token-drop-policy", "fp8"), ("--moe-router-score-function", "fp8"),
                                         ("--window-attn-skip-freq", "fp8"), ("--window-attn-skip-freq", "0")])
def test_a_choice_of_a_feature_that_is_off_is_still_checked(flag, value):
    """Megatron's parser types these flags (argparse choices from TransformerConfig's ``Literal`` fields, and
    ``moe_freq_type`` for the window pattern), so a misspelt value stops a dense run or a run without a window;
    omnitron checked them only with experts or a window on, and trained on with the value ignored."""
    with pytest.raises(ConfigError, match=flag):
        parse_settings(BASE + [flag, value], 1)
    parse_settings(BASE, 1)  # the same run without the flag is taken


def _megatron_accepts(scheduler, unit: str, total: int, gbs: int, warmup: int, decay, fraction, wsd, style) -> bool:
    """Whether Megatron's OptimizerParamScheduler is built for these flags: its steps as Megatron's
    ``get_optimizer_param_scheduler`` derives them (an iteration run counts samples: iterations x batch)."""
    per = gbs if unit == "iters" else 1
    decay_steps = (decay if decay is not None else total) * per
    warmup_steps = fraction * decay_steps if fraction is not None else warmup * per
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    try:
        scheduler.OptimizerParamScheduler(opt, init_lr=0.0, max_lr=0.1, min_lr=0.0, lr_warmup_steps=warmup_steps,
                                          lr_decay_steps=decay_steps, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                          wd_incr_steps=total * per, wd_incr_style="constant",
                                          wsd_decay_steps=None if wsd is None else wsd * per,
                                          lr_wsd_decay_style="linear")
    except AssertionError:
        return False
    return True


@pytest.mark.skipif(not os.path.isdir(MEGATRON), reason="Megatron-LM's source is not unpacked here")
@pytest.mark.parametrize("unit", ["iters", "samples"])
def test_schedule_lengths_are_refused_as_megatrons_scheduler_refuses_them(unit, monkeypatch):
    """A warm-up as long as the decay or longer (--lr-warmup-iters / -samples, or --lr-warmup-fraction 1), and WSD
    without --lr-wsd-decay-iters / -samples, were accepted (the warm-up ran past the decay; WSD decayed over a
    tenth of the span); Megatron's scheduler asserts on both. Fresh random lengths around the edges, each style:
    omnitron refuses in one line exactly the command lines Megatron's own scheduler refuses."""
    scheduler = _megatron_module("megatron/core/optimizer_param_scheduler.py", monkeypatch)
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    gbs = 2
    seen = set()
    for _ in range(24):
        total = rng.randint(2, 12) * (gbs if unit == "samples" else 1)
        decay = rng.choice([None, rng.randint(1, 2 * total)])
        edge = decay if decay is not None else total
        warmup = rng.choice([0, edge - 1, edge, edge + 1, rng.randint(0, 2 * edge)])
        fraction = rng.choice([None, None, 0.0, 0.5, 0.999, 1.0]) if warmup == 0 else None
        style = rng.choice(["linear", "cosine", "constant", "inverse-square-root", "WSD"])
        wsd = rng.choice([None, rng.randint(0, edge)])
        at = BASE.index("--train-iters")
        argv = BASE[:at] + BASE[at + 2:] + [f"--train-{unit}", str(total), "--lr-decay-style", style]
        for flag, v in ((f"--lr-decay-{unit}", decay), (f"--lr-warmup-{unit}", warmup or None),
                        ("--lr-warmup-fraction", fraction), (f"--lr-wsd-decay-{unit}", wsd)):
            argv += [flag, str(v)] if v is not None else []
        want = _megatron_accepts(scheduler, unit, total, gbs, warmup, decay, fraction, wsd, style)
        seen.add(want)
        if want:
            parse_settings(argv, 1)
            continue
        with pytest.raises(ConfigError) as err:
            parse_settings(argv, 1)
        assert len(str(err.value).splitlines()) == 1
        assert re.search(r"--lr-warmup-(iters|samples|fraction)|--lr-wsd-decay-(iters|samples)", str(err.value))


def test_a_warmup_ending_with_the_decay_names_both_lengths():
    """The message names the warm-up, the decay (or the run's length it defaults to) and the fix."""
    with pytest.raises(ConfigError, match=r"^--lr-warmup-iters 4 is not shorter than the decay, --train-iters "
                                          r"\(no --lr-decay-iters\) 4: .*give a shorter warm-up or a longer decay$"):
        parse_settings(BASE + ["--lr-warmup-iters", "4"], 1)
    with pytest.raises(ConfigError, match=r"^--lr-warmup-iters 6 is not shorter than the decay, --lr-decay-iters 3"):
        parse_settings(BASE + ["--lr-warmup-iters", "6", "--lr-decay-iters", "3"], 1)
    with pytest.raises(ConfigError, match=r"^--lr-decay-style WSD needs .* --lr-wsd-decay-iters N"):
        parse_settings(BASE + ["--lr-decay-style", "WSD"], 1)
    with pytest.raises(ConfigError, match=r"^--lr-warmup-fraction must lie in \[0, 1\)"):
        parse_settings(BASE + ["--lr-warmup-fraction", "1"], 1)
    assert parse_settings(BASE + ["--lr-warmup-iters", "3", "--lr-decay-style", "WSD", "--lr-wsd-decay-iters",
                                  "0"], 1).optim.lr_wsd_decay_iters == 0
    assert parse_settings(BASE + ["--skip-train", "--eval-iters", "1", "--lr-warmup-iters", "9"], 1)


def test_wsd_refusal_gives_the_old_default():
    """A WSD run begun before the refusal, without --lr-wsd-decay-iters / -samples, decayed over a tenth of the
    span after the warm-up (at least 1): the refusal prints that length as the flag to resume with (the old
    default, ``max((decay - warmup) // 10, 1)``, written here from the removed code's formula)."""
    rng = random.Random()
    for _ in range(6):
        unit = rng.choice(["iters", "samples"])
        total = rng.randint(8, 400)
        warmup = rng.randint(0, total - 1)
        decay = rng.choice([None, rng.randint(warmup + 1, total + 50)])
        length = ["--train-iters", str(total)] if unit == "iters" else ["--train-samples", str(total)]
        at = BASE.index("--train-iters")
        argv = BASE[:at] + BASE[at + 2:] + length + [
            f"--lr-warmup-{unit}", str(warmup), "--lr-decay-style", "WSD"]
        argv += [f"--lr-decay-{unit}", str(decay)] if decay is not None else []
        old = max(((decay if decay is not None else total) - warmup) // 10, 1)
        with pytest.raises(ConfigError, match=rf"resume it with --lr-wsd-decay-{unit} {old}\)$"):
            parse_settings(argv, 1)
