"""The CPU training step side by side: omnitron eager, omnitron with ``--torch-compile``'s regional compilation,
and megatron-core's eager ``GPTModel`` (its local layer spec), the same model, in one process.

Two shapes (GPT-2 flavour: LayerNorm, GeLU, learned positions, tied embeddings, biases, no dropout):

* ``main``: the main job's model (``examples/moby_dick_tp2_pp2.yaml``: 4 layers, hidden 128, 4 heads, vocab 4096,
  sequence 64) and its step, 2 micro-batches of 16 (run here in one process, tp1 x pp1);
* ``bars``: the 4-layer hidden-256 step of ``benchmarks/compile_step.py`` (ffn 1024, vocab 4096, sequence 256,
  one micro-batch of 4).

Both run GeLU's tanh approximation, as Megatron-LM trains a GPT with biases by default (``--no-bias-gelu-fusion``
not given): omnitron's bias-GeLU, and megatron-core's ``bias_activation_fusion`` (its ``bias_gelu_impl``, whose
forward and backward functions its ``jit_fuser`` compiles with ``torch.compile``). Before 2026-12-05 04:50 UTC
megatron-core ran with that fusion off, which is the exact erf GeLU: a slightly different model.

megatron-core starts from omnitron's initial weights (the state-dict names are Megatron's), so the first step's
losses agree to fp32 reordering: the check that the three run the same model. Every model steps with
``torch.optim.AdamW`` (the same update); steps rotate over the three so machine noise hits all alike, the first
round (warm-up; inductor code generation) is left out and medians are reported, in wall-clock and in this
process's CPU seconds (less sensitive to other tenants of a shared machine).

megatron-core on CPU needs three stand-ins, none of them in the timed math: a one-process gloo group for its
parallel state, the explicit causal mask (its default one is made with ``device="cuda"``), a CPU allocation for
its attention's scratch buffer (``GlobalMemoryBuffer`` allocates on the current CUDA device) and a no-op for
its CUDA RNG tracker's fork (there is no dropout to draw). Run it where megatron-core is installed (a venv with
the system torch: ``python -m venv --system-site-packages V; V/bin/pip install megatron-core==0.16.1 --no-deps``):

    /work/venvs/mcore/bin/python benchmarks/compile_vs_megatron.py [--shapes main bars] [--steps 6] [--threads 2]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.compile_step import alternate  # noqa: E402
from omnitron.core.compile import compile_layers  # noqa: E402
from omnitron.core.models.gpt import GPTConfig, GPTModel  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

SHAPES = {
    "main": dict(model=dict(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, vocab_size=4096,
                            seq_length=64), micro=16, micro_batches=2),
    "bars": dict(model=dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=4096,
                            seq_length=256), micro=4, micro_batches=1),
}


def megatron_core_cpu() -> None:
    """megatron-core's parallel state over a one-process gloo group, and its CUDA-only helpers made CPU ones."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core import utils as mcu
    from megatron.core.tensor_parallel import random as mcr

    def cpu_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
        n = 1
        for d in tensor_shape:
            n *= d
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < n:
            buf = self.buffer[(name, dtype)] = torch.empty(n, dtype=dtype)
        return buf[:n].view(*tensor_shape)

    mcu.GlobalMemoryBuffer.get_tensor = cpu_buffer
    mcr.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def megatron_core_gpt(shape: dict, like: GPTModel):
    """megatron-core's GPTModel of ``shape`` (local spec, fp32, CPU) holding ``like``'s weights."""
    from megatron.core.models.gpt import GPTModel as McoreGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = shape["model"]
    cfg = TransformerConfig(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                            num_attention_heads=m["num_attention_heads"], ffn_hidden_size=m["ffn_hidden_size"],
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            bias_activation_fusion=True, masked_softmax_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)
    model = McoreGPT(cfg, get_gpt_layer_local_spec(), vocab_size=m["vocab_size"], max_sequence_length=m["seq_length"],
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    missing = [k for k in like.state_dict() if k not in model.state_dict()]
    if missing:
        raise RuntimeError(f"megatron-core's GPTModel lacks {missing[:3]}: the two models differ")
    model.load_state_dict(like.state_dict(), strict=False)
    return model


def step_fn(shape: dict, forward, params, own=None):
    """One AdamW step over ``shape``'s micro-batches of fixed random tokens; ``forward(tokens)`` -> per-token loss.
    ``own``: an omnitron model stepped by its own optimizer (what ``omnitron train`` runs:
    :class:`omnitron.core.optim.optimizer.MixedPrecisionOptimizer`, the registry's fused ``adamw_step``, the
    gradient norm and clipping at Megatron's default 1.0) instead of ``torch.optim.AdamW``."""
    opt = torch.optim.AdamW(params, lr=1e-4) if own is None else _own_optimizer(own)
    gen = torch.Generator().manual_seed(0)
    m = shape["model"]
    batches = [torch.randint(0, m["vocab_size"], (shape["micro"], m["seq_length"]), generator=gen)
               for _ in range(shape["micro_batches"])]

    def step() -> float:
        opt.zero_grad(set_to_none=True) if own is None else opt.zero_grad()
        total = 0.0
        for tokens in batches:
            loss = forward(tokens).mean() / len(batches)
            loss.backward()
            total += float(loss.detach())
        opt.step() if own is None else opt.step(1e-4)
        return total

    return step


def _own_optimizer(model):
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim.optimizer import MixedPrecisionOptimizer

    return MixedPrecisionOptimizer(list(model.named_parameters()), OptimizerConfig(), model.groups,
                                   backend=model.backend)


def measure(shape: dict, rounds: int) -> dict:
    """Median step (wall, CPU seconds) of omnitron eager / compiled and megatron-core eager on ``shape``."""
    m = shape["model"]
    cfg = GPTConfig(**m, max_position_embeddings=m["seq_length"], hidden_dropout=0.0, attention_dropout=0.0)
    eager = GPTModel(cfg, ParallelGroups.single(), seed=1)
    compiled = copy.deepcopy(eager)
    compile_layers([compiled], compiled.backend)
    own = copy.deepcopy(eager)
    compile_layers([own], own.backend)
    mcore = megatron_core_gpt(shape, eager)
    s = m["seq_length"]
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    pos = torch.arange(s)[None]
    steps = {"omnitron eager": step_fn(shape, lambda t: eager(t, labels=t), eager.parameters()),
             "omnitron compiled": step_fn(shape, lambda t: compiled(t, labels=t), compiled.parameters()),
             "megatron-core eager": step_fn(shape, lambda t: mcore(t, pos.expand_as(t), mask, labels=t),
                                            mcore.parameters()),
             "omnitron compiled, own optimizer": step_fn(shape, lambda t: own(t, labels=t), None, own=own)}
    times, cpu, losses = alternate(steps, rounds)
    out = {k: {"wall_s": statistics.median(v[1:]), "cpu_s": statistics.median(cpu[k][1:]), "first_s": v[0],
               "losses": losses[k]} for k, v in times.items()}
    out["compiled_over_megatron_core"] = out["omnitron compiled"]["wall_s"] / out["megatron-core eager"]["wall_s"]
    out["own_step_over_megatron_core"] = (out["omnitron compiled, own optimizer"]["wall_s"] /
                                          out["megatron-core eager"]["wall_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    megatron_core_cpu()
    results = {}
    for name in a.shapes:
        res = results[name] = measure(SHAPES[name], a.steps)
        base = res["megatron-core eager"]["wall_s"]
        print(f"{name}: ms/step (CPU s) | x megatron-core | first-step loss")
        for k, v in res.items():
            if isinstance(v, dict):
                print(f"  {k:32s} {v['wall_s'] * 1e3:7.0f} ({v['cpu_s']:.2f}) | {v['wall_s'] / base:.2f}x | "
                      f"{v['losses'][0]:.5f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
