"""The transient probes' logs do not depend on whether the caller paused Python's cyclic collector (a layout search
pauses it: :func:`omnitron.plan.recommend.collector_paused`)."""
from __future__ import annotations

import gc


def test_a_search_paused_collector_leaves_the_moe_probes_aligned(monkeypatch):
    """Mixtral's structure shrunk (h256, 16 heads / 4 groups, 8 experts top 2, pp2 ep2) estimated with the collector
    off and no probe cache: every stage's transients are probed (their logs align with the sequence doubled). Before
    2026-12-07 stage 0's probe kept two storages held by reference cycles to its end while its doubled twin freed
    them (776 against 779 events): the estimate warned and left its backward's transients out, as it did for
    Mixtral 8x7B at tp1 on 64 devices in a search (and through the probe cache in later ``--layout`` runs)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import transients
    from omnitron.plan.memory import estimate

    monkeypatch.setenv("OMNITRON_PLAN_CACHE", "off")
    monkeypatch.setattr(transients, "_TIMELINES", {})
    s = parse_settings(["--model", "mixtral_8x7b", "--num-layers", "8", "--hidden-size", "256",
                        "--num-attention-heads", "16", "--ffn-hidden-size", "896", "--pipeline-model-parallel-size", "2",
                        "--expert-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
                        "--seq-length", "256", "--max-position-embeddings", "256", "--bf16", "--tokenizer-type",
                        "NullTokenizer", "--vocab-size", "512", "--mock-data"], 4)
    was = gc.isenabled()
    gc.disable()
    try:
        stages = estimate(s)
        assert not gc.isenabled()  # the probes put the collector back as they found it
    finally:
        if was:
            gc.enable()
    assert [m.probed for m in stages] == [True, True] and all(m.transient > 0 for m in stages)


def test_a_probe_collects_its_own_objects_not_the_heap_it_found():
    """A probe's collections walk what the probe makes, not the heap it finds (a search's meta skeletons and
    tables: a full collection a probe cost 15 s of a 214 s GPT-2 search): a reference cycle left before the probe
    is not collected inside it, one made inside it is collected by its end, and the collector's state (paused, no
    objects frozen) comes back as it was. Before, the probe's first full collection freed the older cycle too."""
    from omnitron.plan.transients import _collector_from_empty

    freed = []

    def cycle(name: str) -> None:
        a = _Node(name, freed)
        a.self = a

    was = gc.isenabled()
    gc.disable()
    try:
        cycle("before")
        with _collector_from_empty():
            assert gc.isenabled()
            cycle("inside")
            assert freed == []
        assert freed == ["inside"] and not gc.isenabled() and gc.get_freeze_count() == 0
        gc.collect()
        assert freed == ["inside", "before"]
    finally:
        if was:
            gc.enable()


class _Node:
    """An object that says when it is freed."""

    def __init__(self, name: str, freed: list) -> None:
        self.name, self.freed = name, freed

    def __del__(self) -> None:
        self.freed.append(self.name)
