"""Context parallelism on the backend's fused block kernel: the ring, a2a and allgather paths at cp2 (cp4 slow)
with grouped-query heads, causal and full, against float64 attention on the whole sequence; the dispatch log
shows the block kernel that ran is the backend's flash kernel (``cpu_flash`` on cpu, ``sim_flash`` on sim);
the ring in bf16 on the bf16 flash kernel; the log-sum-exp merge of flash blocks against a float64 direct
computation; the ring's dropout seed is drawn without a host sync (sim counts syncs).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.context import split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

HEADS = ((8, 2), (4, 1), (4, 4))  # (query heads, key/value heads): grouped-query, multi-query, plain
FLASH = {"cpu": "cpu_flash", "sim": "sim_flash"}


def _attention64(q, k, v, causal: bool) -> torch.Tensor:
    """float64 softmax attention on the whole sequence, key/value heads repeated per query head."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _run_path(kind: str, mine, groups, coll, kernel, causal: bool):
    from omnitron.core.parallel.context import ring_attention
    from omnitron.core.parallel.context.blocks import BlockedAttention
    from omnitron.core.parallel.context.ulysses import a2a_attention, allgather_attention

    if kind == "ring":
        return ring_attention(*mine, group=groups.cp, collectives=coll, causal=causal, kernel=kernel)
    if kind == "a2a":
        scale = mine[0].shape[-1] ** -0.5
        return a2a_attention(*mine, group=groups.cp, attend=lambda q, k, v: BlockedAttention.apply(
            q, k, v, [(slice(None), slice(None), True)], kernel, scale))
    return allgather_attention(*mine, group=groups.cp, kernel=kernel)


