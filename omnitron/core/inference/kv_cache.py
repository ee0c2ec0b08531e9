"""Key/value caches installed on a model's attention modules for incremental decoding.

:class:`KVCache` replaces each decoder self-attention's ``core_attention`` (an instance attribute
shadowing the method; removed on exit) with one that appends the step's keys/values to a per-layer
cache, so each new token costs one position's forward instead of the whole prefix. Rows of a batch
share cache slots: prompts are LEFT-padded to one length, and ``valid [b, slots]`` (set by the caller
before each forward) says which slots hold real tokens. A query at slot ``q`` attends to the valid
slots ``k <= q`` (and to itself, so a padding query never sees an empty row: an all-masked softmax
would put NaN into the cache; its output, unused, is then zeroed, as a padding-masked attention gives
it). Without padding the backend's fused attention kernel runs as before (causal prefill, then single
queries over the whole cache); a step of several new queries after the prefill (speculative decoding,
chunked prefill) takes the causal mask of :meth:`KVCache.keep`, with or without padding.

Each layer's slots live in a :class:`SlotBuffer`: storage for ``capacity`` slots (generation passes the
longest sequence it can reach: prompt width + new tokens) allocated on the first step, each step's
keys/values written in place after the last, attention reading a view of the slots so far. Decoding
``n`` tokens so copies each slot once, where concatenating the cache every step copied ``O(n^2)`` slots
and held the old and the new cache at once (peak 1.56x the final cache, measured under sim).

A sliding-window layer (window ``(left, 0)``: a query sees itself and the ``left`` slots before it) keeps only the
last ``left + 1`` slots in a :class:`RingBuffer` (slot ``n`` stored at ``n % (left + 1)``), whatever the sequence's
length: the prefill attends over its own keys as before and leaves its last ``left + 1`` in the ring; a later
step's query attends over the ring, masked by each ring entry's slot number (keys carry their rotary positions
from before the cache, so wrap-around changes nothing but the order of the keys).

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
        self.buffers = [(_buffer(a, dim, capacity), _buffer(a, dim, capacity)) for a in self.attn]
        self.keys: list[torch.Tensor | None] = [None] * len(self.attn)
        """Layer ``i``'s keys over the slots it holds (a view of its buffer: every slot so far, a window layer's
        last ones in ring order; the latents under MLA)."""
        self.values: list[torch.Tensor | None] = [None] * len(self.attn)
        self.valid: torch.Tensor | None = None
        """``[b, slots]`` bool, True at real tokens; None = every slot is real (no padding)."""
        self._rotated: tuple | None = None  # (valid, its prefill rotations): see _rotations
        self._ring_slots: tuple | None = None  # the last append's (query slots, key slots) where a ring reordered them

    def _core(self, i: int, module):
        def core_attention(q, k, v, key_padding_mask=None, document_ids=None):  # [b, heads, s_new, d]
            if key_padding_mask is not None or document_ids is not None:
                raise ValueError("KVCache decodes causal models; a key padding mask (bidirectional attention, BERT) "
                                 "or packed-document ids have nothing to generate")
            k, v = self.append(i, k, v)
            return self._attend(module, q, k, v)

        return core_attention

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s keys and values (latents and rotated key parts under MLA) that this step's queries attend
        over: every slot, this step's new ones written after the cached ones (a window layer: the slots its window
        reaches, their slot numbers kept for the mask)."""
        kb, vb = self.buffers[i]
        if isinstance(kb, RingBuffer):
            (k, kpos), (v, _) = kb.append(k), vb.append(v)
            self.keys[i], self.values[i] = kb.held(), vb.held()
            self._ring_slots = (torch.arange(kb.filled - kb.new, kb.filled, device=kpos.device), kpos)
            return k, v
        self._ring_slots = None
        self.keys[i], self.values[i] = kb.append(k), vb.append(v)
        return self.keys[i], self.values[i]

    def _attend(self, module, q, k, v):
        """:meth:`_attend_slots`, with a padding query's output zeroed (finite either way; zero as a padding-masked
        attention gives it, whichever path ran: the masked softmax lets a padding query see itself so that its row
        is never empty). With left padding the last slot is real in every row, so single-query steps skip this."""
        out = self._attend_slots(module, q, k, v)
        if self.valid is None or q.shape[2] == 1:
            return out
        return out * self.valid[:, None, self.valid.shape[1] - q.shape[2]:, None].to(out.dtype)

    def _attend_slots(self, module, q, k, v):
        """Attention of the new queries (the last ``s_new`` slots) over every cached slot."""
        s_new, s_all = q.shape[2], k.shape[2]
        scale = getattr(module, "softmax_scale", None)  # multi-latent attention's YaRN-corrected scale
        sinks = module.sinks() if hasattr(module, "sinks") else None
        if getattr(module, "window", None) is not None or sinks is not None:
            return self._window_sink(module, q, k, v, sinks)
        if self.valid is None and s_new in (1, s_all):  # one query over every slot, or the causal prefill
            return module.backend.kernels.attention(q, k, v, causal=s_new > 1, dropout_p=0.0,
                                                    **({} if scale is None else {"scale": scale}))
        # NOTE: not the kernel's causal flag for several new queries after the prefill (a speculative or chunked
        # step): its mask is aligned top-left (query j sees keys 0..j), these queries sit at the last s_new slots
        keep = self.keep(q.shape[0], s_new, s_all, q.device)  # [b|1, s_new, s_all]
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
        if self._ring_slots is not None:  # a ring's keys: their slot numbers, in ring order
            qpos, kpos = self._ring_slots
        else:
            qpos, kpos = torch.arange(s_all - s_new, s_all, device=q.device), torch.arange(s_all, device=q.device)
        keep = keep_mask(qpos, kpos, module.window)  # [s_new, s_all]
        if self.valid is not None:
            valid = self.valid if self._ring_slots is None else self.valid[:, kpos]  # a ring's: by slot number
            keep = keep & (valid[:, None, :] | (kpos[None, :] == qpos[:, None]))  # [b, s_new, s_all]
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
        """Cache bytes a slot costs in every layer (one batch row): what generation holds per token while the
        sequence is within every window."""
        held = [t for t in self.keys + self.values if t is not None]
        slot, row = (0, 1) if self.latent else (2, 0)
        return float(sum(t.numel() * t.element_size() / (t.shape[slot] * t.shape[row]) for t in held))

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


