"""Counter-based attention dropout under context parallelism (omnitron/kernels/hash_dropout.py).

(a) The hash: the int32 tensor mix equals exact integer arithmetic (Python ints) on random and boundary values,
and a tile's keep mask equals the element-by-element integer hash; narrowed tiles are slices of the whole mask;
the keep rate is 1 - p within its binomial bound, and masks of neighbouring seeds, batches, heads and rows are
independent (both-dropped rate p^2 within its bound).
(b) The chunked reference block (several ragged row chunks) with hash dropout: forward and backward against
autograd of the direct float64 attention (full scores, the hash mask, softmax, dropout, matmul), so the mask
backward regenerates is the forward's.
(c) cp2 p2p ring, a2a and allgather with dropout through the engine's entry (``cp_attention``, the seed drawn
from the tracker): loss and every gradient against the direct one-process float64 attention with the same hash
mask; the seed is the same on both cp ranks. A GPT model at cp2 draws a new seed per layer and per step, and
selective recomputation replays them (gradients identical). On sim, dropout adds no host sync to any path
(sim counts them). Slow: cp4 (a2a+p2p 2x2 too) and tp2 x cp2 (tp ranks
draw different seeds, cp ranks the same).
"""
from __future__ import annotations

import math
import types

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.context import split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.kernels import hash_dropout as H
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from test_cp_variants import _layouts  # p2p, a2a, allgather (and a2a+p2p 2 x 2 at cp4)


def _fresh() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))


def _int32(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values (int64) as int32 bit patterns."""
    return torch.where(u >= 2 ** 31, u - 2 ** 32, u).to(torch.int32)


def _keep_int(seed: int, p: float, b: int, h: int, q: int, k: int) -> bool:
    """The keep decision of one element in exact integer arithmetic (the module's documented chain)."""
    m = H.mix32_int
    row = m(m(m(H.seed_key(seed) ^ b) ^ h) ^ q)
    return m(row ^ m(k ^ H._SALT)) >= round(p * 2 ** 32)


# ---- (a) the hash ---------------------------------------------------------------------------------
def test_tensor_mix_equals_integer_arithmetic():
    g = _fresh()
    u = torch.randint(0, 2 ** 32, (4096,), generator=g, dtype=torch.int64)
    u[:5] = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1])
    got = H.mix32_(_int32(u)).to(torch.int64) % 2 ** 32
    assert got.tolist() == [H.mix32_int(int(x)) for x in u]


def test_tile_mask_equals_elementwise_hash_and_tiles_compose():
    g = _fresh()
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=g))
    p = float(torch.rand(1, generator=g)) * 0.8 + 0.1
    q_pos = torch.randperm(200, generator=g)[:9]  # arbitrary global positions (a rank's chunks are not contiguous)
    k_pos = torch.randperm(200, generator=g)[:7]
    drop = H.HashDropout(seed, p, q_pos, k_pos, head0=3)
    got = drop.multiplier(2, 2, slice(None), torch.float64)
    want = torch.tensor([[[[_keep_int(seed, p, b, 3 + h, int(qi), int(ki)) for ki in k_pos] for qi in q_pos]
                          for h in range(2)] for b in range(2)], dtype=torch.float64) / (1 - p)
    assert torch.equal(got, want)
    # the compiled layer's seed: its key as a 0-dim int32 tensor (RNGTracker.hash_seed) draws the same mask
    key = torch.tensor(H.row_key(seed), dtype=torch.int32)
    assert torch.equal(drop._replace(seed=key).multiplier(2, 2, slice(None), torch.float64), want)
    rows, cols = slice(2, 7), slice(1, 5)
    assert torch.equal(drop.narrow(rows, cols).multiplier(2, 2, slice(1, 4), torch.float64),
                       got[:, :, rows][:, :, 1:4, cols])


@pytest.mark.parametrize("p", [0.1, None])
def test_keep_rate_and_independence(p):
    g = _fresh()
    p = float(torch.rand(1, generator=g)) * 0.9 + 0.05 if p is None else p
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=g))
    b, h, s = 2, 4, 384
    pos = torch.arange(s) + int(torch.randint(0, 10 ** 6, (1,), generator=g))
    dropped = H.HashDropout(seed, p, pos, pos).multiplier(b, h, slice(None), torch.float32) == 0
    n = dropped.numel()
    # keep rate: a mean of n Bernoulli(p) draws has sd sqrt(p(1-p)/n); the threshold's quantisation adds <= 2^-33.
    # 6 sd: a false alarm once in ~5e8 runs; a biased hash (e.g. 1 bit lost: p off by 2x) misses by hundreds of sd
    assert abs(dropped.double().mean().item() - p) < 6 * math.sqrt(p * (1 - p) / n) + 2 ** -33
    # neighbours: rows q and q+1, heads h and h+1, batches, seeds s and s+1: both dropped with rate p^2 when
    # independent (sd sqrt(p^2 (1 - p^2) / m) over m pairs); a shared or shifted mask gives p, far outside
    other = H.HashDropout(seed + 1, p, pos, pos).multiplier(b, h, slice(None), torch.float32) == 0
    for x, y in ((dropped[:, :, 1:], dropped[:, :, :-1]), (dropped[:, 1:], dropped[:, :-1]),
                 (dropped[1:], dropped[:1]), (dropped, other), (dropped[..., 1:], dropped[..., :-1])):
        both, m = (x & y).double().mean().item(), x.numel()
        assert abs(both - p * p) < 6 * math.sqrt(p * p * (1 - p * p) / m), (both, p * p)


