"""KV-cache bytes per generated token: multi-latent attention's latent cache against grouped-query attention.

Measured: greedy generation (``generate_batch`` with the KV cache) on tiny random models, the cache's bytes
per slot read from :meth:`KVCache.bytes_per_token` after the run (all layers, one batch row), with the wall
time of the run. Counted: the same per-token size of the released shapes (bf16), from their configs, for
DeepSeek-V3's MLA (latent ``kv_lora_rank + qk_pos_emb_head_dim`` per layer), the same attention caching every
head's keys and values (``heads x (dn + dr + dv)``), and GQA models (``2 x groups x head_dim``).

    python benchmarks/kv_cache_bytes.py [--new 24] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measured(name: str, cfg, new: int) -> dict:
    """Generate ``new`` tokens for 2 prompts with the cache; the cache's bytes per token at the end."""
    from omnitron.backends import get_backend
    from omnitron.core.inference import kv_cache
    from omnitron.core.inference.generation import generate_batch
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=1).eval()
    seen = []
    original = kv_cache.KVCache.__exit__

    def keep(self, *exc):  # read the cache as generation leaves it
        seen.append(self.bytes_per_token())
        return original(self, *exc)

    kv_cache.KVCache.__exit__ = keep
    try:
        t0 = time.perf_counter()
        generate_batch(model, [[1, 2, 3, 4], [5, 6, 7, 8]], new)
        seconds = time.perf_counter() - t0
    finally:
        kv_cache.KVCache.__exit__ = original
    return {"model": name, "layers": cfg.num_layers, "bytes_per_token": seen[-1],
            "per_layer": seen[-1] / cfg.num_layers, "seconds": round(seconds, 3)}


def counted(name: str, cfg, full_kv: bool = False) -> dict:
    """bf16 bytes per token of the released shape's cache (all layers)."""
    from omnitron.core.transformer.shapes import head_dim, query_groups

    if cfg.multi_latent_attention and not full_kv:
        per = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    elif cfg.multi_latent_attention:
        per = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.qk_pos_emb_head_dim + cfg.v_head_dim)
    else:
        per = 2 * query_groups(cfg) * head_dim(cfg)
    return {"model": name + (" (every head's K/V)" if full_kv else ""), "layers": cfg.num_layers,
            "per_layer": 2 * per, "bytes_per_token": 2 * per * cfg.num_layers}


def main() -> None:
    from omnitron.core.models.gpt import presets as C

    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    tiny = dict(vocab_size=512, seq_length=64, params_dtype=torch.float32)
    rows = [measured("deepseek_v3_tiny (MLA, fp32)", C.deepseek_v3_tiny(**tiny), a.new),
            measured("GQA of the same width (4 heads of 16 / 2 groups, fp32)",
                     C.llama_tiny(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, **tiny),
                     a.new)]
    rows += [counted("deepseek_v3", C.deepseek_v3()), counted("deepseek_v3", C.deepseek_v3(), full_kv=True),
             counted("llama3_70b", C.llama3_70b()), counted("mixtral_8x7b", C.mixtral_8x7b()),
             counted("qwen3_30b_a3b", C.qwen3_30b_a3b())]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
