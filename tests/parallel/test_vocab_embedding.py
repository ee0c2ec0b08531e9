"""The vocab-parallel embedding lookup on 2 ranks of the backend under test against ``F.embedding`` of the whole float64 table.

Every id is looked up, the first id of each rank's row range included (the boundary a wrong ``>=`` would hand
to the rank before it), plus fresh random ids: each rank returns the summed lookup, which must equal the
whole-table lookup exactly (one nonzero term per element, the rest exact zeros: no rounding).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.testing.distributed import run_distributed

ROWS, HIDDEN, TP = 4, 3, 2  # rows per rank; the padded vocabulary is ROWS * TP


def _lookup() -> float:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.layers import embedding_lookup

    be = get_backend()  # the backend under test: its device
    groups, dev = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=TP), backend=be), be.device()
    gen = torch.Generator().manual_seed(1234)
    table = torch.randn(ROWS * TP, HIDDEN, generator=gen, dtype=torch.float64)
    ids = torch.cat([torch.arange(ROWS * TP), torch.randint(0, ROWS * TP, (13,), generator=gen)]).view(3, 7)
    r = groups.tp.rank
    got = embedding_lookup(ids.to(dev), table[r * ROWS:(r + 1) * ROWS].to(dev), groups.tp).cpu()
    return float((got - F.embedding(ids, table)).abs().max())


def test_vocab_parallel_embedding_equals_the_whole_table():
    assert run_distributed(_lookup, TP) == [0.0] * TP
