"""``omnitron bench all --out DIR``: the whole suite, one report per kind in ``DIR`` (``memory.json``,
``gemm.json``, ``comm.json``, ``kernels.json``, ``attention.json``, ``elementwise.json``, ``train.json``), sized
for under 8 minutes on one GPU and under 10 on a 2-core CPU, so a vendor runs one command and sends back one folder.

Sizes per device kind: on the CPU small problems and a tiny GPT at tp2; on an accelerator large problems,
the 1.3B GPT's GEMM shapes and its training step on one device.
"""
from __future__ import annotations

import os
import time

from omnitron.bench import attention, comm, elementwise, gemm, memory, train
from omnitron.bench.report import ROW_FIELDS, new_report, save

CPU = {"memory": [1 << 16, 1 << 20, 1 << 24, 1 << 28], "gemm": [256, 1024, 2048], "gemm_model": ("gpt2_tiny", 2048),
       "comm": (1 << 10, 1 << 26, 4), "kernels": "small", "attention": [512, 2048],
       "elementwise": [1 << 14, 1 << 18, 1 << 22], "train": (
           "gpt2_tiny", "tp2", 10, ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096",
                                    "--num-workers", "0", "--seq-length", "128", "--max-position-embeddings", "128",
                                    "--micro-batch-size", "4", "--global-batch-size", "8"])}
DEVICE = {"memory": [1 << 20, 1 << 26, 1 << 30], "gemm": [1024, 4096, 8192], "gemm_model": ("gpt_1p3b", 8192),
          "comm": (1 << 10, 1 << 30, 4), "kernels": "large", "attention": [1024, 4096, 8192],
          "elementwise": [1 << 16, 1 << 22, 1 << 26], "train": (
              "gpt_1p3b", "single", 8, ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50256",
                                        "--num-workers", "0", "--bf16", "--micro-batch-size", "4",
                                        "--global-batch-size", "16", "--hidden-dropout", "0", "--attention-dropout",
                                        "0"])}


KINDS = tuple(ROW_FIELDS)
"""The reports ``run_all`` writes, in its order: every kind of the report schema."""


def run_all(backend, out_dir: str, *, nproc: int | None = None, log=print) -> dict[str, str]:
    """Every kind into ``out_dir``; returns {kind: path}. A kind that fails is logged and left out."""
    sz = CPU if backend.device_type == "cpu" else DEVICE
    nproc = nproc or (2 if backend.device_type == "cpu" else max(backend.device_count(), 1))
    written = {}

    def one(kind, fn, **extra):
        t0 = time.perf_counter()
        try:
            rows = fn()
            if isinstance(rows, tuple):  # (rows, more of the report's extra)
                rows, more = rows
                extra.update(more)
            # rows a kind cannot check against the schema are that kind's failure, not the suite's
            rep = new_report(kind, backend, rows, world_size=nproc if kind == "comm" else 1, **extra)
        except Exception as err:  # noqa: BLE001 - one kind failing must not lose the others' figures
            log(f"bench all: {kind} failed: {type(err).__name__}: {err}")
            return
        written[kind] = save(rep, os.path.join(out_dir, f"{kind}.json"))
        log(f"bench all: {kind}: {len(rows)} rows in {time.perf_counter() - t0:.0f} s -> {written[kind]}")

    one("memory", lambda: memory.run(backend, byte_sizes=sz["memory"], log=lambda *_: None))
    copy = memory.copy_gbs(_rows(written.get("memory")))
    model, tokens = sz["gemm_model"]
    one("gemm", lambda: gemm.run(backend, sizes=sz["gemm"], dtypes=list(gemm.DTYPES), model=model, tokens=tokens,
                                 rounds=5, budget_s=1.0, log=lambda *_: None))
    lo, hi, factor = sz["comm"]
    one("comm",
        lambda: comm.run(backend.name, nproc=nproc, ops=comm.OPS + comm.HOST_OPS, byte_sizes=comm.sizes(lo, hi, factor),
                                 rounds=5, budget_s=0.5))
    one("kernels", lambda: _kernels(backend, sz["kernels"]), copy_gbs=copy, size=sz["kernels"])
    one("attention", lambda: attention.run(backend, seqs=sz["attention"], log=lambda *_: None))
    import torch

    ew_dtype = torch.float32 if backend.device_type == "cpu" else torch.bfloat16
    one("elementwise", lambda: elementwise.run(backend, sizes=sz["elementwise"], dtype=ew_dtype, log=lambda *_: None))
    name, layout, iters, flags = sz["train"]
    one("train", lambda: [train.run(model=name, layout=layout, iterations=iters, extra=flags, backend=backend.name)])
    return written


def _kernels(backend, size: str) -> tuple[list[dict], dict]:
    """The kernels report's rows, and which implementations the engine tries per op (its ``resolved``)."""
    import torch

    from omnitron.kernels.benchmark import run

    dtypes = [torch.float32] if backend.device_type == "cpu" else [torch.bfloat16]
    report = run(backend, ops=None, dtypes=dtypes, size=size, compile_=False, rounds=5, budget_s=0.5,
                 log=lambda *_: None)
    return report["rows"], {"resolved": report["resolved"]}


def _rows(path: str | None) -> list[dict]:
    if path is None:
        return []
    from omnitron.bench.report import load

    return load(path)["rows"]
