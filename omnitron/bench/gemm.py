"""``omnitron bench gemm``: matrix-multiply throughput per dtype, against the backend's peak.

Square sizes and, with ``--model NAME``, the GEMMs of that preset's layer (QKV, attention projection,
fc1, fc2 at ``tokens`` rows; the weight-gradient of fc1). Dtypes: fp32, tf32 (where the bench can switch it on:
``torch.backends.cuda.matmul.allow_tf32``; on a backend whose float32 GEMMs run in TF32 anyway, capabilities
``fp32_matmul``, the fp32 row says so, is set against TF32's peak and its ``math`` is tf32), bf16, fp16, and
FP8 through the backend's FP8 provider: per-tensor and row-wise scaled GEMMs and block-wise (1x128 by 128x128
tiles). TFLOP/s = 2mnk / time; ``math`` the arithmetic whose peak ``pct_peak`` divides by.
On a backend whose FP8 path is the emulation the FP8 rows time the emulation (the ``note`` says so).
"""
from __future__ import annotations

import torch

from omnitron.bench.timing import median_ms

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8-tensor", "fp8-row", "fp8-block")
_TORCH = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_shapes(model: str, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of ``[m,k] @ [k,n]`` for one layer of preset ``model`` (its tensor-parallel size 1)."""
    from omnitron.core.models.family import get_family
    from omnitron.core.models.gpt.config import ffn_size, head_dim, query_groups

    cfg = get_family("gpt").presets[model]()
    h, f = cfg.hidden_size, ffn_size(cfg)
    qkv = (cfg.num_attention_heads + 2 * query_groups(cfg)) * head_dim(cfg)
    fc1 = 2 * f if cfg.swiglu else f
    return [(f"{model}:qkv", tokens, qkv, h), (f"{model}:proj", tokens, h, cfg.num_attention_heads * head_dim(cfg)),
            (f"{model}:fc1", tokens, fc1, h), (f"{model}:fc2", tokens, h, f), (f"{model}:fc1-wgrad", fc1, h, tokens)]


def _fp8_call(kind: str, a, b, provider):
    """A closure timing one FP8 GEMM of ``kind``. Quantization, the dequantization factors and the right operand's
    column-major layout (what ``torch._scaled_mm`` takes, and what the FP8 linear's cast-transpose writes) are done
    once, outside the timing: until 2026-12-04 the per-tensor and row-wise rows also timed a transposing copy of
    ``b`` and two reciprocals per call (they read 0.29-0.47 of the H200's FP8 peak on 2026-12-04, against
    0.42-0.73 for the GEMM alone in ``benchmarks/fp8_gemm.py`` and a step's profile; not re-measured since)."""
    fmt = "e4m3"
    if kind == "fp8-block":
        qa, sa = provider.quantize_blocks(a, fmt, (1, 128))
        qb, sb = provider.quantize_blocks(b, fmt, (128, 128))
        return lambda: provider.blockwise_mm(qa, sa, (1, 128), qb, sb, (128, 128), out_dtype=torch.bfloat16)
    from omnitron.backends.fp8 import scale_from_amax

    if kind == "fp8-row":
        sa = scale_from_amax(a.abs().amax(dim=1, keepdim=True).float(), fmt)
        sb = scale_from_amax(b.abs().amax(dim=0, keepdim=True).float(), fmt)
    else:
        sa, sb = scale_from_amax(a.abs().amax().float(), fmt), scale_from_amax(b.abs().amax().float(), fmt)
    from omnitron.backends.fp8 import cast_to_fp8

    qa, qb = cast_to_fp8(a, fmt, sa), cast_to_fp8(b, fmt, sb).t().contiguous().t()
    ia, ib = sa.reciprocal(), sb.reciprocal()
    return lambda: provider.scaled_mm(qa, qb, ia, ib, out_dtype=torch.bfloat16)


def bench_one(backend, dtype: str, m: int, n: int, k: int, *, rounds: int, budget_s: float) -> tuple[float, str]:
    """(ms, note) of one ``[m,k] @ [k,n]`` GEMM in ``dtype``."""
    dev = backend.current_device()
    gen = torch.Generator(device="cpu").manual_seed(0)
    a32 = torch.randn(m, k, generator=gen).to(dev)
    b32 = torch.randn(k, n, generator=gen).to(dev)
    note = ""
    if dtype.startswith("fp8"):
        provider = backend.fp8
        fn = _fp8_call(dtype, a32.bfloat16(), b32.bfloat16(), provider)
        path = provider.block_path if dtype == "fp8-block" else provider.path
        note = f"FP8 path: {path}"
    else:
        a, b = a32.to(_TORCH[dtype]), b32.to(_TORCH[dtype])
        fn = lambda: torch.mm(a, b)  # noqa: E731
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        return median_ms(fn, backend, rounds=rounds, budget_s=budget_s, slow_once=True), note
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def run(backend, *, sizes: list[int], dtypes: list[str], model: str | None = None, tokens: int = 4096,
        rounds: int = 10, budget_s: float = 2.0, log=print) -> list[dict]:
    """Rows of TFLOP/s (and % of the backend's peak where it knows one) for every shape and dtype."""
    shapes = [(f"square:{s}", s, s, s) for s in sizes] + (model_shapes(model, tokens) if model else [])
    caps, rows = backend.capabilities(), []
    as_tf32 = caps.fp32_matmul == "tf32"  # the backend's float32 GEMMs run in TF32 (torch_musa 2.7's default)
    for dtype in dtypes:
        if dtype == "tf32" and backend.device_type != "cuda":
            continue  # the row's switch is torch.backends.cuda's: elsewhere it would time whatever fp32 runs as
        if dtype not in ("fp32", "tf32") and _TORCH.get(dtype, torch.bfloat16) not in caps.dtypes:
            continue
        if dtype.startswith("fp8") and not (caps.fp8_formats and caps.fp8_recipes):
            continue  # a device without float8 (--fp8-format is refused there): no FP8 row to report
        math = "fp8" if dtype.startswith("fp8") else "tf32" if dtype == "fp32" and as_tf32 else dtype
        peak = caps.peak(math)
        for shape, m, n, k in shapes:
            ms, note = bench_one(backend, dtype, m, n, k, rounds=rounds, budget_s=budget_s)
            if dtype == "fp32" and as_tf32:
                note = "float32 GEMMs run in TF32 on this backend (capabilities fp32_matmul): TF32's peak"
            tflops = 2.0 * m * n * k / (ms * 1e-3) / 1e12
            rows.append({"dtype": dtype, "math": math, "shape": shape, "m": m, "n": n, "k": k, "ms": ms,
                         "tflops": tflops, "peak_tflops": peak / 1e12 if peak else None,
                         "pct_peak": 100.0 * tflops * 1e12 / peak if peak else None, "note": note})
            log(f"gemm {dtype:10s} {shape:24s} {m}x{n}x{k}: {ms:9.3f} ms {tflops:8.3f} TFLOP/s {note}")
    return rows
