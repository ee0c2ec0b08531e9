"""``omnitron bench train``: a few iterations of a named config under a layout, through ``omnitron train``.

Figures per run (the iterations after the first, which builds caches and warms up):

* tokens/s and TFLOP/s per device under one formula, Megatron's as it was (attention scores non-causal, logits
  counted: :func:`omnitron.core.models.gpt.config.flops_per_iteration`), and beside it the causal-halved
  figure, which is the training log's (Megatron's current count; for MoE, MLA and MTP models, which
  ``flops_per_iteration`` counts by Megatron's current formula, the two are equal); MFU against the backend's
  peak for the run's dtype where the backend knows it;
* peak memory (the backend's statistics, largest over ranks: the run's ``mem_max_allocated_bytes`` of
  ``--log-memory-to-tensorboard``; the log's ``peak_memory_bytes`` is rank 0's alone, and pipeline stages differ);
* the time split of a step from the run's own timers (``--timing-log-level 2``): compute (forward and
  backward actions; synchronous devices only), communication (gradient reduction and parameter gather),
  pipeline wait, optimizer.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

LAYOUT_KEYS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
               "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size"}


def parse_layout(layout: str) -> tuple[dict[str, int], int]:
    """``"tp2,pp2,dp2"`` -> ({"tp": 2, "pp": 2, "dp": 2}, world 8); a missing dimension is 1. ``"single"`` (the
    name the reports give a one-device run, and `bench all`'s accelerator layout) is every dimension 1."""
    out = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1}
    if layout.strip().lower() == "single":
        return out, 1
    for part in filter(None, re.split(r"[,x ]+", layout.strip().lower())):
        m = re.fullmatch(r"(tp|pp|cp|ep|dp)(\d+)", part)
        if not m:
            raise ValueError(f"--layout {layout!r}: {part!r} is not tpN, ppN, cpN, epN or dpN")
        out[m.group(1)] = int(m.group(2))
    world = out["tp"] * out["pp"] * out["cp"] * out["dp"]
    return out, world


def _split(rec: dict) -> dict:
    def ms(*names):
        vals = [rec.get(f"timers_{n}_ms") for n in names]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    return {"compute_ms": ms("forward_compute", "backward_compute"),
            "communication_ms": ms("all_grads_sync", "params_all_gather"),
            "pipeline_wait_ms": ms("pipeline_wait"), "optimizer_ms": ms("optimizer")}


def _peak_memory(recs: list[dict]) -> int | None:
    """The run's peak memory, the largest over ranks and iterations (rank 0's where the backend gave no other)."""
    for key in ("mem_max_allocated_bytes", "peak_memory_bytes"):
        values = [r[key] for r in recs if r.get(key)]
        if values:
            return int(max(values))
    return None


def _flops_ratio(settings) -> float:
    """Causal-halved FLOPs / Megatron's FLOPs for the run's model (vocabulary from its tokenizer, padded for the
    run's tensor-parallel size as the training log's count is: padding for tp 1 put the two counts ~1e-4 apart on
    large models, and more on small ones)."""
    from dataclasses import replace

    from omnitron.core.data import build_tokenizer
    from omnitron.core.data.tokenizers import tokenizer_kwargs
    from omnitron.core.models.gpt.config import flops_per_iteration

    d = settings.data
    tok = build_tokenizer(**tokenizer_kwargs(d))
    cfg = replace(settings.model, vocab_size=tok.vocab_size)
    b, tp = settings.training.global_batch_size, settings.parallel.tensor_model_parallel_size
    return flops_per_iteration(cfg, b, causal=True, tp=tp) / flops_per_iteration(cfg, b, tp=tp)


def run(*, model: str, layout: str, iterations: int, extra: list[str], backend: str | None = None,
        timeout_s: float = 600.0) -> dict:
    """One row: train ``iterations`` steps of preset ``model`` under ``layout`` and read its metrics."""
    from omnitron.core.training.arguments import parse_settings

    dims, world = parse_layout(layout)
    flags = ["--model", model, "--train-iters", str(iterations), "--log-interval", "1", "--timing-log-level", "2",
             "--log-throughput", "--log-memory-to-tensorboard", "--no-tensorboard", "--eval-interval", "0",
             "--nproc-per-node", str(world)]
    for key, flag in LAYOUT_KEYS.items():
        if dims[key] > 1:
            flags += [flag, str(dims[key])]
    flags += (["--backend", backend] if backend else []) + list(extra)
    settings = parse_settings(flags, world)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *flags, "--log-dir", tmp], text=True,
                              capture_output=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"omnitron train {' '.join(flags)} failed: {tail[0]}")
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            recs = [json.loads(line) for line in f if line.strip() and "lm_loss" in line]
    steady = recs[1:] or recs
    step_ms = statistics.median(r["step_time_s"] for r in steady) * 1e3
    ratio = _flops_ratio(settings)  # NOTE: the log's TFLOP/s and MFU count causal scores: / ratio gives the other
    tflops = statistics.median(r["tflops_per_device"] for r in steady) / ratio
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = statistics.median(mfus) / ratio if mfus else None
    splits = [_split(r) for r in steady]
    split = {k: (statistics.median(v) if (v := [s[k] for s in splits if s[k] is not None]) else None)
             for k in splits[0]}
    return {"model": model, "layout": ",".join(f"{k}{v}" for k, v in dims.items() if v > 1) or "single",
            "world_size": world, "dtype": settings.precision.params_dtype_name,
            "global_batch_size": settings.training.global_batch_size, "seq_length": settings.model.seq_length,
            "iterations": iterations, "step_ms": step_ms,
            "tokens_per_s": statistics.median(r["tokens_per_sec"] for r in steady),
            "tflops_per_device": tflops, "tflops_per_device_causal": tflops * ratio, "mfu": mfu,
            "mfu_causal": mfu * ratio if mfu is not None else None,
            "peak_memory_bytes": _peak_memory(recs), **split,
            "extra_flags": " ".join(extra)}
