"""The end-of-training sample: gather the trained model onto one process, continue a prompt.

A trained model is first gathered into a single-process ``GPTModel`` (tp = pp = 1): every stage
gathers its full tensors over tp, rank 0 collects the stages; :func:`generate` then decodes with
the KV cache of :mod:`omnitron.core.inference.generation`.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from omnitron.core.inference.generation import generate_batch
from omnitron.core.inference.sampling import GREEDY, SamplingParams
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.gpt.state import gather_full_state, shard_full_state
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor.sharding import to_device


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, *, params: SamplingParams = GREEDY,
             eod: int | None = None, use_cache: bool = True) -> list[int]:
    """Continue one ``prompt`` by up to ``max_new_tokens`` tokens (stops at ``eod`` or the context limit);
    returns the new tokens. ``use_cache=False`` re-runs the whole sequence each step (the slow reference)."""
    return generate_batch(model, [list(prompt)], max_new_tokens, params=params, eod=eod, use_cache=use_cache).tokens[0]


def single_process_model(c) -> GPTModel | None:
    """Collective: the trained model as one tp=1/pp=1 GPTModel on global rank 0 (None elsewhere)."""
    full = {}
    for m in c.modules:
        full.update(gather_full_state(m, c.groups))
    coll = c.backend.collectives
    if coll.is_initialized() and coll.world_size() > 1:
        mine = full if c.groups.tp.rank == 0 or c.groups.tp.size == 1 else {}
        parts = coll.gather_object({k: v.float().cpu() for k, v in mine.items()}, dst=0)
        if c.groups.rank != 0:
            return None
        full = {k: v for part in parts for k, v in part.items()}
    cfg = replace(c.model, params_dtype=torch.float32, recompute_granularity=None, recompute_method=None)
    single = ParallelGroups.single()
    state = torch.random.get_rng_state()
    model = GPTModel(cfg, single, backend=c.backend, seed=c.settings.training.seed)
    torch.random.set_rng_state(state)
    shard_full_state(model, full, single)
    return to_device(model, c.backend.current_device()).eval()


def print_sample(c, prompt: str, max_new_tokens: int, top_k: int = 1, temperature: float = 0.8) -> str | None:
    """Collective: print (on rank 0) and return a continuation of ``prompt`` from the trained model."""
    model = single_process_model(c)
    if model is None:
        return None
    ids = c.tokenizer.encode(prompt)
    params = SamplingParams(top_k=top_k, temperature=temperature, seed=c.settings.training.seed)
    out = generate(model, ids, max_new_tokens, params=params, eod=getattr(c.tokenizer, "eod", None))
    text = c.tokenizer.decode(out)
    pool = "whole-vocabulary" if top_k == 0 else f"top-{top_k}"
    how = "greedy" if top_k == 1 else f"{pool} sampling at temperature {temperature:g}"
    print(f"\n--- sample ({how}, KV cache) ---\n{prompt}{text}\n---", flush=True)
    return text
