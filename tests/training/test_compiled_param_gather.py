"""``--torch-compile`` with the distributed optimizer's ``--overlap-param-gather``: each compiled layer waits for the
pending all-gathers of its own buckets eagerly, just before its compiled forward runs (a pre-hook on the layer,
outside the graph; its submodules get none), so the layer traces whole (was 10 graphs and 6 breaks at dp2 with
several buckets per layer: a ``Work.wait`` inside the graph) and later layers' gathers still overlap it. Held FP8
weights are refreshed per layer after those waits.

One spawn of 2 ranks trains eagerly and then compiled (aot_eager) with the same flags, fp32 and then FP8, spying on
the waits and on each compiled layer's calls; it runs on the session's backend (``--backend sim`` models
asynchronous collectives: 8.7 s there, 7.3 s on cpu, 2026-12-05, load average 1.4). A captured layer (through a
backend double, one process) is checked the same way.
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


def _deferred(gather):
    """The in-place all-gather run only when its handle is waited on. Otherwise, on gloo and on sim, the gathers
    had completed by the next forward in these runs, hiding a read that precedes the wait (a refresh planted
    before it changed no loss). Every rank waits in the same (module) order, so the deferred collectives match."""
    class Deferred:
        def __init__(self, buffer, group) -> None:
            self.buffer, self.group = buffer, group

        def wait(self) -> None:
            gather(self.buffer, group=self.group)

    def all_gather_in_place(buffer, group=None, async_op=False):
        return Deferred(buffer, group) if async_op else gather(buffer, group=group)
    return all_gather_in_place


def _eager_and_compiled(root: str, *extra: str) -> dict:
    """This rank's eager and compiled losses with ``OVERLAP`` and ``extra`` (gathers deferred to their waits); for
    the compiled run its graphs, graph breaks, FP8 linears holding their weights and, per compiled-layer call,
    (buckets of the layer's parameters still gathering, other buckets still gathering) as the call begins; pending
    gathers waited outside and inside the compiled calls."""
    from torch._dynamo.utils import counters

    import omnitron.core.compile as compile_module
    import omnitron.core.parallel.data.ddp as ddp
    import omnitron.core.precision.fp8.static_weights as static_weights
    from omnitron.backends import get_backend
    from omnitron.core.parallel.data.buffers import Bucket

    bucket_of, calls, held, inside, waits = {}, [], [], [False], {True: 0, False: 0}
    hooks, compile_layers, wait = ddp._param_gather_hooks, compile_module.compile_layers, Bucket.wait_param_gather
    hold, collectives = static_weights.hold_static_weights, get_backend().collectives

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

    collectives.all_gather_in_place = _deferred(collectives.all_gather_in_place)
    try:
        eager, _ = _train(root + "/eager", 2, *OVERLAP, *extra)
        ddp._param_gather_hooks, compile_module.compile_layers = spy_hooks, spy_compile
        Bucket.wait_param_gather = spy_wait
        static_weights.hold_static_weights = lambda modules: held.append(hold(modules)) or held[-1]
        compiled, graphs = _train(root + "/compiled", 2, *OVERLAP, "--torch-compile", *extra)
    finally:
        ddp._param_gather_hooks, compile_module.compile_layers, Bucket.wait_param_gather = hooks, compile_layers, wait
        static_weights.hold_static_weights = hold
        del collectives.all_gather_in_place
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


def _each(root: str, runs: dict) -> dict:
    """:func:`_eager_and_compiled` for each ``{name: extra flags}`` of ``runs``, in one spawn."""
    return {name: _eager_and_compiled(f"{root}/{name}", *extra) for name, extra in runs.items()}


FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--lr", "0.1", "--train-iters", "4")


def test_compiled_layers_wait_for_their_own_gathers_outside_the_graph(tmp_path, monkeypatch):
    """dp2, the distributed optimizer with overlapped gathers and several buckets, gathers deferred to their waits:
    one graph a rank, no graph break, and each compiled layer's gathers waited just before its compiled forward,
    outside it, while the other layer's are still pending; eager's losses (the gathers' timing changes no value).

    fp32, 3 steps: within REL (test_torch_compile.py's analysis: the compiled layers' plain-torch references reorder
    fp32 sums). Tensorwise FP8 with held weights (2 layers x 4 linears a rank), 4 steps at lr 0.1: each layer's
    refresh runs after that layer's waits (the waiter is prepended to its pre-hooks) and quantizes the gathered
    weight; within test_compiled_fp8_weights.py's FP8_REL (fp32 reordering moving an element across an FP8
    rounding boundary). A refresh before the waits quantized weights still the previous step's outside the rank's
    own shard: 1.3%, 4.8%, 2.3% off eager on steps 2-4 (one run)."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    ranks = run_distributed(_each, 2, str(tmp_path), {"fp32": (), "fp8": FP8}, timeout_s=600)
    _check([r["fp32"] for r in ranks], REL, 3)
    _check([r["fp8"] for r in ranks], FP8_REL, 4)
    assert [(r["fp32"]["held"], r["fp8"]["held"]) for r in ranks] == [([], [8])] * 2


def test_a_captured_layer_waits_for_its_gathers_before_its_graph_replays():
    """--cuda-graph-impl local (test_cuda_graph_flag.py's backend double: capture runs the callable): the captured
    layer is a graph region too, so the gathers of all its parameters are waited by its own pre-hook, once each,
    before the captured forward is called (a replay runs no Python: a waiter inside it would be skipped)."""
    from omnitron.core.capture import capture_layers
    from omnitron.core.parallel.data.buffers import Bucket
    from omnitron.core.parallel.data.ddp import _param_gather_hooks

    from test_cuda_graph_flag import GraphDouble
    from test_torch_compile import _layer

    class Handle:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self) -> None:
            events.append(self.name)

    model, be = _layer(hidden_dropout=0.0, attention_dropout=0.0)
    (captured,) = capture_layers([model], GraphDouble())
    layer, events = model.decoder.layers["0"], []
    _param_gather_hooks(model, {id(p): Bucket([p], p.new_empty(0), 0, 1, param_handle=Handle(n))
                                for n, p in model.named_parameters()})
    layer.forward = lambda *args: (events.append("forward"), captured(*args))[1]
    x = torch.randn(8, 2, 32, device=be.device(), requires_grad=True)
    layer(x, None).square().sum().backward()
    layer(x, None)  # nothing left to wait for
    own = sorted(f"decoder.layers.0.{n}" for n, _ in layer.named_parameters())
    assert len(own) > 4 and sorted(events[:len(own)]) == own and events[len(own):] == ["forward"] * 2, events
