"""``--torch-compile``: regional compilation, one transformer layer at a time (torchtitan's ``compile.enable``).

Each :class:`~omnitron.core.transformer.layer.TransformerLayer`'s ``forward`` is compiled in place (the instance's
``forward`` becomes ``torch.compile(layer.forward)``), so parameter names, ``state_dict`` keys, checkpoints and the
hooks of the data-parallel wrappers are those of the eager model. Every layer runs the same ``forward`` code on
parameters of the same shapes, so dynamo traces it once and the other layers (and every micro-batch and
pipeline chunk) reuse the graph; the embedding, the loss, the pipeline schedule and the optimizer stay eager.
The layer's own hooks run eagerly around its compiled forward (:meth:`torch.nn.Module.compile` would compile
``_call_impl`` and trace them inside: checked on torch 2.13): each compiled layer is marked a graph region
(:func:`omnitron.core.graph_state.mark_region`) and what must happen outside its graph hooks the layer itself.
``--overlap-param-gather`` waits there for every bucket holding one of the layer's parameters (its submodules get
no waiter of their own: waits inside the graph, on ``Work`` handles, made 10 graphs and 6 breaks per rank at dp2
with 2000-element buckets, 2026-12-05), and held FP8 weights are refreshed there, after those waits, layer by layer.
With ``--cuda-graph-impl local`` too, each layer's forward is compiled by
:func:`omnitron.core.capture.capture_layers` instead and the compiled forward is captured as device graphs.

What makes a layer trace without graph breaks:

* the kernel registry sends calls to ``traceable`` implementations only while dynamo traces (pybind C++
  kernels and raw Triton launches would each split the graph; their plain-torch references are fused by the
  compiler instead) and every op is resolved before compilation, so no lookup happens while tracing;
* dropout never enters the tensor-parallel RNG tracker's fork while dynamo traces (its generator-state swap
  cannot be traced): every dropout of the layer draws an explicit mask from the default generator at the full
  (unsplit) shape and a rank whose tensor is split keeps its slice, so shards stay independent and the tp2
  layer computes the tp1 layer with the same masks (:meth:`RNGTracker.keep_multiplier`, tested);
* the tensor-parallel collectives are torch's functional collectives while tracing
  (:mod:`omnitron.core.parallel.tensor.mappings`);
* selective recomputation inside a layer: :func:`omnitron.core.parallel.tensor.random.checkpoint` is traced
  as torch's checkpoint (full recomputation wraps the compiled layers from outside, unchanged);
* FP8: the graph reads each weight's FP8 form from tensors refreshed in place once per optimizer step outside
  it (:mod:`omnitron.core.precision.fp8.static_weights`, installed by training; a layer compiled without them
  quantizes the weight in its graph), and the FP8 provider's log-once stays silent while tracing;
* FP8 ``delayed`` (as training runs it, one amax reduction and history push per optimizer step): the scale and
  history change only at the step's end, outside the compiled layers; inside, a use casts with the scale in force
  and max-accumulates its amax into a buffer in place, in the forward and in the backward, which dynamo and
  AOTAutograd trace (:mod:`omnitron.core.precision.fp8.scaling`). 0 graph breaks; TWO graphs per layer shape:
  the first step's (no history yet: every use scaled from its own amax, reduced in the graph) and every later
  step's, compiled on step 2's first call (the layer reads one Python flag, ``AmaxReducer.primed``). Inductor
  (one run, 2026-12-03, the layer test's 3 steps): the same 2 graphs, outputs equal to eager's, input gradients
  to 1e-8 and amax histories to 8e-8 relative.

Known graph breaks that remain (each measured with ``torch._dynamo.explain``, torch 2.13, 2026-12-03):

* the ``delayed`` FP8 recipe with one update per use (``enable_fp8(per_step=False)``, not what training runs):
  a recomputed forward is recognized by asking autograd whether it runs a backward
  (``torch._C._current_graph_task_id``, an int dynamo cannot trace) and the amax history, a Python object, is
  updated inside the autograd function: 25 breaks per GPT layer;
* MoE token exchange (``--num-experts``): the dispatch, the experts and the combine run eagerly between graphs
  (``torch.compiler.disable``): the rows each rank sends and each expert takes come from the routing and the
  all-to-all takes them as Python ints, so a traced exchange breaks the graph at each host read and recompiles
  at each new routing (61-62 graphs per rank at ep2 before, 2026-12-03). Disabled: 4 graphs per rank whatever
  the routing (the layer before and after the MoE block, the block's router before it and its output after it)
  and no recompilation. With a load-balancing loss one more (a step's first micro-batch: no logged aux loss yet),
  still none as the loss scale moves: the expert counts are fixed-size scatter-adds (a bincount broke the graph at
  each router use: 11 graphs) and the aux-loss gradient weight a tensor input (a float was a guarded constant:
  --fp16 recompiled at each new loss scale, 17 graphs in 6 steps; 2026-12-06). A static exchange
  (``--moe-pad-expert-input-to-capacity``: fixed sizes) could be traced whole; not done: the dispatch still
  derives its sizes from the mask.

Context parallelism's ring traces whole: its exchanges are functional all-to-alls while dynamo traces
(:meth:`omnitron.core.parallel.context.ring._Ring.exchange`), one graph per rank at cp2 (was 8: the
point-to-point exchanges split it). Its attention dropout (the counter-based hash masks) takes its seed from an op
in the graph (:meth:`omnitron.core.parallel.tensor.random.RNGTracker.hash_seed`) that makes eager's host-side draw
each time the graph runs: 0 graph breaks (was 3, at the draw's hash of the generator state; 6 counted by
``explain``), one graph per rank whatever the seed, the eager layer's masks (tested, with selective recomputation
too: a traced checkpoint saves the seed op's output instead of drawing again in backward). Inductor (one run,
2026-12-04, cpu, the cp2 layer without hidden dropout, two calls): one graph per rank, 0 breaks, outputs and input
gradients the eager layer's within 1.3e-8 relative, the two calls 2-4e-3 apart (new seeds).
Checked against eager training (tests/training/test_torch_compile.py and single runs of 2026-12-03 through
the same ``_train``, aot_eager, 3 steps): the same losses within float32 (bf16) reordering and ONE graph per
process for tp1 plain and with selective or full recomputation, --bf16, tp2 x pp2 with sequence parallelism,
pp2 interleaved (2 chunks per rank), dp2 with the distributed optimizer and --overlap-grad-reduce, FSDP2 dp2;
dp2 with the distributed optimizer, --overlap-param-gather and 2000-element buckets (several per layer), fp32 over
3 steps and tensorwise FP8 with held weights over 4, on cpu and sim, the gathers deferred to their waits
(tests/training/test_compiled_param_gather.py): one graph per rank, 0 breaks, each layer's gathers waited before
its compiled forward while the other layer's are pending.
Also cp2 (one graph per rank) and MoE ep2 (4 graphs per rank, the token exchange eager), equal to eager's losses;
the delayed FP8 recipe at tp1 and tp2 with sequence parallelism (2 graphs per rank, equal losses).
--fp16 at tp1 (the dynamic loss scaler outside the layers): one graph, eager's losses within 2e-6 (one run,
2026-12-05; the test's bound 3e-4).

Compile caches: inductor's FX-graph and kernel caches (on by default, under ``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_<user>``) make a rerun with the same shapes skip code generation (4-layer h256 on
2 loaded cores: 9 s instead of 25-80 s, BENCHMARKS.md); point that variable at persistent storage to keep them.
Under compilation, dropout masks come from the compiler's generator: training with dropout is statistically,
not bitwise, the eager run (the hash masks of attention dropout under context parallelism excepted: eager's).
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

from omnitron.core.config import ConfigError
from omnitron.core.graph_state import mark_region
from omnitron.core.transformer.moe.layer import prepare_for_compile

log = logging.getLogger("omnitron.compile")

ENV_VAR = "OMNITRON_TORCH_COMPILE_BACKEND"
"""Overrides the device's ``torch.compile`` backend (tests set ``aot_eager``: tracing without code generation)."""


