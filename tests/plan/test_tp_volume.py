"""The tensor-parallel collectives the speed model prices (:func:`omnitron.plan.work.stage_tp_collectives`)
against the calls a real tp2 forward + backward makes: every all-reduce, all-gather and reduce-scatter of the
backend's collectives is recorded with its bytes (the bench's convention: the buffer, the gathered output, the
input), with and without sequence parallelism. Exact: the same multiset of (op, bytes)."""
from __future__ import annotations

import os
from collections import Counter

import torch

from omnitron.testing.distributed import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _args(root: str, sp: bool) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--train-iters", "1", "--no-tensorboard", "--tensor-model-parallel-size", "2",
            "--micro-batch-size", "2", "--data-cache-path", os.path.join(root, "cache")] + (
                ["--sequence-parallel"] if sp else [])


def _recorded(root: str, world: int) -> dict:
    """{sp: [(op, bytes)] of one forward + backward of the tp2 model}, on this rank."""
    from omnitron.backends import get_backend
    from omnitron.backends.collectives import Collectives
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    out = {}
    for sp in (False, True):
        s = parse_settings(_args(root, sp), world)
        m = build_components(s, get_backend()).modules[0].train()
        log, orig = [], {n: getattr(Collectives, n) for n in OPS}

        def wrap(name):
            def call(self, *a, **k):
                t = a[1] if name == "reduce_scatter" else a[0]  # reduce_scatter(output, input)
                log.append((name, t.numel() * t.element_size()))
                return orig[name](self, *a, **k)
            return call

        for n in OPS:
            setattr(Collectives, n, wrap(n))
        try:
            b, sl = s.training.micro_batch_size, s.model.seq_length
            tokens = torch.randint(0, 200, (b, sl))
            m(tokens=tokens, position_ids=torch.arange(sl).expand(b, sl), labels=tokens).float().sum().backward()
        finally:
            for n in OPS:
                setattr(Collectives, n, orig[n])
        out[sp] = log
    return out


def test_tp_collectives_match_a_real_tp2_step(tmp_path):
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import work
    from omnitron.plan.memory import model_config

    got = run_distributed(_recorded, 2, str(tmp_path), 2)
    for sp in (False, True):
        s = parse_settings(_args(str(tmp_path), sp), 2)
        cfg = model_config(s)
        x = work.local_shapes(cfg, 2, 1, 2)
        fwd, bwd = work.stage_tp_collectives(cfg, x, 4, sp, 2, first=True, last=True)
        assert Counter(got[0][sp]) == Counter(fwd + bwd) == Counter(got[1][sp]), (sp, got[0][sp])
