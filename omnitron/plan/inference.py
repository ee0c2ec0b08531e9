"""Serving memory per rank: weights, KV cache and the prefill's working set of batched generation
(``omnitron plan --inference-max-requests B --inference-max-seq-length S``, Megatron's inference flags).

Terms (bytes, one tp rank of each pipeline stage; every tp rank of a stage holds the same):

- weights: the stage's parameters, counted on the meta-device skeleton training builds (:func:`.state.skeleton`:
  tp shards, the key/value projection whole on every rank where ``--num-query-groups`` < tp), at the serving
  dtype: ``--bf16`` / ``--fp16``, else fp32, as ``omnitron generate`` / ``serve`` load checkpoints with the same
  flags (:mod:`omnitron.core.inference.loader`).
- KV cache: ``B x S`` slots (:func:`omnitron.core.inference.generation.cache_slots`: the cache is allocated once
  at the batch's longest sequence) times the bytes a token costs on this rank (:func:`kv_bytes_per_token`): each
  layer's keys and values of its ``max(groups / tp, 1)`` local key/value heads (heads fewer than tp are
  replicated, one per rank), or under multi-latent attention the normalised latent and the rotated shared key
  part (``kv_lora_rank + qk_pos_emb_head_dim``, whole on every tp rank), as :class:`~omnitron.core.inference.
  kv_cache.KVCache` keeps them. A sliding-window layer (window ``(left, 0)``) holds ``min(S, left + 1)`` slots
  per request (its ring buffer), not ``S``. There is no FP8 KV cache: keys and values are in the serving dtype.
- activations: the prefill's working set (no autograd: one layer's tensors at a time), the largest of its phases
  over ``T = B x prompt`` tokens (the prompt is ``S`` at worst): the MLP's (:func:`_mlp`), attention's
  (:func:`_attention`: with left-padded prompts the masked path's ``[b, heads, s, s]`` fp32 scores and
  probabilities) and the output head's (the vocabulary shard's logits, gathered whole over tp on the last
  stage, twice), computed at the last position of each request only (``B`` rows, not ``T``: generation asks the
  forward for them alone, :mod:`omnitron.core.inference.generation`) unless the prompt's log-probs are wanted
  (``log_probs``: Megatron's ``--return-log-probs``, then every position's). Decoding steps hold the same
  tensors for ``B`` tokens: fewer.

T5 and LLaVA (one process each): :mod:`omnitron.plan.serve_families`; BERT generates nothing and is refused.

Not modelled: communication buffers, allocator fragmentation and caching, buffers fused kernels allocate
internally, ``--return-log-probs``' fp32 log-softmax of the prompt's logits, MoE dispatch buffers (an MoE layer's
MLP phase is priced as its routed tokens' expert MLPs, ``topk x T`` rows, plus the shared expert).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.transformer.shapes import padded_vocab_size
from omnitron.plan.serve_terms import _attention, _head, _mlp, kv_bytes_per_token, prefill_bytes  # noqa: F401



@dataclass(frozen=True)
class ServeMemory:
    """One tp rank of pipeline stage ``stage``, serving ``requests`` sequences of up to ``seq_length`` tokens."""

    stage: int
    layers: int
    requests: int
    seq_length: int
    weights: int
    kv_cache: int
    kv_per_token: int
    """Cache bytes one token costs on this rank while a sequence is within every window (all its layers)."""
    activations: int
    window_slots: int | None = None
    """Slots a window layer's ring holds (``left + 1``; --window-size gives every window layer the same window),
    None where no layer of this stage keeps a ring."""
    kv_past_windows: int | None = None
    """Cache bytes one token costs on this rank past ``window_slots`` tokens (its full layers only)."""

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations


def _stage_params(model_cfg, parallel, r: int) -> tuple[int, list, bool]:
    """(parameter count, each decoder layer's sliding window or None, whether an MoE layer is among them) of
    pipeline rank ``r``, tp rank 0."""
    from omnitron.plan.state import skeleton

    chunks = skeleton(model_cfg, parallel, r)
    count = sum(p.numel() for m in chunks for p in m.parameters())
    layers = [layer for m in chunks for layer in m.decoder.layers.values()] if chunks else []
    moe = any(hasattr(layer.mlp, "router") for layer in layers)
    return count, [getattr(layer.self_attention, "window", None) for layer in layers], moe


def held_slots(windows: list, seq_length: int) -> int:
    """Slots a request holds over the layers of ``windows`` (each layer's window or None): ``seq_length`` in a
    full layer, at most ``left + 1`` in a window layer (:class:`~omnitron.core.inference.kv_cache.RingBuffer`; not
    under multi-latent attention, whose latents every layer keeps)."""
    return sum(seq_length if w is None or w[0] < 0 else min(seq_length, w[0] + 1) for w in windows)


def serve_estimate(settings, requests: int, seq_length: int, prompt: int | None = None,
                   padded: bool = True, log_probs: bool = False) -> list[ServeMemory]:
    """Every pipeline stage's :class:`ServeMemory` for ``requests`` sequences of ``seq_length`` tokens (prompt and
    generated; the prefill of ``prompt`` tokens, default all ``seq_length``; ``padded``: prompts of different
    lengths, so the masked attention path; ``log_probs``: the prompt's log-probs asked, so its logits computed)."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan import serve_families as F
    from omnitron.plan.memory import model_config

    F.check_serving_family(settings)
    if requests < 1 or seq_length < 1:
        raise ConfigError(f"--inference-max-requests ({requests}) and --inference-max-seq-length ({seq_length}) "
                          "must be at least 1")
    cfg, pc = model_config(settings), settings.parallel
    limit = cfg.max_position_embeddings or cfg.seq_length
    if seq_length > limit:
        raise ConfigError(f"--inference-max-seq-length {seq_length} is more than the model's {limit} positions "
                          "(--max-position-embeddings); generation stops there: give at most that")
    tp, elem = pc.tensor_model_parallel_size, cfg.params_dtype.itemsize  # --bf16 / --fp16, else fp32
    cfg, family = _serving(cfg), getattr(settings, "model_type", "gpt")
    if family == "t5":
        layers, weights, kv, act = F.t5_memory(cfg, requests, seq_length, prompt, elem)
        return [ServeMemory(0, layers, requests, seq_length, weights, kv, kv_bytes_per_token(cfg, 1, layers, elem),
                            act)]
    if family == "multimodal":
        F.check_llava(cfg, seq_length, prompt)
    out = []
    for r in range(pc.pipeline_model_parallel_size):
        count, windows, moe = _stage_params(cfg, pc, r)
        layers = len(windows)
        per_token = kv_bytes_per_token(cfg, tp, layers, elem)
        act = prefill_bytes(cfg, tp, requests, prompt or seq_length, elem,
                            last=r == pc.pipeline_model_parallel_size - 1, moe=moe, padded=padded,
                            log_probs=log_probs)
        if family == "multimodal":  # the vision tower's forward before the language model's prefill
            act = max(act, F.vision_bytes(cfg, requests, elem))
        rings = windows if not getattr(cfg, "multi_latent_attention", False) else [None] * layers
        kv = requests * held_slots(rings, seq_length) * kv_bytes_per_token(cfg, tp, 1, elem)
        bounded = [w[0] + 1 for w in rings if w is not None and w[0] >= 0]
        past = kv_bytes_per_token(cfg, tp, layers - len(bounded), elem)
        out.append(ServeMemory(r, layers, requests, seq_length, count * elem, kv, per_token, act,
                               max(bounded) if bounded else None, past if bounded else None))
    return out


def _serving(cfg):
    """The model as served: no recomputation (its ``params_dtype`` is already --bf16 / --fp16's)."""
    from dataclasses import replace

    return replace(cfg, recompute_granularity=None, recompute_method=None)


def largest_batch(settings, seq_length: int, memory: int, log_probs: bool = False) -> int:
    """The most requests of ``seq_length`` tokens whose largest rank fits ``memory`` bytes (0: not even one;
    ``log_probs``: the prompts' asked)."""
    fits = lambda b: max(s.total for s in serve_estimate(settings, b, seq_length,  # noqa: E731
                                                         log_probs=log_probs)) <= memory
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _kv_rate(top: ServeMemory) -> str:
    """What a token adds to the cache: one rate, or (sequences longer than the windows) the rate within the
    windows and the full layers' rate past them."""
    if top.window_slots is None or top.seq_length <= top.window_slots:
        return f"{top.kv_per_token} bytes a token"
    return (f"{top.kv_per_token} bytes a token for a sequence's first {top.window_slots} tokens, "
            f"{top.kv_past_windows} bytes a token past them (window layers keep their last {top.window_slots})")


def format_serve(stages: list[ServeMemory], memory: int | None = None, largest: int | None = None) -> str:
    """One row per stage (GiB) and the largest rank; with ``memory``, whether it fits and the largest batch."""
    def gib(n: int) -> str:
        return f"{n / 2**30:10.3f}"

    head = f"{'stage':>5} {'layers':>6} {'weights':>10} {'kv-cache':>10} {'activations':>11} {'total':>10}  (GiB)"
    rows = [head] + [f"{s.stage:>5} {s.layers:>6} {gib(s.weights)} {gib(s.kv_cache)}  {gib(s.activations)} "
                     f"{gib(s.total)}" for s in stages]
    top = max(stages, key=lambda s: s.total)
    rows.append(f"largest rank: stage {top.stage}, {top.total / 2**30:.3f} GiB ({top.total} bytes); KV cache on it: "
                f"{_kv_rate(top)}, {top.kv_cache} bytes at {top.requests} requests x {top.seq_length} tokens")
    if memory is not None:
        verdict = "fits" if top.total <= memory else "DOES NOT FIT"
        rows.append(f"{verdict} {memory / 2**30:.1f} GiB; the most requests of {top.seq_length} tokens that fit: "
                    f"{largest}")
    return "\n".join(rows)
