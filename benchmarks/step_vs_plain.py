"""The engine's GPT training step against a plain PyTorch GPT of the same maths, side by side.

Part 1 (one process, 2 threads): engine GPTModel (tp=1, kernel registry) vs a plain model
(nn.Linear, nn.Embedding, SDPA, F.cross_entropy); both step with ``torch.optim.AdamW(fused=True)``,
in fp32 and bf16 autocast, for a ~10M and a ~100M parameter GPT-2 style config. Steps alternate
between the two models so machine noise hits both alike; the median step is reported.
Part 2: engine tp=2 on 2 processes x 1 thread against tp=1 on 1 process x 2 threads.

    python benchmarks/step_vs_plain.py [--sizes 10m,100m] [--steps 4] [--skip-tp] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from omnitron.core.models.gpt import GPTConfig, GPTModel, num_parameters  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

SIZES = {  # GPT-2 style, tied embeddings, no dropout; tokens per step = micro_batch * seq
    "10m": dict(num_layers=6, hidden_size=256, num_attention_heads=4, ffn_hidden_size=1024, vocab_size=20000),
    "100m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, vocab_size=32000),
}
SEQ, MICRO = 512, 4


def config(size: str) -> GPTConfig:
    return GPTConfig(seq_length=SEQ, max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                     make_vocab_size_divisible_by=128, **SIZES[size])


class PlainGPT(nn.Module):
    """nanoGPT-like reference: batch-first, pre-LN, tanh-GeLU, tied embedding, SDPA causal."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        h, V = c.hidden_size, -(-c.vocab_size // 128) * 128
        self.heads = c.num_attention_heads
        self.wte, self.wpe = nn.Embedding(V, h), nn.Embedding(c.seq_length, h)
        self.blocks = nn.ModuleList()
        for _ in range(c.num_layers):
            self.blocks.append(nn.ModuleDict(dict(ln1=nn.LayerNorm(h), qkv=nn.Linear(h, 3 * h), proj=nn.Linear(h, h),
                                                  ln2=nn.LayerNorm(h), fc1=nn.Linear(h, c.ffn_hidden_size),
                                                  fc2=nn.Linear(c.ffn_hidden_size, h))))
        self.ln_f = nn.LayerNorm(h)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, labels):
        b, s = tokens.shape
        x = self.wte(tokens) + self.wpe(torch.arange(s))
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
            x = x + blk["proj"](a)
            x = x + blk["fc2"](F.gelu(blk["fc1"](blk["ln2"](x)), approximate="tanh"))
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))


def _step(model, opt, tokens, labels, dtype, engine: bool) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one training step. CPU time is reported beside wall
    time because this machine is shared: contention inflates wall time far more than CPU time."""
    t, c = time.perf_counter(), time.process_time()
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        loss = model(tokens, labels=labels).mean() if engine else model(tokens, labels)
    loss.backward()
    opt.step()
    return time.perf_counter() - t, time.process_time() - c


def _median(samples, i: int) -> float:
    return statistics.median(s[i] for s in samples)


def engine_vs_plain(size: str, dtype, steps: int) -> dict:
    c = config(size)
    torch.manual_seed(0)
    eng, plain = GPTModel(c, ParallelGroups.single(), seed=0), PlainGPT(c)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for m in (eng, plain)]
    tokens = torch.randint(0, c.vocab_size, (MICRO, SEQ))
    labels = torch.roll(tokens, -1, 1)
    times = {"engine": [], "plain": []}
    for i in range(steps + 1):  # first step is warm-up
        te = _step(eng, opts[0], tokens, labels, dtype, True)
        tp = _step(plain, opts[1], tokens, labels, dtype, False)
        if i:
            times["engine"].append(te)
            times["plain"].append(tp)
    e, p = _median(times["engine"], 0), _median(times["plain"], 0)
    ec, pc = _median(times["engine"], 1), _median(times["plain"], 1)
    return {"size": size, "params": num_parameters(c), "dtype": str(dtype or "fp32").replace("torch.", ""),
            "engine_ms": e * 1e3, "plain_ms": p * 1e3, "engine_tok_s": MICRO * SEQ / e, "plain_tok_s": MICRO * SEQ / p,
            "engine_over_plain": e / p, "engine_cpu_ms": ec * 1e3, "plain_cpu_ms": pc * 1e3,
            "engine_over_plain_cpu": ec / pc}


def _tp_worker(size: str, steps: int) -> float:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig

    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), get_backend().collectives)
    c = config(size)
    model = GPTModel(c, groups, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, c.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    times = [_step(model, opt, tokens, torch.roll(tokens, -1, 1), None, True) for _ in range(steps + 1)]
    return _median(times[1:], 0), _median(times[1:], 1)


def tp2_vs_tp1(size: str, steps: int) -> dict:
    from omnitron.testing.distributed import run_distributed

    ranks = run_distributed(_tp_worker, 2, size, steps, threads=1)
    t2, c2 = max(r[0] for r in ranks), sum(r[1] for r in ranks)  # slowest rank's wall, CPU of both ranks
    c = config(size)
    model = GPTModel(c, ParallelGroups.single(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, c.vocab_size, (MICRO, SEQ))
    samples = [_step(model, opt, tokens, torch.roll(tokens, -1, 1), None, True) for _ in range(steps + 1)][1:]
    t1, c1 = _median(samples, 0), _median(samples, 1)
    return {"size": size, "tp1_2threads_ms": t1 * 1e3, "tp2_2x1thread_ms": t2 * 1e3, "tp2_over_tp1": t2 / t1,
            "tp1_cpu_ms": c1 * 1e3, "tp2_cpu_ms_both_ranks": c2 * 1e3, "tp2_over_tp1_cpu": c2 / c1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10m,100m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tp-size", default="10m", help="model size for the tp=2 vs tp=1 comparison")
    ap.add_argument("--skip-tp", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    print(f"tokens/step = {MICRO} x {SEQ}; threads = {torch.get_num_threads()}; optimizer AdamW(fused=True) on both")
    print(f"{'size':>5} {'params':>8} {'dtype':>9} {'engine ms':>10} {'plain ms':>9} {'engine tok/s':>12} "
          f"{'plain tok/s':>11} {'engine/plain':>12} {'CPU-time ratio':>14}")
    for size in args.sizes.split(","):
        for dtype in (None, torch.bfloat16):
            r = engine_vs_plain(size, dtype, args.steps)
            rows.append(r)
            print(f"{r['size']:>5} {r['params'] / 1e6:7.1f}M {r['dtype']:>9} {r['engine_ms']:10.1f} "
                  f"{r['plain_ms']:9.1f} "
                  f"{r['engine_tok_s']:12.0f} {r['plain_tok_s']:11.0f} {r['engine_over_plain']:12.3f} "
                  f"{r['engine_over_plain_cpu']:14.3f}", flush=True)
    out = {"engine_vs_plain": rows}
    if not args.skip_tp:
        r = tp2_vs_tp1(args.tp_size, args.steps)
        out["tp"] = r
        print(f"tp: {r['size']} fp32  tp=1 (1 proc x 2 threads) {r['tp1_2threads_ms']:.1f} ms/step  "
              f"tp=2 (2 procs x 1 thread) {r['tp2_2x1thread_ms']:.1f} ms/step  tp2/tp1 = {r['tp2_over_tp1']:.3f}  "
              f"(CPU time, both ranks: {r['tp2_cpu_ms_both_ranks']:.0f} vs {r['tp1_cpu_ms']:.0f} ms, "
              f"ratio {r['tp2_over_tp1_cpu']:.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
