"""The SC21 comparison's 2021-stack terms (benchmarks/plan_published.py): the kernel rate of the
``a100-80gb-sxm-2021`` profile is the ratio of the two published step times of the same work, and 2021
Megatron's fp16 state bytes are counted as its optimizer and DDP hold them."""
from __future__ import annotations

import importlib.util
import os
import random

import pytest

from omnitron.plan.memory import StageMemory
from omnitron.plan.profile import load


def _load_script():
    """benchmarks/plan_published.py as a module, without putting benchmarks/ on sys.path (its kernels.py would
    shadow the ``kernels`` package transformers imports)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plan_published.py")
    spec = importlib.util.spec_from_file_location("plan_published", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plan_published = _load_script()


def test_2021_kernel_rate_is_the_published_same_work_ratio():
    """1T: Korthikanti et al. 2022's iteration time over SC21's (from its TFLOP/s per GPU by the paper's FLOP
    formula); the profile states it to three decimals, so they agree within 5e-4 (rounding)."""
    sc21 = next(r for r in plan_published.ROWS if r[0] == "1008.0B")
    later = next(r for r in plan_published.ROWS_2022 if r[0] == "1T")
    assert sc21[4:6] == later[4:6] and sc21[9] == later[9]  # same tp, pp, micro-batch
    assert sc21[7] // (sc21[6] // (sc21[4] * sc21[5])) == later[7]  # same micro-batches per replica
    step_2021 = plan_published.paper_flops(sc21) / (sc21[8] * 1e12 * sc21[6])
    base, old = load("a100-80gb-sxm"), load("a100-80gb-sxm-2021")
    assert abs(old.peak["fp16"] / base.peak["fp16"] - later[12] / step_2021) < 5e-4


class _Choice:
    def __init__(self, stages):
        self.stages = stages


@pytest.mark.parametrize("torch_ddp", [False, True])
def test_peak_2021_counts_fp32_grad_copies_and_ddp_buckets(torch_ddp):
    """Per stage: fp16 parameters n (2n bytes), the engine's 16 bytes a parameter without activations, 2021's
    extra 4n (the optimizer's fp32 copy of the gradients) only without activations, and 2n of torch DDP buckets
    throughout; the largest stage counts."""
    stages = []
    for s in range(3):
        n, act = random.randrange(1, 10**9), random.randrange(0, 10**11)
        stages.append(StageMemory(s, 1, 2 * n, 2 * n, 12 * n, act, 0, 0, 0, 1))
    want = max(max(2 * n + 2 * n + 12 * n + st.activations, 20 * n) + (2 * n if torch_ddp else 0)
               for st in stages for n in [st.params // 2])
    assert plan_published.peak_2021(_Choice(stages), torch_ddp) == want
