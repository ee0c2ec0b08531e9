"""FP8 vs BF16 GEMM throughput at the 1.3B GPT's shapes, and FP8 linear layers end to end.

Part 1, raw GEMMs (TFLOP/s = 2mkn / time): BF16 ``torch.mm`` against ``torch._scaled_mm`` with
per-tensor and row-wise scales, and block-wise (1x128 x 128x128) where the device has it, for the
forward shapes of one layer (QKV, attention projection, fc1, fc2; tokens = seq 2048 x micro-batch)
and the weight-gradient shape of fc1. Each row also gives the error of the FP8 result against a
float64 product of the original (unquantized) operands, and of BF16 likewise.

Part 2, layers: ``F.linear`` in BF16 against omnitron's ``FP8Linear`` (quantization included),
forward + backward, per recipe; "speed-up" is BF16 time / FP8 time.

On a GPU the timings are the point; on the CPU (torch's CPU ``_scaled_mm`` is for numerics only) the
shapes are divided by ``--cpu-shrink`` and timed once, so the run stays short.

    python benchmarks/fp8_gemm.py [--micro-batch-size 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnitron.backends import get_backend  # noqa: E402
from omnitron.backends.fp8 import scale_from_amax  # noqa: E402


def shapes(hidden: int, ffn: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(name, m, k, n) of ``[m,k] @ [k,n]`` GEMMs of one GPT layer."""
    return [("qkv fwd", tokens, hidden, 3 * hidden), ("proj fwd", tokens, hidden, hidden),
            ("fc1 fwd", tokens, hidden, ffn), ("fc2 fwd", tokens, ffn, hidden),
            ("fc1 wgrad", ffn, tokens, hidden)]


def timed(fn, be, iters: int, warmup: int) -> float:
    """Median-free mean seconds per call over ``iters`` after ``warmup`` calls (device synchronized)."""
    for _ in range(warmup):
        fn()
    be.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    be.synchronize()
    return (time.perf_counter() - t) / iters


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def gemm_rows(be, dev, spec, iters, warmup) -> list[dict]:
    fp8 = be.fp8
    rows = []
    for name, m, k, n in spec:
        g = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(m, k, generator=g).to(dev)
        b = (torch.randn(n, k, generator=g) * 0.02).to(dev)  # weight [n, k]; GEMM uses b.T
        ref = a.double() @ b.double().t()
        flops = 2.0 * m * k * n
        a16, b16 = a.bfloat16(), b.bfloat16()
        row = {"gemm": name, "m": m, "k": k, "n": n}
        t = timed(lambda: a16 @ b16.t(), be, iters, warmup)
        row.update(bf16_tflops=flops / t / 1e12, bf16_err=_rel(a16 @ b16.t(), ref))
        sa, sb = scale_from_amax(a.abs().amax(), "e4m3"), scale_from_amax(b.abs().amax(), "e4m3")
        qa, qb = fp8.quantize(a, "e4m3", sa)[0], fp8.quantize(b, "e4m3", sb)[0]
        ia, ib = (1 / sa).float(), (1 / sb).float()
        run = lambda: torch._scaled_mm(qa, qb.t(), scale_a=ia, scale_b=ib, out_dtype=torch.bfloat16)  # noqa: E731
        t = timed(run, be, iters, warmup)
        row.update(fp8_tensor_tflops=flops / t / 1e12, fp8_tensor_err=_rel(run(), ref))
        ra = scale_from_amax(a.abs().amax(1, keepdim=True), "e4m3")      # [m,1]
        rb = scale_from_amax(b.abs().amax(1, keepdim=True), "e4m3").t()  # [1,n]
        qa_r = (a * ra).clamp(-448, 448).to(torch.float8_e4m3fn)
        qb_r = (b * rb.t()).clamp(-448, 448).to(torch.float8_e4m3fn)
        ira, irb = (1 / ra).float().contiguous(), (1 / rb).float().contiguous()
        run = lambda: torch._scaled_mm(qa_r, qb_r.t(), scale_a=ira, scale_b=irb, out_dtype=torch.bfloat16)  # noqa: E731
        try:
            t = timed(run, be, iters, warmup)
            row.update(fp8_row_tflops=flops / t / 1e12, fp8_row_err=_rel(run(), ref))
        except RuntimeError as err:
            row.update(fp8_row_tflops=None, fp8_row_err=None, fp8_row_note=str(err).splitlines()[0])
        qa_b, sa_b = fp8.quantize_blocks(a, "e4m3", (1, 128))
        qb_b, sb_b = fp8.quantize_blocks(b, "e4m3", (128, 128))
        run = lambda: fp8.blockwise_mm(qa_b, sa_b, (1, 128), qb_b.t(), sb_b.t(), (128, 128),  # noqa: E731
                                       out_dtype=torch.bfloat16)
        y = run()
        if fp8.block_path == "scaled_mm":
            t = timed(run, be, iters, warmup)
            row.update(fp8_block_tflops=flops / t / 1e12)
        else:
            row.update(fp8_block_tflops=None)
        row.update(fp8_block_err=_rel(y, ref), fp8_block_path=fp8.block_path)
        rows.append(row)
    return rows


def layer_rows(be, dev, spec, iters, warmup) -> list[dict]:
    import torch.nn.functional as F

    from omnitron.core.precision.fp8 import FP8Config, FP8Linear

    rows = []
    for name, m, k, n in spec:
        if "wgrad" in name:
            continue
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device=dev) * 0.02).requires_grad_()
        gy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        w16 = w.detach().bfloat16().requires_grad_()
        row = {"layer": name.replace(" fwd", ""), "m": m, "k": k, "n": n}
        t16 = timed(lambda: F.linear(x, w16).backward(gy), be, iters, warmup)
        row["bf16_ms"] = t16 * 1e3
        for recipe in ("tensorwise", "delayed", "blockwise"):
            ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), be.fp8)
            t = timed(lambda: ex(x, w16, None).backward(gy), be, iters, warmup)
            row[f"{recipe}_ms"], row[f"{recipe}_speedup"] = t * 1e3, t16 / t
        rows.append(row)
    return rows