def compiler_for(backend) -> str:
    """The ``torch.compile`` backend this device supports (``capabilities().compiler``), or a one-line refusal."""
    compiler = backend.capabilities().compiler
    if compiler is not None and os.environ.get(ENV_VAR):
        return os.environ[ENV_VAR]
    if compiler is None:
        raise ConfigError(f"--torch-compile: the {backend.name} backend has no torch.compile support "
                          f"({backend.compile_unsupported_reason()}); drop --torch-compile")
    return compiler


def transformer_layers(modules: list[nn.Module]) -> list[nn.Module]:
    """Every transformer layer of the model chunks, in order (the regions that get compiled)."""
    from omnitron.core.transformer.layer import TransformerLayer

    return [m for chunk in modules for m in chunk.modules() if isinstance(m, TransformerLayer)]


def prepare_layers(modules: list[nn.Module], backend, compiler: str | None = None) -> tuple[list[nn.Module], str]:
    """The transformer layers to compile and the ``torch.compile`` backend, with everything a trace must not do
    first done now: the fused ops resolved, the MoE exchange's eager wrapper made. Refused in one line where the
    model has no such layer."""
    compiler = compiler or compiler_for(backend)
    layers = transformer_layers(modules)
    if not layers:
        raise ConfigError("--torch-compile: this model has no TransformerLayer to compile (regional compilation "
                          "covers the GPT-style decoder layers); drop --torch-compile")
    backend.kernels.table()  # resolve every fused op now: a first lookup while dynamo traces would break the graph
    prepare_for_compile()  # the MoE exchange's eager wrapper, made now that dynamo is wanted
    return layers, compiler


def compile_layers(modules: list[nn.Module], backend, compiler=None) -> int:
    """Compile the ``forward`` of every transformer layer of ``modules`` in place and mark each a graph region;
    returns how many. ``compiler``: a ``torch.compile`` backend (default: the device's own, e.g. ``"inductor"``;
    tests pass ``"aot_eager"`` to check tracing without code generation). Call it before the data-parallel
    wrapper is built: the wrapper puts its parameter-gather waits on the regions it finds."""
    layers, compiler = prepare_layers(modules, backend, compiler)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, backend=compiler, dynamic=False)
        mark_region(layer)
    log.info("--torch-compile: %d transformer layers compiled with %s (traced once on the first step)",
             len(layers), compiler)
    return len(layers)