def test_refuses_bad_p():
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        H.block_positions(torch.arange(2), torch.arange(2), 1, 1.0)
    assert H.block_positions(torch.arange(2), torch.arange(2), 1, 0.0) is None


# ---- (b) the chunked reference block ---------------------------------------------------------------
def _direct(q, k, v, scale, keep, mult):
    """softmax(q k^T scale masked) * dropout multiplier @ v, float64, key/value heads repeated."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) * mult) @ v


@pytest.mark.parametrize("causal,sk", [(True, 23), (False, 23), (False, 17)])
def test_chunked_block_with_dropout_matches_direct_attention(monkeypatch, causal, sk):
    from omnitron.kernels.reference import attention_block as AB

    monkeypatch.setattr(AB, "ROW_CHUNK", 5)  # 23 rows: chunks of 5, 5, 5, 5, 3
    g = _fresh()
    b, hq, hkv, sq, d, p, scale = 2, 4, 2, 23, 8, 0.3, 0.4
    q = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(b, hkv, sk, d, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, hq, sq, d, generator=g, dtype=torch.float64)
    drop = H.HashDropout(int(torch.randint(0, 2 ** 62, (1,), generator=g)), p, torch.randperm(99, generator=g)[:sq],
                         torch.randperm(99, generator=g)[:sk], head0=2)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    keep = keep.tril() if causal else keep
    want = _direct(q, k, v, scale, keep, drop.multiplier(b, hq, slice(None), torch.float64))
    want.backward(dout)
    out, lse = AB.block_forward(q.detach(), k.detach(), v.detach(), causal=causal, scale=scale, drop=drop)
    grads = AB.block_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, causal=causal, scale=scale, drop=drop)
    # float64: the two differ only in the order of sums over <= 23 keys and 8 head dims (~30 u = 7e-15 relative
    # to each tensor's largest entry); a mask drawn differently in backward moves gradients by O(1)
    for got, ref in zip((out, *grads), (want, q.grad, k.grad, v.grad)):
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-12


# ---- (c) context parallelism ----------------------------------------------------------------------
TOL = 1e-11  # float64 as in test_cp_variants: the layouts reorder sums over <= 64 keys (~1e-14 relative)


def _module(groups, comm, backend, tracker):
    sub = (groups.cp_a2a, groups.cp_p2p) if comm == "a2a+p2p" else None
    return types.SimpleNamespace(cp_group=groups.cp, cp_comm_type=comm, cp_subgroups=sub, tracker=tracker,
                                 backend=backend)


def _recording(tracker) -> list:
    """Make ``tracker.draw_seed`` record what it returns; returns the record."""
    seeds, draw = [], tracker.draw_seed

    def record(device, name=None):
        seeds.append(draw(device) if name is None else draw(device, name))
        return seeds[-1]

    tracker.draw_seed = record
    return seeds


def attention_worker(layouts) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.parallel.tensor.random import MODEL_PARALLEL
    from omnitron.core.transformer.cp_attention import cp_attention
    from omnitron.kernels.reference import attention_block as AB

    torch.set_num_threads(1)
    AB.ROW_CHUNK = 12  # several ragged row chunks per block at these sizes
    be, out = get_backend(), []
    dev = be.device()  # the attention on the backend's device (simccl takes no host tensors), the reference here
    for n, (comm, cfg) in enumerate(layouts):
        groups = ParallelGroups.build(cfg, be.collectives)
        cp, rank = groups.cp.size, groups.cp.rank
        g = torch.Generator().manual_seed(77 + n)  # the same full tensors on every rank
        b, hq, hkv, s, d, p, scale = 2, 4, 2, 32 * cp, 8, 0.3, 0.35
        q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        tracker = RNGTracker(be)
        tracker.add(MODEL_PARALLEL, 5)
        seeds = _recording(tracker)
        mine = [split_sequence(t, 2, cp, rank).to(dev).requires_grad_(True) for t in (q, k, v)]
        o = cp_attention(_module(groups, comm, be, tracker), *mine, p, scale=scale)
        loss = (o * split_sequence(dout, 2, cp, rank).to(dev)).sum()
        loss.backward()
        be.collectives.all_reduce(loss.detach(), group=groups.cp.handle)
        # the direct reference with the hash mask of the seed the engine drew
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        pos = torch.arange(s)
        mult = H.HashDropout(seeds[0], p, pos, pos).multiplier(b, hq, slice(None), torch.float64)
        ref = _direct(*full, scale, torch.ones(s, s, dtype=torch.bool).tril(), mult)
        ref_loss = (ref * dout).sum()
        ref_loss.backward()
        got = [o] + [t.grad for t in mine]
        want = [split_sequence(t, 2, cp, rank) for t in [ref] + [t.grad for t in full]]
        err = max(((a.cpu() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
        err = max(err, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        dropped = (mult == 0)[:, :, torch.ones(s, s, dtype=torch.bool).tril()].double().mean().item()
        out.append(((cp, comm), err, seeds, dropped))
    return out


def _check_attention(per_rank, n: int) -> None:
    assert all(len(r) == n for r in per_rank)
    for results in zip(*per_rank):
        assert len({tuple(seeds) for *_, seeds, _ in results}) == 1, results  # one seed on every cp rank
        for case, err, seeds, dropped in results:
            assert len(seeds) == 1 and err < TOL and 0.25 < dropped < 0.35, (case, err, seeds, dropped)


def test_cp2_dropout_equals_one_process():
    _check_attention(run_distributed(attention_worker, 2, _layouts(2)), 3)


@pytest.mark.slow
def test_cp4_dropout_equals_one_process():
    _check_attention(run_distributed(attention_worker, 4, _layouts(4)), 4)


def _config(recompute: bool):
    from omnitron.core.models.gpt import GPTConfig

    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                     seq_length=16, vocab_size=61, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                     attention_dropout=0.3, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                     position_embedding_type="rope", params_dtype=torch.float64,
                     recompute_granularity="selective" if recompute else None)


def model_worker(tp: int, comm: str) -> dict:
    """The seeds each layer's attention draws over two training steps, and whether selective recomputation gives
    the same gradients (it redraws the seed from the replayed stream)."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.context import context_parallel_batch
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    be = get_backend()
    dev = be.device()  # the host for cpu; sim tensors for sim (its collectives take no host tensors)
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2, cp_comm_type=comm,
                                                 tensor_model_parallel_size=tp), be.collectives)
    g = torch.Generator().manual_seed(5)
    batch = context_parallel_batch({"tokens": torch.randint(0, 61, (2, 16), generator=g).to(dev),
                                    "labels": torch.randint(0, 61, (2, 16), generator=g).to(dev)}, groups.cp)
    grads, seeds = [], []
    for recompute in (False, True):
        model = to_device(GPTModel(_config(recompute), groups, backend=be, seed=3), dev)
        drawn = _recording(model.rng_tracker)
        for _ in range(2):  # two steps
            model.zero_grad()
            model(tokens=batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"]).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        seeds.append(drawn)
    same = all(torch.equal(a, b) for a, b in zip(*grads))
    return {"tp_rank": M.local_rank(groups.tp), "seeds": seeds[0], "replayed": seeds[1], "recompute_same": same}


def _check_model(per_rank, tp: int) -> None:
    by_tp = {}
    for r in per_rank:
        # 2 layers x 2 steps, all different; with recomputation each forward's draw is replayed once more
        assert len(set(r["seeds"])) == 4 and r["recompute_same"], r
        assert sorted(set(r["replayed"])) == sorted(r["seeds"]) and len(r["replayed"]) == 8, r
        by_tp.setdefault(r["tp_rank"], []).append(r["seeds"])
    assert len(by_tp) == tp and all(len({tuple(s) for s in v}) == 1 for v in by_tp.values())  # cp ranks share
    if tp > 1:
        assert not set(by_tp[0][0]) & set(by_tp[1][0])  # tp ranks draw different masks (Megatron's mp stream)


def test_model_seeds_per_layer_and_step_shared_over_cp():
    _check_model(run_distributed(model_worker, 2, 1, "p2p"), 1)


@pytest.mark.slow
def test_model_seeds_differ_over_tp():
    _check_model(run_distributed(model_worker, 4, 2, "a2a"), 2)


def sync_worker() -> dict:
    """Host syncs sim counts in one cp2 attention forward + backward per comm type, with and without dropout
    (the same seeded stream: the dropout seed is drawn from it without a sync)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.parallel.tensor.random import MODEL_PARALLEL
    from omnitron.core.transformer.cp_attention import cp_attention

    be, out = get_backend(), {}
    for comm in ("p2p", "a2a", "allgather"):
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2, cp_comm_type=comm), be.collectives)
        tracker = RNGTracker(be)
        tracker.add(MODEL_PARALLEL, 5)
        for p in (0.0, 0.3):
            q, k, v = (torch.randn(2, 4, 16, 8, device=be.device(), requires_grad=True) for _ in range(3))
            be.reset_sync_count()
            cp_attention(_module(groups, comm, be, tracker), q, k, v, p).sum().backward()
            out[comm, p] = be.sync_count()
    return out


@requires_sim()
def test_dropout_adds_no_host_sync_on_sim():
    # the count without dropout is the path's own (under OMNITRON_STRICT_COLLECTIVES, the collectives' checks)
    for counts in run_distributed(sync_worker, 2, backend="sim"):
        assert all(counts[comm, 0.3] == counts[comm, 0.0] for comm in ("p2p", "a2a", "allgather")), counts
