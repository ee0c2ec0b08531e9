"""``--cuda-graph-impl local`` (Megatron's flag; ``--enable-cuda-graph`` is its older spelling): the forward and
backward of every transformer layer captured once as device graphs through :meth:`Backend.capture` and replayed
on every later training call with the same shapes, so a layer's many small launches (the FP8 casts, norms,
activations) cost one graph launch each way.

Capture is lazy: a layer's first training call (grad enabled, training mode) captures it with that call's
shapes; validation and generation run the eager forward (the compiled one under ``--torch-compile``). A layer
is captured with its second input (a GPT layer's ``freqs``, a BERT layer's padding mask: BERT, T5's encoder, the
vision encoder); calls with more (packed-document ids, T5's decoder's memory) run uncaptured. What the
captured code must not do, since no Python runs on replay: swap generator states (the tensor-parallel RNG fork)
or consult host-side caches (the FP8 weight cache). While a capture is under way :func:`in_graph` is True, as it is
while dynamo traces, and those sites take their traceable form (explicit dropout masks from the default generator, the
FP8 weight read from its held tensors or re-quantized in the graph).

Refused (one line each, :func:`check_settings`, as Megatron refuses its own incompatible options): both
spellings at once; an implementation other than ``local``; pipeline parallelism (each in-flight micro-batch would
need its own graph, since a replay overwrites the static activations of the previous one); activation
recomputation; the ``delayed`` FP8 recipe (its amax history is Python state
updated per call); MoE without ``--moe-expert-capacity-factor`` (data-dependent shapes); FSDP2 (module hooks);
context parallelism with attention dropout (its hash masks' seed is drawn on the host per call,
:meth:`~omnitron.core.parallel.tensor.random.RNGTracker.hash_seed`: a replay would reuse the captured seed);
backends whose ``capabilities().graph_capture`` is False (cpu, sim: no device graphs; :func:`capture_layers`).

With ``--torch-compile`` (Megatron graphs Transformer Engine's fused layers the same way) each layer's forward is
compiled (:func:`omnitron.core.compile.prepare_layers`, one dynamo graph shared by every layer) and the compiled
forward is what gets captured: the fused kernels keep their fusion and lose their launches, the AOTAutograd
wrappers and dynamo's guard checks. Sound because (a) the capture's warm-up iterations run the compiled forward
and backward with the sample's shapes first, so dynamo and inductor compile (and autotune) before the capture
begins; a compilation under capture fails loudly on CUDA (torch issues #131782, #167639: dynamo reads the
generator state; on ROCm it is silently wrong, #185074); (b) nothing a guard checks changes between replays:
shapes, dtypes and ``requires_grad`` key the graphs as without compilation, only training calls with grad
enabled are captured, the capture flag itself is never read while dynamo traces (:func:`in_graph`), and the one
Python flag a layer reads per step (the delayed recipe's ``AmaxReducer.primed``) belongs to a refused recipe;
(c) the compiled layer has no graph break (tested), so no Python runs between its kernels that a replay would
skip; tensorwise / blockwise FP8 read the weights' FP8 form from tensors refreshed in place before the layers run
(:mod:`omnitron.core.precision.fp8.static_weights`), or without them re-quantize the weight in the graph. Refused
besides: MoE, whose token exchange runs eagerly between a compiled layer's graphs and reads the routing's sizes on the
host.

Each captured layer is a graph region (:func:`omnitron.core.graph_state.mark_region`): its own hooks run eagerly
before the captured forward, ``--overlap-param-gather``'s waits for all its parameters' gathers first, then its FP8
weight refresh; its submodules get no waiter (a replay runs no Python, so a wait inside would be skipped).
"""
from __future__ import annotations

import torch
from torch import nn

from omnitron.core.config import ConfigError
from omnitron.core.graph_state import capturing, in_graph, mark_region  # noqa: F401 - in_graph re-exported

IMPLS = ("none", "local")


def resolve_impl(cuda_graph_impl: str, enable_cuda_graph: bool) -> str:
    """The implementation asked for: ``--enable-cuda-graph`` means ``local``; both at once is refused."""
    if enable_cuda_graph and cuda_graph_impl != "none":
        raise ConfigError("--enable-cuda-graph with --cuda-graph-impl: --enable-cuda-graph is the older spelling of "
                          "--cuda-graph-impl local; give one of them")
    impl = "local" if enable_cuda_graph else cuda_graph_impl
    if impl not in IMPLS:
        raise ConfigError(f"--cuda-graph-impl {impl!r}: omnitron captures with its own 'local' implementation "
                          f"(transformer_engine and full_iteration are not available); use --cuda-graph-impl local")
    return impl


