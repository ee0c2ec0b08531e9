"""The guards of graph capture and regional compilation that the training tests do not reach: which calls a
:class:`~omnitron.core.capture.CapturedForward` captures and under which key, the nesting of the capture flag,
the graph regions a nested marking yields, and the compiler refusal with the tests' backend override set.

A capture double stands in for a device with graphs: it records what it is handed and returns the callable
itself (as cpu's no-op capture does), so every output is compared with the plain layer's, in float64.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from omnitron.core.config import ConfigError


class _Layer(nn.Module):
    """A layer whose output depends on every argument it takes (a GPT layer's ``x, freqs, packed ids``)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))

    def forward(self, x, second=None, third=None):
        y = x @ self.w.to(x.dtype)
        if second is not None:
            y = y + second
        if third is not None:
            y = y * third
        return y


class _CaptureDouble:
    """Records ``(shapes, requires_grad flags, in_graph())`` of each capture; returns the callable (no graphs)."""

    def __init__(self) -> None:
        self.captured = []

    def capture(self, fn, sample_args):
        from omnitron.core.graph_state import in_graph

        self.captured.append(([tuple(a.shape) for a in sample_args], [a.requires_grad for a in sample_args],
                              in_graph()))
        return fn


def _wrapped():
    from omnitron.core.capture import CapturedForward

    torch.manual_seed(0)
    layer, double = _Layer(), _CaptureDouble()
    return layer, double, CapturedForward(layer, double)


def test_a_call_with_more_than_the_second_input_runs_eagerly_with_every_argument():
    """Three inputs (x, freqs, packed-document ids): not captured (the captured callable takes two), and the
    output is the layer's with all three, against the same maths written out in plain torch."""
    layer, double, wrapped = _wrapped()
    x, second, third = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    got = wrapped(x, second, third)
    want = (x @ layer.w.detach() + second) * third
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)  # the same three float64 ops in the same order
    assert double.captured == [] and wrapped.captures == 0


def test_graphs_are_keyed_by_requires_grad_too():
    """The same shapes with and without an input needing its gradient are two graphs (a device graph captures
    the backward it was warmed up with): two captures, each sample marked as its call's input."""
    _, double, wrapped = _wrapped()
    x = torch.randn(3, 4, dtype=torch.float64)
    wrapped(x.clone().requires_grad_(True))
    wrapped(x.clone())
    wrapped(x.clone())  # the second key again: replayed, not captured
    assert wrapped.captures == 2
    assert double.captured == [([(3, 4)], [True], True), ([(3, 4)], [False], True)]


def test_graphs_are_keyed_by_dtype_and_shape():
    _, double, wrapped = _wrapped()
    wrapped(torch.randn(3, 4, dtype=torch.float64))
    wrapped(torch.randn(5, 4, dtype=torch.float64))
    wrapped(torch.randn(3, 4, dtype=torch.float64))
    wrapped(torch.randn(3, 4, dtype=torch.float32))
    assert wrapped.captures == 3 and [c[0] for c in double.captured] == [[(3, 4)], [(5, 4)], [(3, 4)]]


def test_the_capture_flag_is_restored_after_a_nested_capture():
    """``capturing()`` inside ``capturing()``: the outer capture is still under way after the inner one ends."""
    from omnitron.core.graph_state import capturing, in_graph

    assert not in_graph()
    with capturing():
        with capturing():
            assert in_graph()
        assert in_graph()
    assert not in_graph()


def test_outer_regions_skip_regions_nested_at_any_depth():
    """A region inside a region's grandchild is not an outer region; a sibling region is."""
    from omnitron.core.graph_state import mark_region, outer_regions

    inner = nn.Linear(2, 2)
    outer = nn.Sequential(nn.Sequential(inner))  # inner two levels below outer
    sibling = nn.Linear(2, 2)
    model = nn.Sequential(outer, sibling)
    for m in (outer, inner, sibling):
        mark_region(m)
    assert [id(m) for m in outer_regions(model)] == [id(outer), id(sibling)]


def test_a_backend_without_a_compiler_is_refused_even_with_the_override_set(monkeypatch):
    """``OMNITRON_TORCH_COMPILE_BACKEND`` picks the compiler of a device that has one; it never makes a device
    without ``torch.compile`` support compile."""
    from omnitron.backends import get_backend
    from omnitron.core.compile import ENV_VAR, compiler_for

    from tests.training.test_torch_compile import NoCompiler

    monkeypatch.setenv(ENV_VAR, "aot_eager")
    with pytest.raises(ConfigError, match=r"^--torch-compile: the nocc backend .*drop --torch-compile$"):
        compiler_for(NoCompiler())
    assert compiler_for(get_backend("cpu")) == "aot_eager"


def _settings(*extra: str):
    from omnitron.core.training.arguments import parse_settings

    from test_torch_compile import _argv

    return parse_settings(_argv(*extra), 2)


def test_fsdp2_is_refused_with_a_captured_layer_in_one_line():
    with pytest.raises(ConfigError) as err:
        _settings("--cuda-graph-impl", "local", "--use-torch-fsdp2")
    assert str(err.value) == ("--cuda-graph-impl local: FSDP2 gathers parameters in module hooks outside the graph; "
                              "drop --use-torch-fsdp2")


def test_context_parallelism_without_attention_dropout_is_captured():
    """Only attention dropout's host-drawn seed makes cp refuse capture: cp2 with ``--attention-dropout 0`` is
    accepted, with the local implementation and the context-parallel size as given."""
    s = _settings("--cuda-graph-impl", "local", "--context-parallel-size", "2", "--attention-dropout", "0")
    assert (s.training.cuda_graph_impl, s.parallel.context_parallel_size) == ("local", 2)


def test_a_compiled_layer_is_specialized_to_each_shape_it_meets():
    """``compile_layers`` compiles with ``dynamic=False``: a second sequence length gets a graph of its own with
    concrete sizes (no symbolic shapes, which device graphs and the fused kernels' preconditions cannot take), and
    each graph computes the eager layer (a recording backend runs dynamo's graph op by op: float32 reorderings
    only, no change of ops, hence 1e-6 relative)."""
    from omnitron.core.compile import compile_layers
    from omnitron.core.graph_state import is_region

    from test_torch_compile import _layer

    torch._dynamo.reset()
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append([tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs])
        return gm.forward

    model, be = _layer(hidden_dropout=0.0, attention_dropout=0.0)
    layer = model.decoder.layers["0"]
    xs = [torch.randn(s, 2, 32, device=be.current_device()) for s in (8, 4)]
    with torch.no_grad():
        eager = [layer(x, None) for x in xs]
        assert compile_layers([model], be, compiler=recorder) == 1 and is_region(layer)
        compiled = [layer(x, None) for x in xs]
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(graphs) == 2
    assert all(not isinstance(d, torch.SymInt) for g in graphs for t in g
               for d in (t if isinstance(t, tuple) else (t,))), graphs
