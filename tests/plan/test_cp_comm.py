"""The speed model's context-parallel work per ``--cp-comm-type`` (:mod:`omnitron.plan.cp_comm`) against the engine:
its collectives against the calls the engine's cp attention makes (every one recorded with its bytes and group
size, forward and backward, on 4 processes), and the all-gather's blocks against the engine's own task list."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from omnitron.plan import cp_comm, work
from omnitron.testing.distributed import run_distributed

B, HQ, HKV, D = 2, 4, 2, 8
CASES = [("p2p", None), ("a2a", None), ("allgather", None), ("a2a+p2p", (2, 2))]


def _local(cp: int, seq: int) -> work.Local:
    from omnitron.core.models.gpt.presets import gpt2_tiny

    cfg = gpt2_tiny(num_attention_heads=HQ, num_query_groups=HKV, hidden_size=HQ * D, seq_length=seq)
    return work.local_shapes(cfg, 1, cp, B)


class _Spy:
    """The backend's collectives, recording ``(op, bytes as the plan counts them, group size)`` of every call."""

    SIZE = {"all_gather": lambda out, inp, **_: out, "reduce_scatter": lambda out, inp, **_: inp,
            "all_to_all": lambda out, inp, **_: inp}

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in self.SIZE and name != "batch_p2p":
            return attr

        def call(*args, **kwargs):
            import torch.distributed as dist

            n = dist.get_world_size(kwargs.get("group"))
            if name == "batch_p2p":  # one ring hop: what this rank sends
                sent = sum(t.numel() * t.element_size() for kind, t, _ in args[0] if kind == "send")
                self.calls.append(("p2p", sent, n))
            else:
                t = self.SIZE[name](*args[:2])
                self.calls.append((name, t.numel() * t.element_size(), n))
            return attr(*args, **kwargs)

        return call