def _buffer(module, dim: int, capacity: int | None):
    """A layer's slot storage: a :class:`RingBuffer` of its window's ``left + 1`` slots where the window is shorter
    than the ``capacity`` (or no capacity is known), else a :class:`SlotBuffer`."""
    window = getattr(module, "window", None)
    if dim == 2 and window is not None and window[0] >= 0 and (capacity is None or capacity > window[0] + 1):
        return RingBuffer(dim, window[0] + 1)
    return SlotBuffer(dim, capacity)


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


class RingBuffer:
    """A window layer's last ``size`` slots along ``dim``: slot ``n`` stored at ``n % size`` (module docstring)."""

    def __init__(self, dim: int, size: int) -> None:
        self.dim, self.size, self.filled, self.new = dim, size, 0, 0
        self.store: torch.Tensor | None = None

    def held(self) -> torch.Tensor:
        """The stored slots, in ring order (a view of the storage)."""
        return self.store.narrow(self.dim, 0, min(self.filled, self.size))

    def slot_numbers(self, device) -> torch.Tensor:
        """``[held]`` the slot number each stored entry holds: the latest ``n < filled`` with ``n % size == r``."""
        r = torch.arange(min(self.filled, self.size), device=device)
        return self.filled - 1 - (self.filled - 1 - r) % self.size

    def append(self, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, slot numbers [s])``: what the new slots' queries attend over (window ``size - 1`` slots back),
        and the new slots stored (the last ``size`` of them). The first step (a prefill) gets its own slots; a
        single new slot the ring after it is written (it then holds exactly the window); several new slots after
        the first step the held ones and the new ones (a copy)."""
        n, start = new.shape[self.dim], self.filled
        if self.store is None:
            shape = list(new.shape)
            shape[self.dim] = self.size
            self.store = new.new_empty(shape)
        slots = torch.arange(start, start + n, device=new.device)
        out = new if start == 0 else None
        if n > 1 and start > 0:
            out, slots = torch.cat([self.held(), new], self.dim), torch.cat([self.slot_numbers(new.device), slots])
        kept = min(n, self.size)
        index = torch.arange(start + n - kept, start + n, device=new.device) % self.size
        self.store.index_copy_(self.dim, index, new.narrow(self.dim, n - kept, kept))
        self.filled, self.new = start + n, n
        if out is None:  # one new slot after the first step: the ring holds its window
            return self.held(), self.slot_numbers(new.device)
        return out, slots


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
