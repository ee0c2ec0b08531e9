"""The tensor-parallel collectives the speed model prices (:func:`omnitron.plan.work.stage_tp_collectives`)
against the calls a real tp2 forward + backward makes: every all-reduce, all-gather and reduce-scatter of the
backend's collectives is recorded with its bytes (the bench's convention: the buffer, the gathered output, the
input), with and without sequence parallelism. Exact: the same multiset of (op, bytes)."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def recording(log: list, ops=OPS, group_size: bool = False):
    """Append ``(op, bytes)`` (and the group's size with ``group_size``) of every call of ``ops`` on the
    backend's collectives to ``log`` while inside; bytes as the bench counts them (the buffer, the gathered
    output, the reduce-scatter and all-to-all input)."""
    import torch.distributed as dist

    from omnitron.backends.collectives import Collectives

    orig = {n: getattr(Collectives, n) for n in ops}

    def wrap(name):
        def call(self, *a, **k):
            t = a[1] if name in ("reduce_scatter", "all_to_all") else a[0]  # (output, input)
            entry = (name, t.numel() * t.element_size())
            log.append(entry + (dist.get_world_size(k.get("group")),) if group_size else entry)
            return orig[name](self, *a, **k)
        return call

    for n in ops:
        setattr(Collectives, n, wrap(n))
    try:
        yield log
    finally:
        for n in ops:
            setattr(Collectives, n, orig[n])


def forward_backward(s, m, vocab: int) -> None:
    """One forward + backward of model chunk ``m`` on a random micro-batch of ``s``'s shape, token ids below
    ``vocab``."""
    b, sl = s.training.micro_batch_size, s.model.seq_length
    dev = next(m.parameters()).device  # the backend's device the components were built on
    tokens = torch.randint(0, vocab, (b, sl)).to(dev)
    m(tokens=tokens, position_ids=torch.arange(sl, device=dev).expand(b, sl), labels=tokens).float().sum().backward()


def _recorded(root: str, world: int) -> dict:
    """{sp: [(op, bytes)] of one forward + backward of the tp2 model}, on this rank."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    out = {}
    for sp in (False, True):
        s = parse_settings(_args(root, sp), world)
        m = build_components(s, get_backend()).modules[0].train()
        with recording([]) as log:
            forward_backward(s, m, 200)
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
