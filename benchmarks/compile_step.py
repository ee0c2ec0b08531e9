"""``--torch-compile`` on CPU: the 4-layer hidden-256 GPT training step eager vs regionally compiled.

Two copies of the same model (tp=1, default kernel table) step with ``torch.optim.AdamW``; the second has its
layers compiled with :func:`omnitron.core.compile.compile_layers` (inductor unless ``--compiler``). Steps
alternate between the two so machine noise hits both alike; the median step is reported in wall-clock and in
this process's CPU seconds (less sensitive to other tenants of a shared machine), and the compiled model's
first step minus the eager median as the compile time.

With ``--fp8``: three models instead, fp32 eager, FP8 tensorwise eager and FP8 tensorwise compiled (the CPU emulates
the FP8 GEMMs; the compiled model's weights held outside its graphs as training holds them), each step's time
against fp32 eager's: what the emulation costs eager and what is left of it once the casts are fused.

    python benchmarks/compile_step.py [--steps 6] [--threads 2] [--compiler inductor] [--fp8] [--json FILE]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omnitron.core.compile import compile_layers  # noqa: E402
from omnitron.core.models.gpt import GPTConfig, GPTModel  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

SHAPE = dict(num_layers=4, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=4096,
             seq_length=256, max_position_embeddings=256, hidden_dropout=0.0, attention_dropout=0.0)
MICRO = 4


def step_fn(model: GPTModel):
    """One AdamW training step of ``model`` on fixed random tokens; returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, SHAPE["vocab_size"], (MICRO, SHAPE["seq_length"]), generator=gen)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=tokens).mean()
        loss.backward()
        opt.step()
        return float(loss)

    return step


def alternate(steps: dict, rounds: int) -> tuple[dict, dict, dict]:
    """Run ``rounds + 1`` rounds of every step callable in turn (the first round: warm-up, tracing, compiling),
    so machine noise hits all alike: per name, (wall seconds, this process's CPU seconds, losses) per round."""
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    losses: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds + 1):
        for name, step in steps.items():
            t, c = time.perf_counter(), time.process_time()
            losses[name].append(step())
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return times, cpu, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiler", default=None, help="torch.compile backend (default: the device's, inductor)")
    ap.add_argument("--fp8", action="store_true", help="fp32 eager, FP8 eager and FP8 compiled side by side")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.fp8:
        return fp8_main(a)
    eager = GPTModel(GPTConfig(**SHAPE), ParallelGroups.single(), seed=1)
    compiled = copy.deepcopy(eager)
    compile_layers([compiled], compiled.backend, a.compiler)
    steps = {"eager": step_fn(eager), "compiled": step_fn(compiled)}
    times, cpu, losses = alternate(steps, a.steps)
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    out.update({f"{k}_cpu": statistics.median(v[1:]) for k, v in cpu.items()})
    out.update(compile_s=times["compiled"][0] - out["eager"], times=times, cpu=cpu, losses=losses)
    print(f"eager {out['eager'] * 1e3:.0f} ms/step ({out['eager_cpu']:.2f} CPU s), compiled "
          f"{out['compiled'] * 1e3:.0f} ms/step ({out['compiled_cpu']:.2f} CPU s): "
          f"{out['eager'] / out['compiled']:.2f}x "
          f"wall, {out['eager_cpu'] / out['compiled_cpu']:.2f}x CPU; compile {out['compile_s']:.1f} s; "
          f"last losses {losses['eager'][-1]:.5f} / {losses['compiled'][-1]:.5f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


def fp8_model(model: GPTModel, compiler: str | None = None, held: bool = True) -> int:
    """Tensorwise FP8 on ``model``'s linears; with ``compiler`` its layers compiled and (``held``) their weights'
    FP8 form held outside the graphs, as training does. Returns how many weights are held."""
    from omnitron.core.precision.fp8 import enable_fp8
    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.core.precision.fp8.static_weights import hold_static_weights

    enable_fp8([model], FP8Config(fp8_recipe="tensorwise"), ParallelGroups.single(), num_layers=SHAPE["num_layers"],
               backend=model.backend)
    if compiler is None:
        return 0
    compile_layers([model], model.backend, compiler)
    return hold_static_weights([model]) if held else 0


def fp8_main(a) -> None:
    """fp32 eager, FP8 tensorwise eager and FP8 tensorwise compiled, stepping alternately."""
    fp32 = GPTModel(GPTConfig(**SHAPE), ParallelGroups.single(), seed=1)
    fp8_eager, fp8_compiled = copy.deepcopy(fp32), copy.deepcopy(fp32)
    fp8_model(fp8_eager)
    held = fp8_model(fp8_compiled, a.compiler or "inductor")
    steps = {"fp32 eager": step_fn(fp32), "fp8 eager": step_fn(fp8_eager), "fp8 compiled": step_fn(fp8_compiled)}
    times, cpu, losses = alternate(steps, a.steps)
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    base = out["fp32 eager"]
    for k in steps:
        print(f"{k:13s} {out[k] * 1e3:7.0f} ms/step ({statistics.median(cpu[k][1:]):.2f} CPU s)  "
              f"{out[k] / base:.2f}x fp32 eager  last loss {losses[k][-1]:.5f}")
    out.update(held_fp8_weights=held, times=times, cpu=cpu, losses=losses)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
