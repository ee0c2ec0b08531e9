"""The KV cache's slot storage: appended slots equal the concatenation, written in place (one storage while the
capacity holds, a doubling past it)."""
from __future__ import annotations

import torch

from omnitron.core.inference.kv_cache import SlotBuffer


def test_slots_equal_the_concatenation_and_grow_by_doubling():
    g = torch.Generator().manual_seed(5)
    for dim, capacity in ((2, 12), (0, None), (2, 3)):
        buf, ref, stores = SlotBuffer(dim, capacity), None, []
        for n in (5, 1, 1, 1, 4, 1, 1):  # a prefill, then steps
            shape = [2, 3, 4, 6]
            shape[dim] = n
            new = torch.randn(shape, generator=g, dtype=torch.float64)
            ref = new if ref is None else torch.cat([ref, new], dim)
            got = buf.append(new)
            stores.append(got.untyped_storage().data_ptr())
            assert torch.equal(got, ref)
        # capacity 12 holds the 14 slots' first 12: one storage, then one doubling (to 24); none given: every
        # reallocation at least doubles, so O(log n) of them
        assert len(set(stores)) <= 1 + (14 > (capacity or 0)) * 3, (dim, capacity, stores)
        if capacity == 12:
            assert len(set(stores)) == 2 and buf.store.shape[dim] == 24
