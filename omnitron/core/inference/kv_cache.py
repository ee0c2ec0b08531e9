"""Key/value caches installed on a model's attention modules for incremental decoding.

:class:`KVCache` replaces each decoder self-attention's ``core_attention`` (an instance attribute
shadowing the method; removed on exit) with one that appends the step's keys/values to a per-layer
cache, so each new token costs one position's forward instead of the whole prefix. Rows of a batch
share cache slots: prompts are LEFT-padded to one length, and ``valid [b, slots]`` (set by the caller
before each forward) says which slots hold real tokens. A query at slot ``q`` attends to the valid
slots ``k <= q`` (and to itself, so a padding query never sees an empty row: its output is unused,
but an all-masked softmax would put NaN into the cache). Without padding the backend's fused
attention kernel runs as before (causal prefill, then single queries over the whole cache).

Each layer's slots live in a :class:`SlotBuffer`: storage for ``capacity`` slots (generation passes the
longest sequence it can reach: prompt width + new tokens) allocated on the first step, each step's
keys/values written in place after the last, attention reading a view of the slots so far. Decoding
``n`` tokens so copies each slot once, where concatenating the cache every step copied ``O(n^2)`` slots
and held the old and the new cache at once (peak 1.56x the final cache, measured under sim).

Multi-latent attention (DeepSeek) keeps each slot's normalised latent and its rotated shared key part
(``kv_lora_rank + qk_pos_emb_head_dim`` numbers per token and layer) instead of every head's key and
value (:meth:`KVCache.bytes_per_token`); single-token steps attend to the latents directly, the up-projection
absorbed into the query and the output (:mod:`omnitron.core.transformer.mla_absorbed`), other steps expand
them with the layer's up-projection.

:class:`CrossKVCache` memoizes each T5 decoder layer's cross-attention key/value projection of the
encoder output ("memory"), which does not change while decoding: computed on the first step, reused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Per-layer self-attention key/value cache over ``model.decoder.layers`` (``with KVCache(model) as c:``)."""

    def __init__(self, model, capacity: int | None = None) -> None:
        """``capacity``: the slots to allocate per layer on the first step (None: the first step's; either grows
        by doubling when a step passes it)."""
        self.attn = [layer.self_attention for layer in model.decoder.layers.values()]
        self.latent = all(hasattr(a, "latent_cache") for a in self.attn)  # multi-latent attention: latents kept
        dim = 0 if self.latent else 2  # the slot dimension: latents [s, b, r], keys / values [b, heads, s, d]
        self.buffers = [(SlotBuffer(dim, capacity), SlotBuffer(dim, capacity)) for _ in self.attn]
        self.keys: list[torch.Tensor | None] = [None] * len(self.attn)
        """Layer ``i``'s keys over every slot so far (a view of its buffer; the latents under MLA)."""
        self.values: list[torch.Tensor | None] = [None] * len(self.attn)
        self.valid: torch.Tensor | None = None
        """``[b, slots]`` bool, True at real tokens; None = every slot is real (no padding)."""
        self._rotated: tuple | None = None  # (valid, its prefill rotations): see _rotations

    def _core(self, i: int, module):
        def core_attention(q, k, v, key_padding_mask=None, document_ids=None):  # [b, heads, s_new, d]
            if key_padding_mask is not None or document_ids is not None:
                raise ValueError("KVCache decodes causal models; a key padding mask (bidirectional attention, BERT) "
                                 "or packed-document ids have nothing to generate")
            k, v = self.append(i, k, v)
            return self._attend(module, q, k, v)

        return core_attention

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values (latents and rotated key parts under MLA) over every slot, this step's
        new ones written after the cached ones."""
        kb, vb = self.buffers[i]
        self.keys[i], self.values[i] = kb.append(k), vb.append(v)
        return self.keys[i], self.values[i]

    def _attend(self, module, q, k, v):
        """Attention of the new queries (the last ``s_new`` slots) over every cached slot."""
        s_new, s_all = q.shape[2], k.shape[2]
        scale = getattr(module, "softmax_scale", None)  # multi-latent attention's YaRN-corrected scale
        sinks = module.sinks() if hasattr(module, "sinks") else None
        if getattr(module, "window", None) is not None or sinks is not None:
            return self._window_sink(module, q, k, v, sinks)
        if self.valid is None:
            if s_new > 1 and s_new != s_all:
                raise ValueError("KVCache: multi-token steps after the prefill need a validity mask (set .valid)")
            return module.backend.kernels.attention(q, k, v, causal=s_new > 1, dropout_p=0.0,
                                                    **({} if scale is None else {"scale": scale}))
        keep = self.keep(q.shape[0], s_new, s_all, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None], enable_gqa=k.shape[1] != q.shape[1],
                                              scale=scale)

    def keep(self, b: int, s_new: int, s_all: int, device) -> torch.Tensor | None:
        """``[b|1, s_new, s_all]`` bool: the slots each new query (the last ``s_new``) attends to, causal and valid
        (and itself); None when that is every slot (one query, no padding)."""
        if self.valid is None and s_new == 1:
            return None
        qpos = torch.arange(s_all - s_new, s_all, device=device)[:, None]  # [s_new, 1] slot of each query
        kpos = torch.arange(s_all, device=device)[None, :]  # [1, s_all]
        if self.valid is None:
            return (kpos <= qpos)[None]
        if tuple(self.valid.shape) != (b, s_all):
            raise ValueError(f"KVCache.valid must be [batch, slots] = {(b, s_all)}, got {tuple(self.valid.shape)}")
        return (kpos <= qpos) & (self.valid[:, None, :] | (kpos == qpos))  # [b, s_new, s_all]

    def _window_sink(self, module, q, k, v, sinks):
        """Sliding window and attention sinks (transformer/window.py) over the cached slots: slot distances are
        position distances (a row's real tokens are contiguous after its left padding). A prefill (every slot new)
        runs the training path's blocks (:meth:`_tiled_prefill`); a step of a few new queries the masked softmax,
        whose scores are ``[b, hq, s_new, slots]``."""
        from omnitron.core.transformer.window import keep_mask, sink_attention

        s_new, s_all = q.shape[2], k.shape[2]
        scale = getattr(module, "softmax_scale", None)
        if s_new == s_all > 1 and getattr(module, "cp_group", None) is None:
            out = self._tiled_prefill(module, q, k, v, sinks, scale)
            if out is not None:
                return out
        qpos, kpos = torch.arange(s_all - s_new, s_all, device=q.device), torch.arange(s_all, device=q.device)
        keep = keep_mask(qpos, kpos, module.window)  # [s_new, s_all]
        if self.valid is not None:
            keep = keep & (self.valid[:, None, :] | (kpos[None, :] == qpos[:, None]))  # [b, s_new, s_all]
            keep = keep[:, None]
        return sink_attention(q, k, v, keep, None if sinks is None else sinks.to(q.device), scale)

    def _tiled_prefill(self, module, q, k, v, sinks, scale):
        """The prefill's attention on the blocks of training (:func:`~omnitron.core.transformer.cp_attention.
        cp_attention` without context parallelism: only the tiles the window reaches, the sink once per row), not a
        masked softmax over ``[b, hq, s, s]`` scores. Left-padded rows go through in one call, each rotated by its
        padding (:meth:`_rotations`, a gather) so its real slots come first: there a row's slots are its positions
        and causality keeps its real queries off the padding behind them, as for the unpadded prompt. Rotated back,
        a padding query's output (unused, but cached as the next layer's key/value input) is zero (finite). None
        when a row's real slots are not contiguous after its padding (the masked softmax handles that)."""
        from omnitron.core.transformer.cp_attention import cp_attention

        def attend(q, k, v):
            return cp_attention(module, q, k, v, 0.0, scale=scale, window=getattr(module, "window", None), sinks=sinks)

        if self.valid is None:
            return attend(q, k, v)
        rot = self._rotations()
        if rot is None:
            return None
        first, back = rot
        out = attend(_slots(q, first), _slots(k, first), _slots(v, first))
        return _slots(out, back) * self.valid[:, None, :, None]

    def _rotations(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(first, back) [b, s]`` slot indices: ``first`` rotates each row of ``valid`` left by its padding (its
        real slots to the front), ``back`` undoes it; None when a row's real slots are not all after its padding.
        Worked out once per ``valid`` tensor (one host sync for the contiguity check, not one per row or layer)."""
        if self._rotated is None or self._rotated[0] is not self.valid:
            valid = self.valid
            slots = torch.arange(valid.shape[1], device=valid.device)[None, :]
            pad = (~valid).sum(1, keepdim=True)  # [b, 1]: padding slots per row
            contiguous = bool((valid == (slots >= pad)).all())
            rot = ((slots + pad) % valid.shape[1], (slots - pad) % valid.shape[1]) if contiguous else None
            self._rotated = (valid, rot)
        return self._rotated[1]

    def _attend_only(self, module):
        def core_attention(q, k, v, key_padding_mask=None, document_ids=None):  # keys and values: every slot
            return self._attend(module, q, k, v)

        return core_attention

    def bytes_per_token(self) -> float:
        """Cache bytes per cached slot (all layers, one batch row): what generation holds per token."""
        held = [t for t in self.keys + self.values if t is not None]
        if not held:
            return 0.0
        slots, rows = (held[0].shape[0], held[0].shape[1]) if self.latent else (held[0].shape[2], held[0].shape[0])
        return sum(t.numel() * t.element_size() for t in held) / (slots * rows)

    def __enter__(self) -> "KVCache":
        for i, a in enumerate(self.attn):
            if self.latent:
                a.latent_cache, a.core_attention = LatentSlots(self, i), self._attend_only(a)
            else:
                a.core_attention = self._core(i, a)
        return self

    def __exit__(self, *exc) -> None:
        for a in self.attn:
            del a.core_attention  # back to the class method
            if self.latent:
                a.latent_cache = None


def _slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t [b, h, s, d]`` with each row's slots taken in the order ``index [b, s]``."""
    return t.gather(2, index[:, None, :, None].expand(t.shape[0], t.shape[1], -1, t.shape[3]))


class SlotBuffer:
    """Slots appended along ``dim``, written in place into storage allocated once (see the module docstring)."""

    def __init__(self, dim: int, capacity: int | None = None) -> None:
        self.dim, self.capacity, self.filled = dim, capacity, 0
        self.store: torch.Tensor | None = None

    def append(self, new: torch.Tensor) -> torch.Tensor:
        """Every slot so far (a view of the storage), ``new``'s slots after the earlier ones."""
        need = self.filled + new.shape[self.dim]
        if self.store is None or need > self.store.shape[self.dim]:  # first step, or past the capacity
            shape = list(new.shape)
            shape[self.dim] = max(need, self.capacity or 0, 2 * self.filled)
            store = new.new_empty(shape)
            if self.filled:
                store.narrow(self.dim, 0, self.filled).copy_(self.store.narrow(self.dim, 0, self.filled))
            self.store = store
        self.store.narrow(self.dim, self.filled, new.shape[self.dim]).copy_(new)
        self.filled = need
        return self.store.narrow(self.dim, 0, need)


class LatentSlots:
    """Multi-latent attention layer ``i``'s cache: ``(latent [s, b, r], k_pe [s, b, 1, dr])`` of the new slots in,
    the same over every slot out (the layer's normalised latents and rotated shared key parts); :meth:`keep`
    the slots its new queries see (:meth:`KVCache.keep`)."""

    def __init__(self, cache: KVCache, i: int) -> None:
        self.cache, self.i = cache, i

    def __call__(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.append(self.i, latent, k_pe)

    def keep(self, b: int, s_new: int, s_all: int, device) -> torch.Tensor | None:
        return self.cache.keep(b, s_new, s_all, device)


class CrossKVCache:
    """Each decoder layer's cross-attention ``linear_kv(memory)``, computed once (``with CrossKVCache(model):``)."""

    def __init__(self, model) -> None:
        self.linears = [layer.cross_attention.linear_kv for layer in model.decoder.layers.values()]

    def __enter__(self) -> "CrossKVCache":
        for lin in self.linears:
            forward, store = lin.forward, {}

            def cached(memory, forward=forward, store=store):
                if "kv" not in store:
                    store["kv"] = forward(memory)
                return store["kv"]

            lin.forward = cached
        return self

    def __exit__(self, *exc) -> None:
        for lin in self.linears:
            del lin.forward  # back to the class method
