"""Multi-latent attention decode step: the expanded path against the absorbed one, per token, at several cache lengths.

One MLA layer with DeepSeek-V3's per-head shape (``--kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
--v-head-dim 128 --q-lora-rank 1536``) and fewer heads (16 of 128, hidden 2048: a CPU-sized layer), fp32,
batch 1. Its latent cache is filled with ``L`` random slots; one decode step (one token: query projections, the
attention over the ``L + 1`` slots, the output projection) is timed, the cache put back to ``L`` slots after each
step. Reported per path: the median step time over ``--reps`` steps after one warm step, and the step's
temporary memory: the peak bytes of the storages the step creates (``PeakTracker``) minus the cache's own
appended copy (``[L + 1, b, r + dr]``, the same for both paths). The two outputs are compared (relative
difference: float32 rounding, ~1e-7).

    python benchmarks/mla_decode.py [--lengths 256 1024 4096] [--reps 5] [--threads 1] [--heads 16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layer(heads: int):
    """The MLA layer (random weights) and its config."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.transformer.mla import MLASelfAttention

    c = GPTConfig(num_layers=1, hidden_size=128 * heads, num_attention_heads=heads, seq_length=8192,
                  vocab_size=128, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                  qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
                  hidden_dropout=0.0, attention_dropout=0.0)
    be = get_backend("cpu")
    attn = MLASelfAttention(c, group=ParallelGroups.single().tp, sequence_parallel=False, tracker=RNGTracker(be),
                            backend=be, out_std=0.02).eval()
    with torch.no_grad():  # the module's own tensors are uninitialised (the model's init fills them)
        for p in attn.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn_like(p) * 0.02)
    return c, attn


def measure(c, attn, length: int, absorb: bool, reps: int) -> dict:
    """Median step time (ms) and temporary bytes of one decode step over a cache of ``length`` slots."""
    from omnitron.core.inference.kv_cache import KVCache
    from omnitron.kernels.benchmark import PeakTracker

    gen = torch.Generator().manual_seed(0)
    latent = torch.randn(length, 1, c.kv_lora_rank, generator=gen)
    k_pe = torch.randn(length, 1, 1, c.qk_pos_emb_head_dim, generator=gen)
    x = torch.randn(1, 1, c.hidden_size, generator=gen)
    freqs = torch.full((1, 1, 1, c.qk_pos_emb_head_dim // 2), float(length)) * 1e-3
    attn.absorb = absorb
    holder = SimpleNamespace(decoder=SimpleNamespace(layers={"0": SimpleNamespace(self_attention=attn)}))
    times = []
    appended = (length + 1) * (c.kv_lora_rank + c.qk_pos_emb_head_dim) * 4
    with torch.no_grad(), KVCache(holder) as cache:
        cache.keys[0], cache.values[0] = latent, k_pe
        attn(x, freqs)  # warm
        cache.keys[0], cache.values[0] = latent, k_pe
        tracker = PeakTracker()
        with tracker:
            out = attn(x, freqs)[0]
        for _ in range(reps):
            cache.keys[0], cache.values[0] = latent, k_pe
            t0 = time.perf_counter()
            attn(x, freqs)
            times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "temp_bytes": tracker.peak - appended, "out": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    c, attn = layer(a.heads)
    print(f"# torch {torch.__version__}, {a.threads} thread(s), {a.heads} heads, hidden {c.hidden_size}, "
          f"fp32, batch 1; load: {os.getloadavg()}")
    print(f"{'cache':>6} {'expanded ms':>11} {'absorbed ms':>11} {'speed-up':>8} {'expanded temp MiB':>17} "
          f"{'absorbed temp MiB':>17} {'rel diff':>9}")
    for length in a.lengths:
        e = measure(c, attn, length, False, a.reps)
        b = measure(c, attn, length, None, a.reps)
        diff = float((e["out"] - b["out"]).norm() / e["out"].norm())
        print(f"{length:>6} {e['ms']:>11.1f} {b['ms']:>11.1f} {e['ms'] / b['ms']:>7.1f}x "
              f"{e['temp_bytes'] / 2**20:>17.1f} {b['temp_bytes'] / 2**20:>17.2f} {diff:>9.1e}")
        print(json.dumps({"cache": length, "expanded_ms": round(e["ms"], 2), "absorbed_ms": round(b["ms"], 2),
                          "expanded_temp_bytes": e["temp_bytes"], "absorbed_temp_bytes": b["temp_bytes"],
                          "rel_diff": diff}))


if __name__ == "__main__":
    main()
