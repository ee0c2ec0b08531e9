"""The device-profile search (``omnitron plan --devices N --device PROFILE``) lists only layouts that fit by the full
memory model, backward's transients included: a layout that fits only without them is dropped for the next ones,
one that the estimate without them over-counts is still listed, and the figures listed are the full model's.
deepseek_v3_tiny (MoE, multi-latent attention) on 2 devices of one node: its recomputed layouts are over-counted
without the transient probes, the others under-counted."""
from __future__ import annotations

import functools
import itertools
import random

import pytest

GIVEN = {"model": "deepseek_v3_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
         "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 16, "bf16": True}


@functools.lru_cache(maxsize=None)
def _ranked():
    """(the rates, every candidate ranked by its predicted tokens/s, fastest first): the reference's order."""
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.recommend import candidates
    from omnitron.plan.speed import predict

    rates = device_rates("a100-80gb-sxm", 2)
    every = candidates(GIVEN | {"nproc_per_node": 2}, 2, cluster=2)
    for c in every:
        c.step = predict(c.settings, rates)
    return rates, sorted(every, key=lambda c: -c.step.tokens_per_s)


@functools.lru_cache(maxsize=None)
def _peaks(name: str) -> tuple[int, int]:
    """(peak without the transient probes, peak with them) of the candidate named ``name``."""
    from omnitron.plan.memory import estimate

    (c,) = [c for c in _ranked()[1] if c.name() == name]
    return tuple(max(s.total for s in estimate(c.settings, transients=t)) for t in (False, True))


def test_a_layout_fitting_only_without_transients_is_not_listed():
    """The limit is drawn between the fastest layout's two estimates, so the search without the transients lists
    it first; the search must list instead the two fastest whose full estimate fits (the reference: every
    candidate walked fastest first), each with the full model's per-stage figures."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import recommend

    rates, every = _ranked()
    lo, hi = _peaks(every[0].name())
    assert lo < hi  # the transients add to this layout's peak (the case under test)
    limit = int(random.uniform(lo, hi - 1))
    want = list(itertools.islice((c.name() for c in every if _peaks(c.name())[1] <= limit), 2))
    got = recommend(GIVEN, 2, limit, rates, top=2, cluster=2)
    assert [c.name() for c in got] == want, (limit, lo, hi)
    for c in got:
        assert [s.total for s in c.stages] == [s.total for s in estimate(c.settings)]
        assert c.peak <= limit


def test_a_layout_over_counted_without_transients_is_still_listed():
    """The fastest layout whose estimate without the transient probes is over its full one (full recomputation:
    the rematerialised chunk counted is more than the probes hold beyond the activations), with the limit drawn
    between the two and under every faster layout's full estimate: the search must list it first (a screen by the
    estimate without transients drops it)."""
    from omnitron.plan.recommend import recommend

    rates, every = _ranked()
    faster = float("inf")  # the least full estimate of the layouts faster than the one looked at
    for c in every:
        lo, hi = _peaks(c.name())
        if hi < lo and hi < faster:
            break
        faster = min(faster, hi)
    else:
        pytest.fail("no layout of deepseek_v3_tiny is over-counted without the transients")
    limit = int(random.uniform(hi, min(lo, faster) - 1))
    (got,) = recommend(GIVEN, 2, limit, rates, top=1, cluster=2)
    assert got.name() == c.name(), (limit, lo, hi, faster)
    assert got.peak == hi


def test_the_smallest_layout_named_on_no_fit_is_priced_with_transients():
    """When nothing fits, the error names the smallest memory-minimal layout (ranked without the transient probes,
    as the search screens): its figures must be the full model's, as the search's checks were (a need printed
    without them can be under the limit that nothing fitted)."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import _smallest

    best = _smallest(GIVEN | {"nproc_per_node": 2}, 2, False, cluster=2)
    assert best.stages == estimate(best.settings)
