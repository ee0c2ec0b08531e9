"""``omnitron train --moe-expert-load-out FILE`` (:mod:`omnitron.core.transformer.moe.expert_load`): the routing
histogram a run writes, against an independent count, and ``omnitron plan --moe-expert-load`` reading it.

Reference: every training forward's router input and gate weight, captured on each rank, routed again in the
test process with plain torch (``topk`` of ``x.float() @ w.float().T + b``, the default softmax router's picks are
its largest logits; ``b``: the router bias --add-bias-linear gives it, as Megatron's) and counted per decoder MoE
layer, in the model's order (the layer index from the module's name on whichever stage holds it). The run drops
assignments at a capacity factor of 0.5, so its counter must count the picks before the capacity (each row then sums to
tokens x top-k x steps x dp, which the capacity would cut).
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.nn.functional as F

from omnitron.testing.distributed import run_distributed


def _argv(root: str, extra: list[str]) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--no-tensorboard", "--micro-batch-size", "2", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-expert-capacity-factor", "0.5", "--lr", "1e-3",
            "--data-cache-path", os.path.join(root, "cache"), "--moe-expert-load-out",
            os.path.join(root, "load.json"), *extra]


def _train(argv: list[str], world: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Train; (global layer, router input, gate weight, gate bias or None) of every training forward's router on
    this rank."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train
    from omnitron.core.transformer.moe.router import TopKRouter

    seen, forward = [], TopKRouter.forward

    def recorded(self, x, batch_size=1):  # a forward run inside backward is a recomputation: not a new forward
        if self.training and torch.is_grad_enabled() and torch._C._current_autograd_node() is None:
            bias = None if self.bias is None else self.bias.detach().clone()
            seen.append((self, x.detach().clone(), self.weight.detach().clone(), bias))
        return forward(self, x, batch_size)

    TopKRouter.forward = recorded
    try:
        c = train(parse_settings(argv, world), get_backend())["components"]
    finally:
        TopKRouter.forward = forward
    names = {id(m): name for chunk in c.modules for name, m in chunk.named_modules()}
    # "decoder.layers.<global index>.mlp.router" (a multi-token prediction depth's router is not a decoder layer's)
    return [(int(names[id(r)].split(".")[-3]), x, w, b) for r, x, w, b in seen if names[id(r)].startswith("decoder.")]


def _reference(captured: list, pattern: list[bool], k: int, E: int) -> list[list[int]]:
    rows = [i for i, moe in enumerate(pattern) if moe]
    table = [[0] * E for _ in rows]
    for layer, x, w, b in captured:
        picks = torch.topk(F.linear(x.float(), w.float(), None if b is None else b.float()), k, dim=-1).indices
        picks = picks.reshape(-1)
        for e, n in enumerate(torch.bincount(picks, minlength=E).tolist()):
            table[rows.index(layer)][e] += n
    return table


def test_one_process_counts_each_training_forward_once(tmp_path):
    """One process, 2 steps of 2 micro-batches, full recomputation (every MoE forward runs again in backward),
    validation and a checkpoint after every step (the file is rewritten at each; the ep2 runs below write it
    at the end, without checkpoints) and a multi-token prediction depth with an MoE layer (not a decoder layer:
    left out): the rows are the decoder routers' reference counts, each training forward counted once, before
    the capacity; the plan's reader takes it."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern
    from omnitron.plan.routing import read_expert_load

    extra = ["--moe-layer-freq", "[0,1,1,1]", "--train-iters", "2", "--global-batch-size", "4",
             "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--eval-interval", "1", "--eval-iters", "1", "--save", str(tmp_path / "ck"), "--save-interval", "1",
             "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--seed", str(random.randint(1, 10**6))]
    argv = _argv(str(tmp_path), extra)
    captured = _train(argv, 1)
    want = _reference(captured, moe_layer_pattern([0, 1, 1, 1], 4), 2, 4)
    table = json.loads((tmp_path / "load.json").read_text())["tokens_per_expert"]
    assert len(captured) == 2 * 2 * 3 and table == want, (len(captured), table, want)
    assert all(sum(row) == 2 * 4 * 32 * 2 for row in table)
    assert read_expert_load(str(tmp_path / "load.json")).shares[0] == tuple(v / sum(table[0]) for v in table[0])


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2", "--moe-layer-freq", "[0,1,1,1]", "--train-iters", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--moe-layer-freq", "[0,1,1,1]",
         "--train-iters", "2", "--global-batch-size", "8"]),
], ids=["ep2", "ep2-pp2"])
def test_written_histogram_is_the_routers_picks(tmp_path, world, extra, capsys):
    """ep2 (dp2), and ep2 with pp2 (layer 1 on stage 0, layers 2-3 on stage 1; 2 micro-batches a step): the file's
    rows equal the reference count exactly (integers), layer by layer in the model's order; ``omnitron plan
    --moe-expert-load`` reads it and prices each stage's busiest ep rank (its table and ``--json``)."""
    from omnitron.cli import main
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    argv = _argv(str(tmp_path), extra + ["--seed", str(random.randint(1, 10**6))])
    got = run_distributed(_train, world, argv, world)
    want = _reference([c for rank in got for c in rank], moe_layer_pattern([0, 1, 1, 1], 4), 2, 4)
    table = json.loads((tmp_path / "load.json").read_text())["tokens_per_expert"]
    steps, gbs = 2, (8 if world == 4 else 4)
    assert table == want and all(sum(row) == steps * gbs * 32 * 2 for row in table), (table, want)
    assert len(table) == 3 and not list(tmp_path.glob("load.json.tmp*"))
    out = tmp_path / "plan.json"
    assert main(["plan", *argv, "--nproc-per-node", str(world), "--moe-expert-load", str(tmp_path / "load.json"),
                 "--device", "h100-sxm", "--json", str(out)]) == 0
    assert "each stage priced on its busiest ep rank" in capsys.readouterr().out
    stages = json.loads(out.read_text())["layouts"][0]["memory_per_stage"]
    assert all(m["busiest_ep_rank"] in (0, 1) and m["balanced_gib"] > 0 for m in stages), stages


def test_no_experts_is_one_line(tmp_path):
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.transformer.moe.expert_load import start

    with pytest.raises(ConfigError, match="--moe-expert-load-out .*--num-experts"):
        start([], gpt2_tiny())


@pytest.mark.slow
def test_compiled_layers_count_as_eager(tmp_path):
    """``--torch-compile`` (each decoder layer compiled, its router's counter inside the graph): one process, 2
    steps of 2 micro-batches from the same seed without dropout (a compiled layer draws its dropout masks from
    another generator: with dropout the runs route different hidden states), the file equals the eager run's exactly
    (the eager counts are checked against plain torch above). A near-tie of two router logits within the compiled
    layer's float32 reordering (~1e-6 relative) could flip a pick: improbable at these 768 routings a step."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    seed = str(random.randint(1, 10**6))
    tables = []
    for name, extra in (("eager", []), ("compiled", ["--torch-compile"])):
        root = tmp_path / name
        root.mkdir()
        argv = _argv(str(root), ["--moe-layer-freq", "[0,1,1,1]", "--train-iters", "2", "--global-batch-size", "4",
                                 "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", seed, *extra])
        train(parse_settings(argv, 1), get_backend())
        tables.append(json.loads((root / "load.json").read_text())["tokens_per_expert"])
    assert tables[0] == tables[1] and all(sum(row) == 2 * 4 * 32 * 2 for row in tables[0]), tables