def recorded_worker(seq_per_rank: int) -> list:
    """Per case: the calls of one forward + backward of the engine's cp attention on bf16 inputs (cp 4)."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.context import split_sequence
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.cp_attention import cp_attention

    torch.set_num_threads(1)
    backend, out = get_backend(), []
    dev = backend.device()
    for comm, sizes in CASES:
        spy = _Spy(backend.collectives)
        config = ParallelConfig(context_parallel_size=4, cp_comm_type=comm,
                                hierarchical_context_parallel_sizes=list(sizes) if sizes else None)
        groups = ParallelGroups.build(config, spy)
        m = SimpleNamespace(cp_group=groups.cp, cp_comm_type=comm, tracker=None,
                            cp_subgroups=(groups.cp_a2a, groups.cp_p2p) if sizes else None,
                            backend=SimpleNamespace(collectives=spy, kernels=backend.kernels))
        s = 4 * seq_per_rank
        g = torch.Generator().manual_seed(7)
        q, dout = (torch.randn(B, HQ, s, D, generator=g) for _ in range(2))
        k, v = (torch.randn(B, HKV, s, D, generator=g) for _ in range(2))
        mine = [split_sequence(t, 2, 4, groups.cp.rank).to(dev, torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
        spy.calls.clear()
        o = cp_attention(m, *mine, 0.0)
        fwd = list(spy.calls)
        o.backward(split_sequence(dout, 2, 4, groups.cp.rank).to(dev, torch.bfloat16))
        out.append((comm, fwd, spy.calls[len(fwd):]))
    return out


def test_collectives_are_the_engines_calls():
    """Each type's forward and backward collectives (op, bytes, ranks) are exactly the engine's calls on every
    rank, in any order (a model's order is not what the speed model prices)."""
    per = 8
    x = _local(4, 4 * per)
    for rank_calls in run_distributed(recorded_worker, 4, per):
        for (comm, fwd, bwd), (name, sizes) in zip(rank_calls, CASES):
            assert comm == name
            want = cp_comm.cp_work(x, 2, comm, sizes[0] if sizes else 4)
            assert sorted(fwd) == sorted((op, n, k) for op, n, k, _ in want.fwd), comm
            assert sorted(bwd) == sorted((op, n, k) for op, n, k, _ in want.bwd), comm


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_allgather_blocks_are_the_engines_tasks(cp):
    """Each rank's blocks under ``allgather`` are the engine's tasks (rows x keys, causal halved), and every rank's
    FLOPs are the whole causal attention's over cp."""
    from omnitron.core.parallel.context.ulysses import allgather_tasks

    seq = 2 * cp * random.choice([4, 8, 16])
    x = _local(cp, seq)
    whole = 3 * 4.0 * B * HQ * seq * seq * D * 0.5
    for rank in range(cp):
        tasks = allgather_tasks(seq // cp, SimpleNamespace(rank=rank, size=cp))
        rows = [(len(range(seq // cp)[r]), len(range(seq)[k]), causal) for r, k, causal in tasks]
        want = [(3 * 4.0 * B * HQ * n * m * D * (0.5 if causal else 1.0), causal) for n, m, causal in rows]
        got = cp_comm.allgather_blocks(x, rank)
        assert got == want
        assert sum(f for f, _ in got) == pytest.approx(whole / cp, rel=1e-12)


def test_each_comm_type_is_priced_apart_in_one_search():
    """A search prices every layout on one rates object, whose per-layer cache must tell the comm types apart:
    each type's step on a rates object that priced the others first is its step on a fresh one; and the types'
    cp terms differ (with nothing hidden: ``--assume-overlap none``)."""
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.profile import load
    from omnitron.plan.settings import settings_of
    from omnitron.plan.speed import predict

    def settings(comm):
        extra = {"hierarchical_context_parallel_sizes": [2, 2]} if comm == "a2a+p2p" else {}
        return settings_of({"model": "llama3_8b", "seq_length": 8192, "max_position_embeddings": 8192, "bf16": True,
                            "tokenizer_type": "NullTokenizer", "vocab_size": 128255, "nproc_per_node": 16,
                            "tensor_model_parallel_size": 4, "context_parallel_size": 4, "cp_comm_type": comm,
                            "sequence_parallel": True, "global_batch_size": 4, "micro_batch_size": 1} | extra)

    shared = DeviceRates(load("h100-sxm"), 8)
    steps = {comm: predict(settings(comm), shared, "none") for comm, _ in CASES}
    for comm, _ in CASES:
        fresh = predict(settings(comm), DeviceRates(load("h100-sxm"), 8), "none")
        assert fresh.total == steps[comm].total and fresh.cp == steps[comm].cp, comm
    assert len({round(st.cp, 12) for st in steps.values()}) == len(CASES)


def saved_worker(cp: int, seq_per_rank: int) -> dict:
    """Bytes of the storages one forward of the engine's cp attention saves for backward, per comm type."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.context import split_sequence
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.cp_attention import cp_attention

    torch.set_num_threads(1)
    backend, out = get_backend(), {}
    for comm in ("p2p", "allgather", "a2a", "a2a+p2p"):
        sizes = [2, cp // 2] if comm == "a2a+p2p" else None
        config = ParallelConfig(context_parallel_size=cp, cp_comm_type=comm, hierarchical_context_parallel_sizes=sizes)
        groups = ParallelGroups.build(config, backend.collectives)
        m = SimpleNamespace(cp_group=groups.cp, cp_comm_type=comm, tracker=None, backend=backend,
                            cp_subgroups=(groups.cp_a2a, groups.cp_p2p) if sizes else None)
        g = torch.Generator().manual_seed(3)
        s = cp * seq_per_rank
        full = [torch.randn(B, h, s, D, generator=g) for h in (HQ, HKV, HKV)]
        mine = [split_sequence(t, 2, cp, groups.cp.rank).to(backend.device()).requires_grad_(True) for t in full]
        kept = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            cp_attention(m, *mine, 0.0)
        out[comm] = sum(kept.values())
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_saved_extra_is_what_the_engines_attention_saves_beyond_the_ring(cp):
    """What the engine's attention saves for backward beyond the ring's, storages counted once each, is the memory
    model's :func:`cp_comm.saved_extra` exactly: under ``allgather`` the gathered keys and values less the local
    ones and the gather's order; under ``a2a`` its two orders, and at cp 4 the two key / value heads repeated to
    four before the all-to-all (the extra heads' keys and values); under ``a2a+p2p`` (2 x cp/2) its a2a's orders."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.settings import settings_of

    per, want = 8, {}
    for comm in ("allgather", "a2a", "a2a+p2p"):
        s = settings_of({"model": "gpt2_tiny", "num_attention_heads": HQ, "num_query_groups": HKV,
                         "hidden_size": HQ * D, "seq_length": cp * per, "max_position_embeddings": cp * per,
                         "tokenizer_type": "NullTokenizer", "vocab_size": 100, "nproc_per_node": cp,
                         "context_parallel_size": cp, "cp_comm_type": comm, "micro_batch_size": B,
                         "global_batch_size": B} | (
                             {"hierarchical_context_parallel_sizes": [2, cp // 2]} if comm == "a2a+p2p" else {}))
        want[comm] = cp_comm.saved_extra(s, model_config(s))
    seq = cp * per
    assert want["allgather"] == 2 * B * HKV * (seq - per) * D * 4 + 8 * seq  # fp32: 4 bytes, int64 orders: 8
    assert want["a2a"] == 16 * seq + (2 * B * per * D * (HQ - HKV) * 4 if HKV % cp else 0)
    assert want["a2a+p2p"] == 16 * 2 * per  # the a2a over 2 ranks: HKV = 2 splits, its orders hold 2 chunks' rows
    for saved in run_distributed(saved_worker, cp, cp, per):
        for comm, extra in want.items():
            assert saved[comm] - saved["p2p"] == extra, comm


def test_device_search_tries_each_comm_type():
    """A device-profile search tries every cp > 1 layout with the ring, the all-gather and (where the heads a tp rank
    holds divide by cp) the all-to-all, each launched with its ``--cp-comm-type`` and named apart; a user's type is
    kept; a ``--bench`` search (no ``cluster``) tries the ring only."""
    from omnitron.plan.layouts import candidates
    from omnitron.plan.recommend import launch_flags

    given = {"model": "gpt2_tiny", "num_attention_heads": 4, "num_query_groups": 2, "hidden_size": 32,
             "seq_length": 64, "max_position_embeddings": 64, "tokenizer_type": "NullTokenizer", "vocab_size": 100,
             "global_batch_size": 8, "nproc_per_node": 8}
    seen = {}
    for c in candidates(given, 8, cluster=8):
        pc = c.settings.parallel
        key = (pc.tensor_model_parallel_size, pc.context_parallel_size)
        seen.setdefault(key, set()).add(pc.cp_comm_type)
        if pc.cp_comm_type != "p2p":
            assert f"--cp-comm-type {pc.cp_comm_type}" in launch_flags(c)
            assert f"cp{pc.context_parallel_size}-{pc.cp_comm_type} " in c.name()
    for (tp, cp), comms in seen.items():
        heads = 4 // tp
        want = {"p2p"} if cp == 1 else {"p2p", "allgather"} | ({"a2a"} if heads % cp == 0 else set())
        assert comms == want, (tp, cp, comms)
    assert any(cp == 4 for _, cp in seen)  # some cp > 1 was searched
    kept = {c.settings.parallel.cp_comm_type for c in candidates(given | {"cp_comm_type": "a2a"}, 8, cluster=8)
            if c.settings.parallel.context_parallel_size == 2}
    assert kept == {"a2a"}
    a2a = [c.settings.parallel for c in candidates(given | {"cp_comm_type": "a2a"}, 8, cluster=8)]
    # the engine refuses the rest
    assert all((4 // pc.tensor_model_parallel_size) % pc.context_parallel_size == 0 for pc in a2a)
    assert {c.settings.parallel.cp_comm_type for c in candidates(given, 8)} == {"p2p"}
