"""Greedy / top-k sampling with a KV cache, on one process.

A trained model is first gathered into a single-process ``GPTModel`` (tp = pp = 1): every stage
gathers its full tensors over tp, rank 0 collects the stages. :class:`KVCache` then replaces
each attention layer's core attention with one that appends the new keys/values to a cache, so
each new token costs one position's forward instead of the whole prefix.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.gpt.state import gather_full_state, shard_full_state
from omnitron.core.parallel.groups import ParallelGroups


class KVCache:
    """Per-layer key/value cache installed on a model's attention modules (``with KVCache(model):``)."""

    def __init__(self, model: GPTModel) -> None:
        self.model = model
        self.attn = [layer.self_attention for layer in model.decoder.layers.values()]
        self.keys: list[torch.Tensor | None] = [None] * len(self.attn)
        self.values: list[torch.Tensor | None] = [None] * len(self.attn)

    def _core(self, i: int, module):
        def core_attention(q, k, v, key_padding_mask=None):  # [b, heads, s_new, d]
            if key_padding_mask is not None:
                raise ValueError("KVCache decodes causal models; a key padding mask (bidirectional "
                                 "attention, BERT) has nothing to generate")
            if self.keys[i] is not None:
                k = torch.cat([self.keys[i], k], dim=2)
                v = torch.cat([self.values[i], v], dim=2)
            self.keys[i], self.values[i] = k, v
            # the prefill is causal; a single new query may see every cached position
            causal = q.shape[2] > 1
            if causal and q.shape[2] != k.shape[2]:
                raise ValueError("KVCache: multi-token steps are only supported for the prefill")
            return module.backend.kernels.attention(q, k, v, causal=causal, dropout_p=0.0)

        return core_attention

    def __enter__(self) -> "KVCache":
        for i, a in enumerate(self.attn):
            a.core_attention = self._core(i, a)
        return self

    def __exit__(self, *exc) -> None:
        for a in self.attn:
            del a.core_attention  # back to the class method


def _pick(logits: torch.Tensor, top_k: int, temperature: float, generator: torch.Generator | None) -> int:
    """Next token from fp32 logits [V]: argmax when top_k == 1 (or temperature 0), else top-k sampling."""
    if top_k == 1 or temperature <= 0:
        return int(torch.argmax(logits))
    vals, idx = torch.topk(logits / temperature, min(top_k, logits.numel()))
    probs = torch.softmax(vals, dim=-1)
    return int(idx[torch.multinomial(probs, 1, generator=generator)])


@torch.no_grad()
def generate(model: GPTModel, prompt: list[int], max_new_tokens: int, *, top_k: int = 1, temperature: float = 1.0,
             eod: int | None = None, generator: torch.Generator | None = None, use_cache: bool = True) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens (stops at ``eod``); returns the new tokens.

    ``use_cache=False`` re-runs the whole sequence each step (the reference the cache is tested against).
    """
    if not prompt:
        raise ValueError("generate: the prompt must hold at least one token")
    limit = model.config.max_position_embeddings or model.config.seq_length
    was_training = model.training
    model.eval()
    tokens, new = list(prompt), []
    device = next(model.parameters()).device
    ctx = KVCache(model) if use_cache else contextlib.nullcontext()
    try:
        with ctx:
            step_in, pos0 = tokens, 0
            for _ in range(max_new_tokens):
                if len(tokens) >= limit:
                    break
                ids = torch.tensor([step_in], dtype=torch.long, device=device)
                pos = torch.arange(pos0, pos0 + len(step_in), device=device).unsqueeze(0)
                logits = model(tokens=ids, position_ids=pos)  # [s, 1, V]
                nxt = _pick(logits[-1, 0].float(), top_k, temperature, generator)
                tokens.append(nxt)
                new.append(nxt)
                if eod is not None and nxt == eod:
                    break
                if use_cache:
                    step_in, pos0 = [nxt], len(tokens) - 1
                else:
                    step_in = tokens
    finally:
        model.train(was_training)
    return new


def single_process_model(c) -> GPTModel | None:
    """Collective: the trained model as one tp=1/pp=1 GPTModel on global rank 0 (None elsewhere)."""
    import torch.distributed as dist

    full = {}
    for m in c.modules:
        full.update(gather_full_state(m, c.groups))
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size() if c.groups.rank == 0 else None
        mine = full if c.groups.tp.rank == 0 or c.groups.tp.size == 1 else {}
        dist.gather_object({k: v.float().cpu() for k, v in mine.items()}, parts, dst=0)
        if c.groups.rank != 0:
            return None
        full = {k: v for part in parts for k, v in part.items()}
    cfg = replace(c.model, params_dtype=torch.float32, recompute_granularity=None, recompute_method=None)
    single = ParallelGroups.single()
    state = torch.random.get_rng_state()
    model = GPTModel(cfg, single, backend=c.backend, seed=c.settings.training.seed)
    torch.random.set_rng_state(state)
    shard_full_state(model, full, single)
    return model.to(c.backend.current_device()).eval()


def print_sample(c, prompt: str, max_new_tokens: int, top_k: int = 1) -> str | None:
    """Collective: print (on rank 0) and return a continuation of ``prompt`` from the trained model."""
    model = single_process_model(c)
    if model is None:
        return None
    ids = c.tokenizer.encode(prompt)
    out = generate(model, ids, max_new_tokens, top_k=top_k, temperature=0.8, eod=getattr(c.tokenizer, "eod", None),
                   generator=torch.Generator().manual_seed(c.settings.training.seed))
    text = c.tokenizer.decode(out)
    how = "greedy" if top_k == 1 else f"top-{top_k} sampling"
    print(f"\n--- sample ({how}, KV cache) ---\n{prompt}{text}\n---", flush=True)
    return text
