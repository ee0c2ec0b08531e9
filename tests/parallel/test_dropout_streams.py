"""Dropout streams of a rank's virtual pipeline chunks (--num-layers-per-virtual-pipeline-stage): independent.

Each chunk of a rank carries its own tensor-parallel RNG tracker; they were all seeded from (tp rank, pp rank), so
the chunks of a rank drew the same numbers in the same order: at pp 2 with one layer a chunk, layer 0 and layer 2
dropped exactly the same attention probabilities of every micro-batch (and the same hidden elements under
sequence parallelism). Megatron draws all chunks of a rank from one stream. Here, at pp 2 x vp 2 (both chunk
placements: the interleaved loop and the V of zb-v), every chunk's ``"model-parallel"`` stream of every rank is
checked against the reference of independent streams: two keep masks of probability ``1 - p`` drawn
independently drop the same element with probability ``p**2``; the same stream twice drops it with ``p``. And the
first layer of each chunk of a rank, given the same query, key and value with attention dropout, must give
different outputs (the same masks give equal ones).
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from omnitron.testing.distributed import run_distributed

P, N = 0.5, 4096  # dropout probability, elements drawn per stream


def _worker(schedule: str):
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.models.gpt import GPTConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.components import build_model_chunks

    backend = get_backend()
    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                    vocab_size=64, attention_dropout=P, hidden_dropout=P)
    groups = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=2,
                                                 virtual_pipeline_model_parallel_size=2), backend=backend)
    chunks = build_model_chunks(cfg, groups, 1234, backend, schedule)
    drops, outs = [], []
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, (1,))))
    qkv = [torch.randn(1, 4, 8, 8, generator=g).to(backend.current_device()) for _ in range(3)]
    for chunk in chunks:
        with chunk.rng_tracker.fork():
            drops.append((torch.rand(N, device=backend.current_device()) < P).cpu())
        layer = next(iter(chunk.decoder.layers.values())).train()
        with torch.no_grad():
            outs.append(layer.self_attention.core_attention(*qkv).cpu())
    return drops, outs


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_virtual_chunks_draw_independent_dropout(schedule):
    results = run_distributed(_worker, 2, schedule)
    masks = [m for drops, _ in results for m in drops]  # 2 ranks x 2 chunks
    # co-dropped count of independent masks ~ Binomial(N, p^2): 6 standard deviations (a false failure ~1e-9 a
    # pair); a repeated stream gives a rate of p = 0.5, 36 deviations away
    bound = 6 * math.sqrt(P * P * (1 - P * P) / N)
    for a, b in itertools.combinations(range(len(masks)), 2):
        both = (masks[a] & masks[b]).double().mean().item()
        assert abs(both - P * P) <= bound, (schedule, a, b, both)
    for _, outs in results:  # the first layers of a rank's two chunks on the same inputs
        assert not torch.equal(outs[0], outs[1]), schedule
