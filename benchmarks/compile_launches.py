"""Kernel launches per training step, eager vs ``--torch-compile``, for a small GPT in bf16 and in FP8 (CPU).

What launches per step: one forward + backward + AdamW step of the model (tp 1, default kernel table), profiled
with ``torch.profiler`` after a warm-up step (the compile). Counted from the profile:

* ``aten``: aten operators entered from outside any other aten operator (each is one kernel call into the
  operator library: what a device would launch, give or take an op's internal launches);
* ``inductor``: calls of inductor-generated kernels: the kernels generated for the layer's forward and backward
  graphs (``torch._inductor.metrics.generated_kernel_count``; one graph pair shared by every layer, checked with
  dynamo's ``unique_graphs``) times the layers, each kernel called once per graph run (the profiler is not
  used for these: with ``cpp.enable_kernel_profile`` it showed 22 ``cpp_fused_*`` events of a bf16 step's 82);
* ``optimizer``: the aten operators of those under ``Optimizer.*`` (AdamW's step and zero_grad, eager in both);
* ``launches`` = aten + inductor, and ``compute`` = launches less the aten views and metadata-only operators
  (:data:`NO_KERNEL`: a device launches nothing for them).

bf16: the model in bfloat16 (params and activations). FP8: fp32 model, omnitron's tensorwise recipe (hybrid
format; the CPU emulates the FP8 GEMM) on every linear but the output layer.

    python benchmarks/compile_launches.py [--threads 2] [--json FILE]

``generated`` is split into the forward graph's kernels (``generated_fwd``: counted once the forward ran; the
backward graph is compiled at the first backward) and the rest. ``OMNITRON_FP8_PATH=scaled_mm`` traces the FP8
GEMMs as ``torch._scaled_mm`` (the GPU's path) instead of the CPU's emulation. Compiled FP8 holds the weights'
FP8 form outside the graphs as training does; ``OMNITRON_FP8_WEIGHT_IN_GRAPH=1`` quantizes them in the graph.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omnitron.core.compile import compile_layers  # noqa: E402
from omnitron.core.models.gpt import GPTConfig, GPTModel  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, vocab_size=1024,
             seq_length=128, max_position_embeddings=128, hidden_dropout=0.0, attention_dropout=0.0)
MICRO = 2
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
    "as_strided", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "chunk", "narrow", "unbind",
    "empty", "empty_like", "empty_strided", "lift_fresh", "numpy_T", "_has_compatible_shallow_copy_type",
    "is_nonzero", "item", "_local_scalar_dense", "flatten", "unflatten", "view_as", "expand_as", "movedim",
    "dim", "size", "stride", "resolve_conj", "resolve_neg"))
"""aten operators that are views or metadata: a device launches no kernel for them (``contiguous``, which copies
only sometimes, stays counted as a launch)."""


def build(precision: str, compiled: bool):
    """(model, step) for ``precision`` in {bf16, fp8}, layers compiled with inductor when ``compiled``."""
    from omnitron.core.precision.fp8 import enable_fp8
    from omnitron.core.precision.fp8.config import FP8Config

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = GPTModel(GPTConfig(**SHAPE, params_dtype=dtype), ParallelGroups.single(), seed=1).to(dtype)
    if precision == "fp8":
        enable_fp8([model], FP8Config(fp8_recipe="tensorwise"), ParallelGroups.single(), num_layers=2,
                   backend=model.backend)
    if compiled:
        compile_layers([model], model.backend, "inductor")
        if precision == "fp8":  # as training does: the weights' FP8 form held outside the graphs (static_weights.py)
            from omnitron.core.precision.fp8.static_weights import hold_static_weights

            hold_static_weights([model])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, SHAPE["vocab_size"], (MICRO, SHAPE["seq_length"]),
                           generator=torch.Generator().manual_seed(0))

    def step(after_forward=None) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=tokens).float().mean()
        if after_forward is not None:
            after_forward()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return model, step


def count(prof, inductor: int) -> dict:
    """aten operators called from outside any other aten operator, plus ``inductor`` kernel calls."""
    aten, optimizer, names = 0, 0, Counter()
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p, in_optimizer = e.cpu_parent, False
        while p is not None and not p.name.startswith("aten::"):
            in_optimizer = in_optimizer or p.name.startswith("Optimizer.")
            p = p.cpu_parent
        if p is None:
            aten += 1
            optimizer += in_optimizer
            names[e.name] += 1
    views = sum(n for name, n in names.items() if name in NO_KERNEL)
    return dict(aten=aten, inductor=inductor, launches=aten + inductor, compute=aten - views + inductor,
                optimizer=optimizer, top_aten=names.most_common(6), aten_by_name=dict(names))


def measure(precision: str, compiled: bool) -> dict:
    """One warm-up step, then one profiled step and the median of 3 timed steps."""
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    metrics.reset()
    _, step = build(precision, compiled)
    t, generated_fwd = time.perf_counter(), []
    step(lambda: generated_fwd.append(metrics.generated_kernel_count))  # the backward graph compiles lazily
    first = time.perf_counter() - t
    from torch._dynamo.utils import counters

    generated, graphs = metrics.generated_kernel_count, int(counters["stats"]["unique_graphs"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss = step()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return dict(count(prof, generated * SHAPE["num_layers"]), generated=generated, generated_fwd=generated_fwd[0],
                graphs=graphs, first_step_s=first, step_ms=1e3 * sorted(times)[1], loss=loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = {}
    for precision in ("bf16", "fp8"):
        for compiled in (False, True):
            r = out[f"{precision} {'compiled' if compiled else 'eager'}"] = measure(precision, compiled)
            print(f"{precision:4s} {'compiled' if compiled else 'eager':8s} launches {r['launches']:5d} compute "
                  f"{r['compute']:5d} (aten "
                  f"{r['aten']} of which optimizer {r['optimizer']}, inductor {r['inductor']}; "
                  f"generated {r['generated']} "
                  f"({r['generated_fwd']} forward), graphs {r['graphs']}) step {r['step_ms']:.0f} ms, "
                  f"first {r['first_step_s']:.1f} s, loss {r['loss']:.5f}; top {r['top_aten'][:4]}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