def flash_worker(cp: int) -> dict:
    """Every path and head layout at ``cp`` in fp32 on this backend; (max relative error, dispatch counts)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context import backend_kernel

    torch.set_num_threads(1)
    be = get_backend()
    coll, dev, errs = be.collectives, be.current_device(), {}
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp), coll)
    kernel = backend_kernel(be)
    cases = [(kind, causal, h) for kind in ("ring", "a2a", "allgather") for causal in (True, False) for h in HEADS
             if causal or kind == "ring"]  # a2a and allgather are causal only (the GPT path)
    for n, (kind, causal, (hq, hkv)) in enumerate(cases):
        g = torch.Generator().manual_seed(1000 * cp + n)  # fresh inputs, the same full tensors on every rank
        b, s, d = 2, 16 * cp, 16
        q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = _attention64(*full, causal)
        ref.backward(dout)
        mine = [split_sequence(t, 2, cp, groups.cp.rank).float().to(dev).requires_grad_(True) for t in (q, k, v)]
        o = _run_path(kind, mine, groups, coll, kernel, causal)
        o.backward(split_sequence(dout, 2, cp, groups.cp.rank).float().to(dev))
        got = [o] + [t.grad for t in mine]
        want = [split_sequence(t, 2, cp, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
        errs[(kind, causal, hq, hkv)] = max(((a.cpu().double() - w).abs().max() / w.abs().max()).item()
                                            for a, w in zip(got, want))
    ran = {op: dict(be.kernels.get(op).ran) for op in ("attention_block_forward", "attention_block_backward")}
    return {"errs": errs, "ran": ran, "resolved": be.kernels.resolved("attention_block_forward"), "backend": be.name}


def _check(results: list, backend: str) -> None:
    # fp32 against float64: every output element is a softmax-weighted sum over at most s = 64 keys of dot
    # products of d = 16 terms, merged over at most 3 blocks, and each gradient is two more such sums. The
    # worst-case relative rounding of a length-n fp32 sum is n * u (u = 2^-24 = 6e-8); chaining the forward
    # (s + d terms plus the exp/log of the merge, ~8 u) and two backward sums gives 3 * (64 + 16 + 8) u = 1.6e-5
    # against the largest reference element.
    bound = 3 * (64 + 16 + 8) * 2.0 ** -24
    for res in results:
        assert res["backend"] == backend and res["resolved"] == FLASH[backend], res["resolved"]
        for case, err in res["errs"].items():
            assert err < bound, (backend, case, err)
        for op, ran in res["ran"].items():  # every block ran on the fused kernel, none on the reference
            assert set(ran) == {FLASH[backend]} and ran[FLASH[backend]] > 0, (op, ran)


def test_cp_paths_run_the_flash_block_kernel_and_match_float64(backend_name):
    _check(run_distributed(flash_worker, 2, 2), backend_name)  # the suite's backend (--backend)


@pytest.mark.slow
def test_cp4_paths_run_the_flash_block_kernel_and_match_float64(backend_name):
    _check(run_distributed(flash_worker, 4, 4), backend_name)  # the suite's backend (--backend), as at cp2


@requires_sim()
def test_cp_paths_on_sim_run_the_flash_block_kernel_and_match_float64():
    _check(run_distributed(flash_worker, 2, 2, backend="sim"), "sim")


def bf16_ring_worker(cp: int) -> dict:
    """The ring in bf16 (the flash kernel takes bf16 itself; blocks merge in fp32): max relative errors against
    float64 attention of the same bf16-rounded inputs, causal and full, and the dispatch counts."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context import backend_kernel, ring_attention

    torch.set_num_threads(1)
    be = get_backend()
    groups, errs = ParallelGroups.build(ParallelConfig(context_parallel_size=cp), be.collectives), {}
    for causal in (True, False):
        g = torch.Generator().manual_seed(77 + causal)
        b, s, d, hq, hkv = 2, 32 * cp, 64, 8, 2
        q, dout = (torch.randn(b, hq, s, d, generator=g).bfloat16().double() for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g).bfloat16().double() for _ in range(2))
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = _attention64(*full, causal)
        ref.backward(dout)
        dev = be.device()  # the backend under test's device; the float64 reference on the host
        mine = [split_sequence(t, 2, cp, groups.cp.rank).to(dev, torch.bfloat16).requires_grad_(True)
                for t in (q, k, v)]
        o = ring_attention(*mine, group=groups.cp, collectives=be.collectives, causal=causal, kernel=backend_kernel(be))
        o.backward(split_sequence(dout, 2, cp, groups.cp.rank).to(dev, torch.bfloat16))
        want = [split_sequence(t, 2, cp, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
        errs[causal] = [((a.cpu().double() - w).abs().max() / w.abs().max()).item()
                        for a, w in zip([o] + [t.grad for t in mine], want)]
        errs[causal].append(o.dtype == torch.bfloat16)
    return {"errs": errs, "ran": dict(be.kernels.get("attention_block_backward").ran)}


def test_ring_in_bf16_runs_the_flash_kernel_in_bf16(backend_name):
    # u = 2^-8 (bf16). Output: each block's output is rounded to bf16 by the kernel (u) and the merged fp32
    # result once more (u): 2u. Gradients: the kernel's delta = rowsum(dout * out) reads the bf16 output (u),
    # each block's gradient is rounded to bf16 (u), the fp32 sum over blocks is rounded once more (u): 3u; the
    # fp32 accumulation inside the kernel (d = 64, s <= 64 terms) adds < 2^-17. Bound 4u on every tensor.
    bound = 4 * 2.0 ** -8
    for res in run_distributed(bf16_ring_worker, 2, 2):
        assert set(res["ran"]) == {FLASH[backend_name]}, res["ran"]
        for causal, (*errs, kept) in res["errs"].items():
            assert kept and max(errs) < bound, (causal, errs)


def test_lse_merge_of_flash_blocks_equals_float64_attention():
    """Two key blocks through the CPU flash kernel merged by log-sum-exp equal float64 softmax attention and its
    log-sum-exp over all keys (the causal diagonal block plus a full earlier block, as in the ring)."""
    from omnitron.backends.cpu.kernels import block_forward
    from omnitron.core.parallel.context.blocks import merge

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    b, hq, hkv, c, d = 2, 4, 2, 24, 16
    q = torch.randn(b, hq, c, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, 2 * c, d, generator=g, dtype=torch.float64) for _ in range(2))
    scale = d ** -0.5
    out, lse = block_forward(q.float(), k[:, :, c:].float(), v[:, :, c:].float(), causal=True, scale=scale)
    o2, l2 = block_forward(q.float(), k[:, :, :c].float(), v[:, :, :c].float(), causal=False, scale=scale)
    out, lse = out.double(), lse.double()
    merge(out, lse, o2.double(), l2.double())
    # float64 direct: queries are rows c..2c-1 of a 2c sequence, keys 0..2c-1 under the causal mask
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2)) * scale
    s = s.masked_fill(torch.arange(2 * c)[None, :] > torch.arange(c, 2 * c)[:, None], float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want = torch.softmax(s, -1) @ vr
    # fp32 blocks: scores are d = 16-term sums (16 u relative) and the block sums c = 24 terms; the merge adds
    # two exp/log roundings: (16 + 24 + 8) u relative to the largest value, u = 2^-24
    bound = (16 + 24 + 8) * 2.0 ** -24
    assert ((out - want).abs().max() / want.abs().max()).item() < bound
    assert ((lse - want_lse).abs().max() / want_lse.abs().max()).item() < bound


def seed_worker() -> dict:
    """Dropout seeds drawn from the tracker's stream on sim: host syncs counted, and the replay of a snapshot."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor.random import RNGTracker

    be = get_backend()
    tracker = RNGTracker(be)
    tracker.add("model-parallel", 1234)
    snap = tracker.get_states()
    be.reset_sync_count()
    seeds = [tracker.draw_seed(be.current_device()) for _ in range(3)]
    syncs = be.sync_count()
    tracker.set_states(snap)  # what recomputation does: the same states give the same seeds
    return {"seeds": seeds, "syncs": syncs, "replay": [tracker.draw_seed(be.current_device()) for _ in range(3)]}


@requires_sim()
def test_dropout_seed_is_drawn_without_a_host_sync():
    res = run_distributed(seed_worker, 1, backend="sim")[0]
    assert res["syncs"] == 0, res
    assert len(set(res["seeds"])) == 3 and res["replay"] == res["seeds"], res
