"""The tp-local logits a model returns without labels: every column at or past the real vocabulary is -inf on
every tensor-parallel rank and the real columns are untouched (so sampling never picks a padding id).

Reference, hand-derived: the padded vocabulary ``tp * v_local`` is cut into rank-order column blocks, rank ``r``
holding global ids ``[r * v_local, (r + 1) * v_local)``; the ranks are played in one process (the method reads
only its tp group's rank and size), on vocabularies whose padding starts in the first, a middle and the last
rank's block.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnitron.core.models.gpt.model import GPTModel


@pytest.mark.parametrize("tp,v_local,vocab", [(2, 8, 5), (2, 8, 13), (4, 4, 10), (4, 4, 16)])
def test_padding_columns_are_minus_inf_on_every_rank(tp, v_local, vocab):
    full = torch.randn(3, 2, tp * v_local, dtype=torch.float64)
    got = []
    for r in range(tp):
        model = SimpleNamespace(groups=SimpleNamespace(tp=SimpleNamespace(rank=r, size=tp)),
                                config=SimpleNamespace(vocab_size=vocab))
        got.append(GPTModel._mask_padding(model, full[..., r * v_local:(r + 1) * v_local].clone()))
    got = torch.cat(got, -1)
    assert torch.equal(got[..., :vocab], full[..., :vocab])
    assert bool((got[..., vocab:] == float("-inf")).all())
