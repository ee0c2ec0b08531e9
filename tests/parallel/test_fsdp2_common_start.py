"""``--use-torch-fsdp2`` starts every replica from dp x cp rank 0's parameters (a broadcast before sharding, as the
DDP wrapper does): replicas whose weights differ before :func:`apply_fsdp2` (another seed, a stale load) hold
rank 0's values after it. Reference: rank 0's unsharded parameters, gathered back from the shards on every rank
(``full_tensor``) and compared bit for bit (the broadcast and the all-gather move bytes, no arithmetic)."""
from __future__ import annotations

import torch

from omnitron.testing.distributed import run_distributed


def _worker() -> dict:
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.parallel.data.fsdp import apply_fsdp2
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), be.collectives)
    rank = dist.get_rank()
    cfg = gpt2_tiny(vocab_size=61, num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                    seq_length=8)
    model = GPTModel(cfg, groups, seed=11 + rank, backend=be).to(be.current_device())  # replicas differ
    before = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    apply_fsdp2(model, groups, compute_dtype=torch.float32, device_type=be.current_device().type,
                collectives=be.collectives)
    after = {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}
    return {"rank": rank, "before": before, "after": after}


def test_every_replica_starts_from_rank_0s_parameters():
    r0, r1 = run_distributed(_worker, 2, timeout_s=300)
    assert r0["before"].keys() == r1["before"].keys() == r0["after"].keys()
    assert any(not torch.equal(r0["before"][n], r1["before"][n]) for n in r0["before"])  # the replicas did differ
    for n, want in r0["before"].items():
        assert torch.equal(r0["after"][n], want) and torch.equal(r1["after"][n], want), n
