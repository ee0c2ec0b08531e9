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

PARENT: dict[str, str] = {}
GIVEN = {"model": "deepseek_v3_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
         "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 16, "bf16": True}


@functools.lru_cache(maxsize=None)
def _ranked():
    """(the rates, every candidate ranked by its predicted tokens/s, fastest first, with the block recomputations
    of those without recomputation (the search walks them where their parent does not fit)): the reference's
    order; :data:`PARENT` maps a block variant's name to its parent's."""
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.recommend import _blocks, candidates
    from omnitron.plan.speed import predict

    rates = device_rates("a100-80gb-sxm", 2)
    every = candidates(GIVEN | {"nproc_per_node": 2}, 2, cluster=2)
    blocks = [(b, c) for c in every for b in _blocks(c)]
    PARENT.update((b.name(), c.name()) for b, c in blocks)
    every += [b for b, _ in blocks]
    for c in every:
        c.step = predict(c.settings, rates)
    return rates, sorted(every, key=lambda c: -c.step.tokens_per_s)


@functools.lru_cache(maxsize=None)
def _peaks(name: str) -> tuple[int, int]:
    """(peak without the transient probes, peak with them) of the candidate named ``name``."""
    from omnitron.plan.memory import estimate

    (c,) = [c for c in _ranked()[1] if c.name() == name]
    return tuple(max(s.total for s in estimate(c.settings, transients=t)) for t in (False, True))


def _listed(every, limit: int, top: int) -> list[str]:
    """The reference's first ``top`` names under ``limit``: the candidates fastest first whose full estimate fits,
    less a block variant of a layout that fits without recomputation (that layout, slower). Only the candidates up
    to the last one listed are priced: pricing all 214 took most of a minute per limit."""
    def fits(name: str) -> bool:
        return _peaks(name)[1] <= limit

    names = (c.name() for c in every)
    return list(itertools.islice((n for n in names if fits(n) and not (n in PARENT and fits(PARENT[n]))), top))


def test_a_layout_fitting_only_without_transients_is_not_listed():
    """The limit is drawn between the fastest layout's two estimates, so the search without the transients lists
    it first; the search must list instead the two fastest whose full estimate fits (the reference: every
    candidate walked fastest first, block recomputations where their layout does not fit without), each with the
    full model's per-stage figures."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import recommend

    rates, every = _ranked()
    lo, hi = _peaks(every[0].name())
    assert lo < hi  # the transients add to this layout's peak (the case under test)
    limit = int(random.uniform(lo, hi - 1))
    want = _listed(every, limit, 2)
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


def test_a_block_recomputation_is_listed_where_its_layout_does_not_fit_without():
    """Megatron's ``--recompute-method block`` (the first k layers of each chunk) holds less than no recomputation
    and recomputes less than all of it: with the limit under a layout's need without recomputation and over its
    block variant's, the search must list what the reference lists first (every candidate and every block variant,
    fastest first, full estimates), and for some limit that is a block variant."""
    from omnitron.plan.recommend import recommend

    rates, every = _ranked()
    seen_block = False
    for c in every:
        if c.name() not in PARENT.values():
            continue  # a layout with no block variant (recomputing, or one layer a chunk)
        blocks = [b for b in every if PARENT.get(b.name()) == c.name()]
        need = _peaks(c.name())[1]
        least = min(_peaks(b.name())[1] for b in blocks)
        if least >= need:
            continue
        limit = int(random.uniform(least, need - 1))
        (want,) = _listed(every, limit, 1)
        (got,) = recommend(GIVEN, 2, limit, rates, top=1, cluster=2)
        assert got.name() == want, (limit, least, need)
        seen_block |= "recompute-block" in want
        if seen_block:
            break
    assert seen_block, "no limit made a block recomputation the fastest that fits"
