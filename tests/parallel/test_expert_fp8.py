"""FP8 x MoE: a GPT whose MLPs are MoE layers, trained with FP8 GEMMs (experts included) under each recipe
at ep 2 x dp 4 (edp 2) and tp 2 x ep 2 with sequence parallelism, against one process.

Under strict collectives (on in the suite) this is first a test that FP8's amax reductions no longer depend
on routing: an expert that receives no tokens on one rank still joins its reductions (moe/experts.py),
otherwise the fingerprint check fails at once. Then the numbers, which cannot be equal: a per-tensor (or
per-tile) FP8 scale is a statistic of the rows a GEMM sees, and an expert here sees the rows of several
data-parallel ranks' micro-batches at once (and its gradient tiles span them), where the one-process run
sees one micro-batch at a time.

Error analysis for the bound. Both runs compute the same maths; each FP8 GEMM rounds its operands to e4m3
(relative error <= 2**-4) or e5m2 (<= 2**-3, gradients) after scaling, fp32 accumulation; only the scales
(hence which way each element rounds) differ. So the parallel run's deviation from the exact (wide, fp32)
result is another realisation of a sum of the same number of rounding errors of the same sizes as the
one-process FP8 run's deviation: the same magnitude, not the same value. We measure the one-process FP8 run's
deviation from the wide one-process run, ``gap = max over steps |L_fp8 - L_wide| / L_wide`` (and likewise
for gradient norms), and require every step of the parallel run to deviate from the wide run by at most
``3 * gap``: 1 for the reference's own size, plus a factor 2 for a second, independent realisation (its
errors need not have the same signs), rounded up to 3 for the few steps sampled. A broken FP8 (amaxes paired
with the wrong tensors, saturation, a stale scale) deviates by far more than its own rounding.
The same helpers run as float64 models match one process to 1e-12 (tests/parallel/test_expert_parallel.py).
"""
from __future__ import annotations

import pytest

from omnitron.testing.distributed import run_distributed
from test_expert_parallel import STEPS, _gpt_run, gpt_reference

pytestmark = pytest.mark.multiprocess
RECIPES = ("tensorwise", "delayed", "blockwise")
LAYOUTS = [(1, 1, 2, False, 1, False), (2, 1, 2, True, 1, False)]  # (tp, pp, ep, sp, etp, extras) on 4 ranks


def fp8_moe_worker() -> dict:
    import torch

    from omnitron.backends import get_backend

    torch.manual_seed(0)
    coll = get_backend().collectives
    return {(key, r): _gpt_run(coll, *key, fp8=r) for key in LAYOUTS for r in RECIPES}


def _rel(a: list[float], b: list[float]) -> list[float]:
    return [abs(x - y) / abs(y) for x, y in zip(a, b)]


def test_fp8_moe_matches_one_process_within_the_fp8_bound():
    ranks = run_distributed(fp8_moe_worker, 4)
    for key in LAYOUTS:
        dp = 4 // key[0]
        wide = gpt_reference(dp)
        for recipe in RECIPES:
            ref = gpt_reference(dp, fp8=recipe)
            for name in ("losses", "norms"):
                gap = max(_rel(ref[name], wide[name]))
                assert 0 < gap < 0.05, (recipe, name, gap)  # FP8 did run, and trains the same model
                for r in ranks:
                    got = r[(key, recipe)][name]
                    assert len(got) == STEPS
                    worst = max(_rel(got, wide[name]))
                    assert worst <= 3 * gap, f"{key} {recipe} {name}: {worst:.2e} from wide, FP8 gap {gap:.2e}"