def step_rows(be, dev, args, shrink: int, iters: int, warmup: int) -> list[dict]:
    """Forward + backward of the GPT (1.3B shapes, ``--step-layers`` layers, bf16 parameters): BF16 against
    each FP8 recipe (output layer kept in BF16, as Megatron does). The optimizer step is the same in both
    and is left out."""
    from omnitron.core.models.gpt import GPTModel, gpt_1p3b
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import FP8Config, disable_fp8, enable_fp8

    h, s = args.hidden_size // shrink, args.seq_length // shrink
    cfg = gpt_1p3b(num_layers=args.step_layers, hidden_size=h, ffn_hidden_size=args.ffn_hidden_size // shrink,
                   seq_length=s, max_position_embeddings=s, hidden_dropout=0.0, attention_dropout=0.0,
                   params_dtype=torch.bfloat16)
    groups = ParallelGroups.single()
    model = GPTModel(cfg, groups, backend=be).to(dev)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, s), generator=g).to(dev)
    labels = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, s), generator=g).to(dev)

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, labels=labels).mean().backward()

    rows = []
    t16 = timed(step, be, iters, warmup)
    rows.append({"variant": "bf16", "ms": t16 * 1e3, "speedup": 1.0})
    for recipe in ("tensorwise", "delayed", "blockwise"):
        enable_fp8(model, FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), groups, backend=be)
        t = timed(step, be, iters, warmup)
        rows.append({"variant": f"fp8 {recipe}", "ms": t * 1e3, "speedup": t16 / t})
        disable_fp8(model)
    tokens_per_step = args.micro_batch_size * s
    for r in rows:
        r["tokens_per_s"] = tokens_per_step / (r["ms"] / 1e3)
    return rows


def _fmt(v, spec=".1f"):
    return "-" if v is None else format(v, spec)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden-size", type=int, default=2048)
    ap.add_argument("--ffn-hidden-size", type=int, default=8192)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cpu-shrink", type=int, default=8, help="divide every dimension by this on the CPU")
    ap.add_argument("--step-layers", type=int, default=24, help="GPT layers in the step benchmark (0: skip it)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    be = get_backend()
    dev = be.current_device()
    cpu = dev.type == "cpu"
    d = args.cpu_shrink if cpu else 1
    spec = shapes(args.hidden_size // d, args.ffn_hidden_size // d, args.seq_length * args.micro_batch_size // d)
    iters, warmup = (1, 1) if cpu else (args.iters, 5)
    caps = be.capabilities()
    print(f"# {caps.device_name} ({be.name}); {be.fp8.describe()}")
    print(f"# peak bf16 {_fmt(caps.peak('bf16') and caps.peak('bf16') / 1e12, '.0f')} TFLOP/s, "
          f"fp8 {_fmt(caps.peak('fp8') and caps.peak('fp8') / 1e12, '.0f')} TFLOP/s"
          + ("; CPU: shapes / %d, numerics only" % d if cpu else ""))
    grows = gemm_rows(be, dev, spec, iters, warmup)
    print(f"{'gemm':10s} {'m':>6s} {'k':>6s} {'n':>6s} | {'bf16':>7s} {'fp8 t':>7s} {'fp8 row':>7s} {'fp8 blk':>7s}"
          f" | {'x bf16':>6s} | err bf16  fp8 t    fp8 row  fp8 blk")
    for r in grows:
        print(f"{r['gemm']:10s} {r['m']:6d} {r['k']:6d} {r['n']:6d} | {r['bf16_tflops']:7.3g} "
              f"{r['fp8_tensor_tflops']:7.3g} {_fmt(r['fp8_row_tflops'], '.3g'):>7s} "
              f"{_fmt(r['fp8_block_tflops'], '.3g'):>7s} | "
              f"{r['fp8_tensor_tflops'] / r['bf16_tflops']:6.2f} | {r['bf16_err']:.1e}  {r['fp8_tensor_err']:.1e}  "
              f"{_fmt(r['fp8_row_err'], '.1e')}  {r['fp8_block_err']:.1e}")
    lrows = layer_rows(be, dev, spec, iters, warmup)
    print(f"\n{'layer fwd+bwd':14s} | {'bf16 ms':>8s} | {'tensorwise':>10s} {'delayed':>10s} {'blockwise':>10s}  "
          "(speed-up)")
    for r in lrows:
        print(f"{r['layer']:14s} | {r['bf16_ms']:8.2f} | " + " ".join(
            f"{r[f'{k}_speedup']:10.2f}" for k in ("tensorwise", "delayed", "blockwise")))
    srows = []
    if args.step_layers > 0:
        if cpu:
            args.step_layers = min(args.step_layers, 2)
        srows = step_rows(be, dev, args, d, iters, warmup)
        print(f"\nGPT fwd+bwd, {args.step_layers} layers, seq {args.seq_length // d}, mbs {args.micro_batch_size}")
        for r in srows:
            print(f"{r['variant']:16s} {r['ms']:9.2f} ms  {r['tokens_per_s']:10.0f} tok/s  x{r['speedup']:.2f}")
    out = {"device": caps.device_name, "backend": be.name, "fp8_path": be.fp8.path, "block_path": be.fp8.block_path,
           "cpu_shrink": d, "gemms": grows, "layers": lrows, "step": srows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
