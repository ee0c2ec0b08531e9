"""``--torch-compile`` with the distributed optimizer's ``--overlap-param-gather``: each compiled layer waits for the
pending all-gathers of its own buckets eagerly, just before its compiled forward runs (a pre-hook on the layer,
outside the graph; its submodules get none), so the layer traces whole (was 10 graphs and 6 breaks at dp2 with
several buckets per layer: a ``Work.wait`` inside the graph) and later layers' gathers still overlap it. Held FP8
weights are refreshed per layer after those waits.

One spawn of 2 ranks per test trains eagerly and then compiled (aot_eager) with the same flags, spying on the waits
and on each compiled layer's calls; it runs on the session's backend (``--backend sim`` models asynchronous
collectives).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed

from test_compiled_fp8_weights import FP8_REL
from test_torch_compile import REL, _train

# dp2, 2 micro-batches a rank and step, every bucket's gather overlapped with the next step's forward; 2000-element
# buckets split each layer's ~8.5k parameters into several buckets (some shared by two layers)
OVERLAP = ("--use-distributed-optimizer", "--overlap-param-gather", "--overlap-grad-reduce",
           "--ddp-bucket-size", "2000", "--global-batch-size", "8")


def _eager_and_compiled(root: str, *extra: str) -> dict:
    """This rank's eager and compiled losses with ``OVERLAP`` and ``extra``; for the compiled run its graphs, graph
    breaks, FP8 linears holding their weights and, per compiled-layer call, (buckets of the layer's parameters
    still gathering, other buckets still gathering) as the call begins; pending gathers waited outside and inside
    the compiled calls."""
    from torch._dynamo.utils import counters

    import omnitron.core.compile as compile_module
    import omnitron.core.parallel.data.ddp as ddp
    import omnitron.core.precision.fp8.static_weights as static_weights
    from omnitron.core.parallel.data.buffers import Bucket

    eager, _ = _train(root + "/eager", 2, *OVERLAP, *extra)
    bucket_of, calls, held, inside, waits = {}, [], [], [False], {True: 0, False: 0}
    hooks, compile_layers, hold = ddp._param_gather_hooks, compile_module.compile_layers, static_weights.hold_static_weights
    wait = Bucket.wait_param_gather

    def spy_hooks(module, of):
        bucket_of.update(of)
        return hooks(module, of)

    def spy_wait(bucket) -> None:
        waits[inside[0]] += bucket.param_handle is not None
        wait(bucket)

    def probe(layer, forward):
        def call(*args, **kwargs):
            own = {id(b) for p in layer.parameters() if (b := bucket_of.get(id(p)))}
            pending = {id(b) for b in bucket_of.values() if b.param_handle is not None}
            calls.append((len(own & pending), len(pending - own)))
            inside[0] = True
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] = False
        return call

    def spy_compile(modules, backend, compiler=None):
        n = compile_layers(modules, backend, compiler)
        for layer in compile_module.transformer_layers(modules):
            layer.forward = probe(layer, layer.forward)  # around the compiled forward, inside the layer's hooks
        return n

    ddp._param_gather_hooks, compile_module.compile_layers, Bucket.wait_param_gather = spy_hooks, spy_compile, spy_wait
    static_weights.hold_static_weights = lambda modules: held.append(hold(modules)) or held[-1]
    try:
        compiled, graphs = _train(root + "/compiled", 2, *OVERLAP, "--torch-compile", *extra)
    finally:
        ddp._param_gather_hooks, compile_module.compile_layers, Bucket.wait_param_gather = hooks, compile_layers, wait
        static_weights.hold_static_weights = hold
    return dict(eager=eager, compiled=compiled, graphs=graphs, breaks=dict(counters["graph_break"]), held=held,
                calls=calls, waits_outside=waits[False], waits_inside=waits[True],
                buckets=len({id(b) for b in bucket_of.values()}))


def _check(ranks: list[dict], rel: float, steps: int) -> None:
    for rank, r in enumerate(ranks):
        assert r["compiled"] == pytest.approx(r["eager"], rel=rel), (rank, r["compiled"], r["eager"])
        assert len(set(r["eager"])) == steps, (rank, r["eager"])
        # 2 layers x 2 micro-batches x steps calls, one graph, no break
        assert r["graphs"] == 1 and not r["breaks"], (rank, r["graphs"], r["breaks"])
        assert len(r["calls"]) == 2 * 2 * steps, (rank, r["calls"])
        # every gather into a layer's parameters was waited before its compiled forward began, none inside it
        assert all(own == 0 for own, _ in r["calls"]) and r["waits_inside"] == 0, (rank, r)
        # each step after the first: layer 0's first call began with other buckets (layer 1's) still gathering, so
        # a layer waits for its own buckets, not all; every bucket's gather launched by the step before was waited
        # once, outside (the last step's are left pending: no forward follows)
        assert all(r["calls"][4 * s][1] > 0 for s in range(1, steps)), (rank, r["calls"])
        assert r["waits_outside"] == (steps - 1) * r["buckets"] and r["buckets"] > 2, (rank, r)


def test_compiled_layers_wait_for_their_own_gathers_outside_the_graph(tmp_path, monkeypatch):
    """fp32 dp2, the distributed optimizer with overlapped gathers and several buckets: eager's losses within REL
    (test_torch_compile.py's analysis: the compiled layers' plain-torch references reorder fp32 sums; the gathers'
    timing changes no value), one graph a rank, no graph break, and each compiled layer's gathers waited just
    before its compiled forward, outside it, while the other layer's still run."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    ranks = run_distributed(_eager_and_compiled, 2, str(tmp_path), timeout_s=600)
    _check(ranks, REL, 3)
    assert all(r["held"] == [] for r in ranks)  # no FP8: nothing held


FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--lr", "0.1", "--train-iters", "4")


@pytest.mark.slow
def test_compiled_fp8_layers_refresh_their_held_weights_after_their_gathers(tmp_path, monkeypatch):
    """Tensorwise FP8 with held weights (2 layers x 4 linears a rank) under --overlap-param-gather: each layer's
    refresh runs after the layer's waits (the waiter is prepended to its pre-hooks), so it quantizes the gathered
    weight. Eager's losses within test_compiled_fp8_weights.py's FP8 bound (FP8_REL: fp32 reordering moving an
    element across an FP8 rounding boundary); lr 0.1 over 4 steps, as there, so that a held form quantized from
    a weight still gathering (half of it the previous step's) stays stale for the step and shows in the loss."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    ranks = run_distributed(_eager_and_compiled, 2, str(tmp_path), *FP8, timeout_s=600)
    _check(ranks, FP8_REL, 4)
    assert all(r["held"] == [8] for r in ranks), [r["held"] for r in ranks]
