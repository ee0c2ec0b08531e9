"""The 1-bit compressed all-reduce (omnitron/core/parallel/data/compressed.py) against its definition.

The reference (omnitron/testing/onebit.py, plain torch, float64, one process) follows the definition: worker
error feedback, per-chunk scale mean|z|, the owner's average of the decompressed chunks, its server error
feedback, and the gather of the re-compressed chunks.
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.core.parallel.data.compressed import pack_signs, unpack_signs
from omnitron.testing.distributed import run_distributed
from omnitron.testing.onebit import compressed_mean


def test_pack_unpack_round_trip_bit_layout():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 40, generator=g)
    x[0, :5] = 0.0  # sgn(0) = +1
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5)
    # element 8i + j is bit j of byte i (independent reference: python integers)
    ref = [[sum(1 << j for j in range(8) if x[r, 8 * i + j] >= 0) for i in range(5)] for r in range(3)]
    assert packed.tolist() == ref
    signs = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed), signs)
    assert torch.equal(unpack_signs(packed, torch.float64), signs.double())
    every_byte = torch.arange(256).to(torch.uint8)  # the round trip the other way: all 256 bytes
    assert torch.equal(pack_signs(unpack_signs(every_byte.reshape(-1, 1))).reshape(-1), every_byte)
    with pytest.raises(ValueError, match="divisible by 8"):
        pack_signs(torch.ones(12))


NUMEL, STEPS = 45, 6  # 45 elements pad to 64 at dp4: chunks of 16, the last one partly padding


def _inputs(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * step + rank), dtype=torch.float64)


def compressed_worker(block) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.data.compressed import ErrorFeedback, compressed_all_reduce
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), backend=be)
    coll, wire = be.collectives, []
    for op in ("all_to_all", "all_gather"):  # record what the collectives are handed
        fn = getattr(coll, op)
        setattr(coll, op, lambda out, inp, _fn=fn, _op=op, **kw: (wire.append((_op, out.dtype, inp.dtype,
                                                                                 inp.numel())), _fn(out, inp, **kw))[1])
    dev = be.device()  # the backend under test's device
    rank = groups.dp.rank
    state = ErrorFeedback.zeros(NUMEL, groups.dp.size, dtype=torch.float64, device=dev, block=block)
    outs = []
    for step in range(STEPS):
        x = _inputs(rank, step).to(dev)
        outs.append(compressed_all_reduce(x, state, groups.dp, coll).clone())
    return {"outs": outs, "worker": state.worker, "server": state.server, "wire": wire}


@pytest.mark.parametrize("block", [None, 8])  # one scale per chunk of 16, or per 8 elements (2 a chunk)
def test_compressed_all_reduce_matches_definition_dp4(block):
    dp = 4
    res = run_distributed(compressed_worker, dp, block)
    worker = [torch.zeros(64, dtype=torch.float64) for _ in range(dp)]
    server = [torch.zeros(16, dtype=torch.float64) for _ in range(dp)]
    # Tolerance: both sides compute in float64 the same sums (means of <= 16 terms, a 4-term average) in
    # possibly different order; each output is a scale times +-1 with relative error <= ~32 eps = 7e-15
    # per step, and error feedback carries it into the next steps additively (6 steps: < 1e-13 of the
    # values, which are O(1)). A sign that differs would show as an O(1) difference.
    tol = dict(rtol=1e-12, atol=1e-12)
    for step in range(STEPS):
        ref = compressed_mean([_inputs(r, step) for r in range(dp)], worker, server, block)
        for rank in range(dp):
            torch.testing.assert_close(res[rank]["outs"][step], ref, **tol)
    for rank in range(dp):
        torch.testing.assert_close(res[rank]["worker"], worker[rank], **tol)
        torch.testing.assert_close(res[rank]["server"], server[rank], **tol)
        # packed signs and scales travel as uint8: 16 elements -> 2 bytes + 8 bytes per float64 scale, a row
        row = 2 + 8 * (16 // (block or 16))
        assert res[rank]["wire"] == [("all_to_all", torch.uint8, torch.uint8, dp * row),
                                     ("all_gather", torch.uint8, torch.uint8, row)] * STEPS


EF_NUMEL = 16  # dp2: two chunks of n = 8 elements, no padding


def feedback_worker(steps: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.data.compressed import ErrorFeedback, compressed_all_reduce
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), backend=be)
    dev = be.device()  # the backend under test's device
    x = torch.randn(EF_NUMEL, generator=torch.Generator().manual_seed(5 + groups.dp.rank), dtype=torch.float64).to(dev)
    state = ErrorFeedback.zeros(EF_NUMEL, 2, dtype=torch.float64, device=dev)
    total, total_plain, sums = torch.zeros_like(x), torch.zeros_like(x), []
    for _ in range(steps):
        total += compressed_all_reduce(x.clone(), state, groups.dp, be.collectives)
        fresh = ErrorFeedback.zeros(EF_NUMEL, 2, dtype=torch.float64, device=dev)  # no feedback: zero errors
        total_plain += compressed_all_reduce(x.clone(), fresh, groups.dp, be.collectives)
        sums.append(total.clone())
    return {"x": x, "sums": sums, "plain": total_plain, "worker": state.worker, "server": state.server}


def test_error_feedback_keeps_the_running_sum_within_a_bound_that_does_not_grow():
    """Sum over t of the outputs - t x (the true mean) stays within a bound derived from the contraction of
    sign compression; without error feedback the same sum leaves that bound (it grows linearly)."""
    n, steps = 8, 900  # without feedback the sum drifts by >= 0.3 M per step here: past the bound by step ~750
    # NOTE: strict collective checking off: 2 x 900 identical calls per rank, whose agreement the dp4 test checks
    res = run_distributed(feedback_worker, 2, steps, env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    mean = (res[0]["x"] + res[1]["x"]) / 2
    # Bound, per chunk c of n elements. Sign compression with the scale mean|z| is the projection of z on
    # sgn(z): |z - C(z)|^2 = |z|^2 - |z|_1^2 / n <= (1 - 1/n) |z|^2 = rho^2 |z|^2, and |C(z)| <= |z|. Worker:
    # e' = z - C(z), z = x + e, so |e| <= rho / (1 - rho) M with M = max_r |x_{r,c}|, and |z| <= M / (1 - rho).
    # Server: input v = mean_r C(z_r) has |v| <= M / (1 - rho), so |e_s| <= rho / (1 - rho)^2 M. The sums
    # telescope: sum_t out_t - t mean_r x_r = -(mean_r e_{r,t} + e_{s,t}), hence within
    # B = (rho / (1 - rho) + rho / (1 - rho)^2) M at every step.
    rho = math.sqrt(1 - 1 / n)
    for c in range(2):
        sl = slice(c * n, (c + 1) * n)
        bound = (rho / (1 - rho) + rho / (1 - rho) ** 2) * max(res[r]["x"][sl].norm() for r in range(2))
        for t, s in enumerate(res[0]["sums"]):
            assert (s[sl] - (t + 1) * mean[sl]).norm() <= bound, (c, t)
        # the telescoped identity itself (float64 rounding of 900 additions of O(1) terms: < 1e-9)
        owner_err = res[c]["server"]
        exact = -(res[0]["worker"][sl] + res[1]["worker"][sl]) / 2 - owner_err
        torch.testing.assert_close(res[0]["sums"][-1][sl] - steps * mean[sl], exact, rtol=0, atol=1e-9)
        assert (res[0]["plain"][sl] - steps * mean[sl]).norm() > bound, c  # no feedback: the bias accumulates
    for t, s in enumerate(res[1]["sums"]):  # every rank got the same outputs
        torch.testing.assert_close(s, res[0]["sums"][t], rtol=0, atol=0)
