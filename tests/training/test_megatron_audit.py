"""The Megatron flag audit: no flag is both accepted and computing something other than Megatron's run.

Every flag is implemented (changes the settings, with a named test of the maths), accepted with a reason the
trained model is the same, an alias, or refused in one line; docs/megatron-flags.md shows exactly this data."""
from __future__ import annotations

import dataclasses
import pathlib
import random
import re

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.optim import MixedPrecisionOptimizer
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.training import megatron_flags as MF
from omnitron.core.training.arguments import options, parse_settings
from omnitron.core.training.megatron_audit import IMPLEMENTED, audit_markdown

ROOT = pathlib.Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--bf16"]
# flags issue 36 found accepted while computing something else: never a selector again
FOUND_DIFFERENT = ("no_bias_gelu_fusion", "grad_reduce_in_bf16", "fp8_param_gather")


def test_docs_hold_the_audit_table():
    text = (ROOT / "docs" / "megatron-flags.md").read_text()
    table = text.split("<!-- audit:begin -->\n", 1)[1].split("<!-- audit:end -->", 1)[0]
    assert table == audit_markdown(), "docs/megatron-flags.md is stale: regenerate its table (see the page)"


def test_docs_count_the_megatron_flags_omnitron_train_takes():
    """The page's sentence "Of Megatron's N flags at that commit, K are omnitron train's; the other N - K ..."
    against the flag list and omnitron train's own parser."""
    from omnitron.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["train"]
    flags = [ln.strip() for ln in (ROOT / "omnitron/core/training/megatron_flags.txt").read_text().splitlines()
             if ln.strip().startswith("--")]
    taken = sum(f in sub._option_string_actions for f in flags)
    text = " ".join((ROOT / "docs" / "megatron-flags.md").read_text().split())
    want = (f"Of Megatron's {len(flags)} flags at that commit, {taken} are omnitron train's; "
            f"the other {len(flags) - taken}")
    assert want in text, want


def test_every_selector_gives_a_reason_and_none_changes_the_maths():
    own = options()
    for dest, (_, instead, why) in MF.SELECTORS.items():
        assert instead and len(why) > 20, dest
        assert dest not in own, f"{dest} is a setting of omnitron's and a selector"
    for dest in FOUND_DIFFERENT:
        assert dest not in MF.SELECTORS, dest


def _settings(argv):
    s = parse_settings(BASE + argv, 1)
    return {k: dataclasses.asdict(getattr(s, k)) for k in ("model", "parallel", "ddp", "optim", "training",
                                                           "precision", "logging")}


AWARE = ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]
"""What the moment dtype flags need beside them (Megatron's rule); in the baseline too, so that the dtype flag
itself has to change the settings."""


@pytest.mark.parametrize("flag", sorted(IMPLEMENTED))
def test_implemented_flags_change_the_settings_and_name_a_test(flag, tmp_path):
    # (the flag's value, the flags it needs): compared with the flags it needs alone
    value, needs = {"--tensorboard-dir": ([str(tmp_path)], []), "--moe-router-dtype": (["fp32"], []),
                    "--exp-avg-dtype": (["bf16"], AWARE),
                    "--exp-avg-sq-dtype": (["bf16"], AWARE),
                    "--squared-relu": ([], ["--no-bias-gelu-fusion"]),  # Megatron's rule
                    "--cpu-offloading-retain-pinned-cpu-buffers": ([], ["--cpu-offloading-num-layers", "1"])
                    }.get(flag, ([], []))
    assert _settings([flag, *value, *needs]) != _settings(needs)
    path, name = IMPLEMENTED[flag][2].split("::")
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), IMPLEMENTED[flag][2]


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_moment_dtype_flags_reach_the_optimizer_state(key):
    """Each dtype flag stores its own moment in that dtype and leaves the other in fp32: the optimizer built from
    the parsed settings, not only the settings, so a flag the optimizer ignores fails here."""
    dtype = random.choice(["bf16", "fp16"])
    optim = parse_settings(BASE + ["--" + key.replace("_", "-") + "-dtype", dtype, *AWARE], 1).optim
    model = torch.nn.Linear(8, 4).bfloat16()
    opt = MixedPrecisionOptimizer(model.named_parameters(), optim, ParallelGroups.single(), backend=get_backend("cpu"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(1e-3)
    want = {key: {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]}
    for k in ("exp_avg", "exp_avg_sq"):
        assert {t.dtype for t in opt.state[k]} == {want.get(k, torch.float32)}, k


@pytest.mark.parametrize("dest", sorted(MF.REFUSED))
def test_refused_flags_stop_in_one_line(dest):
    metavar, why = MF.REFUSED[dest]
    flag = "--" + dest.replace("_", "-")
    with pytest.raises(ConfigError, match=f"^{re.escape(flag)}: ") as info:
        parse_settings(BASE + ([flag] if metavar is None else [flag, "2"]), 1)
    assert "\n" not in str(info.value) and why in str(info.value)


def test_grad_reduce_in_bf16_is_megatrons_switch():
    on = parse_settings(BASE + ["--grad-reduce-in-bf16"], 1).ddp
    assert on.grad_reduce_in_bf16 and not on.accumulate_allreduce_grads_in_fp32
    assert parse_settings(BASE, 1).ddp.accumulate_allreduce_grads_in_fp32  # Megatron's bf16 default
    # Megatron lets --grad-reduce-in-bf16 win over --accumulate-allreduce-grads-in-fp32 (test_megatron_precision.py)
    both = parse_settings(BASE + ["--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"], 1).ddp
    assert both.grad_reduce_in_bf16 and not both.accumulate_allreduce_grads_in_fp32
