"""Context parallelism: ring attention against plain attention on the whole sequence, and GPT
training with the sequence split over cp ranks against one process (fp32, 1e-5 per step).

Every configuration of one world size runs inside one spawned world (spawns cost seconds).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.context import chunk_positions, split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import run_distributed

# ---- (a) ring attention -------------------------------------------------------------------
ATTN_CASES = [(causal, hq, hkv, dtype) for causal in (True, False) for hq, hkv in ((4, 4), (4, 2), (4, 1))
              for dtype in (torch.float64, torch.float32)]


def _reference_attention(q, k, v, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v on the whole sequence, keys/values repeated per query group."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def ring_worker(cps: list[int]) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context import ring_attention

    torch.set_num_threads(1)
    coll, out = get_backend().collectives, []
    for cp in cps:
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp), coll)
        for n, (causal, hq, hkv, dtype) in enumerate(ATTN_CASES):
            g = torch.Generator().manual_seed(100 * cp + n)  # the same full tensors on every rank
            b, s, d = 2, 8 * cp, 8
            q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = _reference_attention(*full, causal)
            ref.backward(dout)
            mine = [split_sequence(t, 2, cp, groups.cp.rank).to(dtype).requires_grad_(True) for t in (q, k, v)]
            o = ring_attention(*mine, group=groups.cp, collectives=coll, causal=causal)
            o.backward(split_sequence(dout, 2, cp, groups.cp.rank).to(dtype))
            got = [o] + [t.grad for t in mine]
            want = [split_sequence(t, 2, cp, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
            err = max(((a.double() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
            out.append(((cp, causal, hq, hkv, str(dtype)), err, o.dtype == dtype))
    return out


def test_ring_attention_matches_full_attention():
    for rank_result in run_distributed(ring_worker, 4, [2, 4]):
        assert len(rank_result) == 2 * len(ATTN_CASES)
        for case, err, dtype_kept in rank_result:
            tol = 1e-12 if case[-1] == "torch.float64" else 2e-6
            assert dtype_kept and err < tol, (case, err)


def test_load_balanced_layout():
    """Chunks r and 2cp-1-r: the ranks' positions partition the sequence, each in increasing order."""
    for cp in (1, 2, 3, 4):
        parts = [chunk_positions(24, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(24))
        for r, p in enumerate(parts):
            c = 24 // (2 * cp)
            assert p.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    with pytest.raises(ValueError, match="divisible by 2 x --context-parallel-size 4"):
        chunk_positions(20, 4, 0)