def check_settings(training, model, parallel, fp8, ddp) -> None:
    """Refuse the options a per-layer graph cannot run with (module docstring), one line each."""
    if training.cuda_graph_impl == "none":
        return
    flag = "--cuda-graph-impl local"
    checks = [
        (parallel.pipeline_model_parallel_size > 1, "pipeline parallelism keeps several micro-batches in flight and "
         "a replay overwrites the previous one's activations; use --pipeline-model-parallel-size 1"),
        (getattr(model, "recompute_granularity", None) is not None,
         "activation recomputation re-runs the forward inside the backward; drop --recompute-granularity"),
        (training.torch_compile and getattr(model, "num_experts", None), "with --torch-compile the MoE token "
         "exchange runs eagerly between the compiled graphs and reads its sizes on the host; drop --torch-compile"),
        (fp8 is not None and fp8.fp8_recipe == "delayed", "the delayed FP8 recipe updates its amax history in Python "
         "on every call; use --fp8-recipe tensorwise or blockwise"),
        (getattr(model, "num_experts", None) and getattr(model, "moe_expert_capacity_factor", None) is None,
         "dropless MoE routing has data-dependent shapes; set --moe-expert-capacity-factor"),
        (ddp is not None and getattr(ddp, "use_torch_fsdp2", False), "FSDP2 gathers parameters in module hooks "
         "outside the graph; drop --use-torch-fsdp2"),
        (parallel.context_parallel_size > 1 and (getattr(model, "attention_dropout", 0.0) or 0.0) > 0.0,
         "context parallelism's attention dropout seeds its masks on the host at each call and every replay would "
         "repeat the captured call's masks; set --attention-dropout 0 or --context-parallel-size 1"),
    ]
    for bad, why in checks:
        if bad:
            raise ConfigError(f"{flag}: {why}")


class CapturedForward:
    """Stands in for one layer's ``forward``: ``run`` (the eager forward, or the compiled one under
    ``--torch-compile``) outside training, else the graphed callable of ``run`` captured for this call's shapes
    (captured on first use)."""

    def __init__(self, layer: nn.Module, backend, run=None) -> None:
        self.layer, self.backend, self.eager = layer, backend, run or layer.forward
        self.graphs: dict[tuple, object] = {}
        self.captures = 0

    def __call__(self, x: torch.Tensor, *rest) -> torch.Tensor:
        """``rest``: what the layer takes after ``x``, passed on as given: a GPT layer's ``freqs`` (or None), a
        BERT layer's padding mask (BERT, T5's encoder, the vision encoder); a call with more (a GPT layer's
        packed-document ids, T5's decoder's memory and its mask) runs ``run`` uncaptured."""
        if len(rest) > 1 or not (self.layer.training and torch.is_grad_enabled()):
            return self.eager(x, *rest)
        args = (x,) if not rest or rest[0] is None else (x, rest[0])
        key = tuple((tuple(a.shape), a.dtype, a.requires_grad) for a in args)
        graphed = self.graphs.get(key)
        if graphed is None:
            sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
            with capturing():
                graphed = self.graphs[key] = self.backend.capture(_Call(self.eager, self.layer), sample)
            self.captures += 1
        return graphed(*args)


class _Call(nn.Module):
    """``forward(x[, second])`` of a layer as a module holding its parameters (what graph capture takes)."""

    def __init__(self, forward, layer: nn.Module) -> None:
        super().__init__()
        self.fn, self.layer = forward, layer

    def forward(self, x: torch.Tensor, second: torch.Tensor | None = None) -> torch.Tensor:
        return self.fn(x, second)


def capture_layers(modules: list[nn.Module], backend, compiled: bool = False,
                   compiler: str | None = None) -> list[CapturedForward]:
    """Replace every transformer layer's ``forward`` by a :class:`CapturedForward` of the eager forward, or with
    ``compiled`` of the forward compiled by ``torch.compile`` (``compiler``: the device's own unless given);
    refused in one line where the backend has no device graphs."""
    from omnitron.core.compile import prepare_layers, transformer_layers

    if not backend.capabilities().graph_capture:
        raise ConfigError(f"--cuda-graph-impl local: the {backend.name} backend has no device graphs "
                          f"(capabilities().graph_capture is False); drop --cuda-graph-impl")
    layers, compiler = prepare_layers(modules, backend, compiler) if compiled else (transformer_layers(modules), None)
    out = []
    for layer in layers:
        run = torch.compile(layer.forward, backend=compiler, dynamic=False) if compiled else None
        layer.forward = CapturedForward(layer, backend, run)
        mark_region(layer)  # its hooks (parameter-gather waits, FP8 refresh) run before each replay, not inside
        out.append(layer.forward)
    return out
