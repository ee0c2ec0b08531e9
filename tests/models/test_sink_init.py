"""Learnable attention sinks (``--softmax-type learnable``) start as Megatron's: ``softmax_offset`` is drawn by
``config.init_method``, a normal of std ``--init-method-std`` (megatron/core/transformer/dot_product_attention.py,
d98e8a6), and, as every omnitron weight, from the layout-independent full tensor (the same values at any tp)."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from omnitron.core.models.gpt import GPTModel
from omnitron.core.models.gpt.presets import llama_tiny
from omnitron.core.parallel.groups import Group, ParallelGroups


def _config(std: float):
    # 32 heads of width 2 over 8 layers: 256 sink values, few other weights
    return dataclasses.replace(llama_tiny(), softmax_type="learnable", num_layers=8, hidden_size=64,
                               num_attention_heads=32, num_query_groups=8, ffn_hidden_size=64, seq_length=16,
                               max_position_embeddings=16, vocab_size=64, init_method_std=std,
                               params_dtype=torch.float32)


def _sinks(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for n, p in model.named_parameters() if n.endswith("softmax_offset")])


def _tp2_rank(cfg, rank: int, seed: int) -> GPTModel:
    """Rank ``rank`` of a tp-2 layout, built without processes: construction and init do not communicate, and a
    group's local rank is this process's index in its ranks (world rank 0)."""
    groups = ParallelGroups.single()
    groups.groups["tp"] = Group("tp", (0, 1) if rank == 0 else (1, 0), None)
    model = GPTModel(cfg, groups)
    model.reset_parameters(seed)
    return model


@pytest.mark.parametrize("std", [0.006, 0.02, 0.05])
def test_learnable_sinks_start_normal_with_init_method_std(std):
    seed = random.randrange(2 ** 31)
    cfg = _config(std)
    model = GPTModel(cfg, ParallelGroups.single())
    model.reset_parameters(seed)
    x = _sinks(model).double()
    n = x.numel()
    assert n == cfg.num_layers * cfg.num_attention_heads
    # n independent N(0, std^2) draws: the mean is N(0, std^2 / n) and the sample std's relative error has
    # standard deviation ~ 1 / sqrt(2 (n - 1)). Five of those deviations bound each (a false failure ~ 1e-6);
    # zeros (std 0) or another std (x 2.5 apart at the least) fall far outside.
    assert abs(float(x.mean())) < 5 * std / math.sqrt(n), (float(x.mean()), std, seed)
    assert abs(float(x.std()) / std - 1) < 5 / math.sqrt(2 * (n - 1)), (float(x.std()), std, seed)


def test_learnable_sinks_are_the_same_at_tp1_and_tp2():
    seed = random.randrange(2 ** 31)
    cfg = _config(0.02)
    one = GPTModel(cfg, ParallelGroups.single())
    one.reset_parameters(seed)
    halves = [_sinks(_tp2_rank(cfg, r, seed)).view(cfg.num_layers, -1) for r in (0, 1)]
    whole = _sinks(one).view(cfg.num_layers, -1)
    assert halves[0].shape[1] == cfg.num_attention_heads // 2
    assert torch.equal(torch.cat(halves, dim=1), whole)  # each rank holds its heads' sinks, drawn as at tp1
    assert float(whole.abs().min()) > 0  # drawn, not the zeros every layout would agree on
