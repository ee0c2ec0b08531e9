"""--reset-attention-mask in the model: a packed sample with document ids gives, per document, the
same logits, loss and input gradient as running that document alone (float64, GPT-2 and Llama/GQA,
with and without selective recompute); the context-parallel ring refuses the mask with the fix."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.core.data import make_sample
from omnitron.core.models.gpt import gpt2_tiny, llama_tiny
from omnitron.core.models.gpt import GPTModel
from omnitron.core.parallel.groups import ParallelGroups

V, S, EOD = 61, 24, 60
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S, max_position_embeddings=S,
            vocab_size=V + 1, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
CASES = {"gpt2": gpt2_tiny(ffn_hidden_size=48, **BASE),
         "llama_gqa": llama_tiny(num_query_groups=2, ffn_hidden_size=40, **BASE),
         "llama_recompute": llama_tiny(num_query_groups=2, ffn_hidden_size=40, recompute_granularity="selective",
                                       **BASE)}


def _packed_batch(gen: torch.Generator, b: int) -> dict[str, torch.Tensor]:
    """``b`` samples of random tokens with 1-3 eods at random places (one sample ends in an eod)."""
    rows = []
    for i in range(b):
        text = torch.randint(0, V, (S + 1,), generator=gen)
        n = int(torch.randint(1, 4, (1,), generator=gen))
        text[torch.randperm(S, generator=gen)[:n]] = EOD
        if i == 0:
            text[S - 1] = EOD
        rows.append(make_sample(text.numpy(), EOD, True, True, True))
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _documents(tokens_row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in one row, eod included in the document it ends (longhand)."""
    spans, start = [], 0
    for j, t in enumerate(tokens_row.tolist()):
        if t == EOD:
            spans.append((start, j + 1))
            start = j + 1
    if start < len(tokens_row):
        spans.append((start, len(tokens_row)))
    return spans


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_documents_match_separate_runs(name):
    c = CASES[name]
    model = GPTModel(c, ParallelGroups.single(), seed=11)
    model.train()  # selective recompute only runs in training mode with grad enabled
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    batch = _packed_batch(gen, 3)
    emb = model.embedding.word_embeddings
    emb.weight.grad = None
    loss = model(tokens=batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"],
                 document_ids=batch["document_ids"])  # [b, s]
    (loss * batch["loss_mask"]).sum().backward()
    packed_grad = emb.weight.grad.clone()
    with torch.no_grad():
        logits = model(tokens=batch["tokens"], position_ids=batch["position_ids"],
                       document_ids=batch["document_ids"]).transpose(0, 1)  # [b, s, V_pad]
    emb.weight.grad = None
    total_docs = 0
    for i in range(batch["tokens"].shape[0]):
        for lo, hi in _documents(batch["tokens"][i]):
            total_docs += 1
            doc, lab = batch["tokens"][i:i + 1, lo:hi], batch["labels"][i:i + 1, lo:hi]
            alone = model(tokens=doc, labels=lab)  # plain causal path, positions 0..n-1
            mask = (doc != EOD).double()  # --eod-mask-loss
            (alone * mask).sum().backward()
            assert torch.allclose(loss[i:i + 1, lo:hi], alone, rtol=1e-10, atol=1e-12), (i, lo, hi)
            with torch.no_grad():
                ref = model(tokens=doc).transpose(0, 1)
            assert torch.allclose(logits[i:i + 1, lo:hi, :V], ref[..., :V], rtol=1e-10, atol=1e-12)
    assert total_docs > batch["tokens"].shape[0]  # packing really happened
    assert torch.allclose(packed_grad, emb.weight.grad, rtol=1e-9, atol=1e-12)
    # without the mask the packed run differs (the test would notice a mask that did nothing)
    with torch.no_grad():
        leaky = model(tokens=batch["tokens"], position_ids=batch["position_ids"]).transpose(0, 1)
    assert not torch.allclose(leaky, logits, rtol=1e-6, atol=1e-8)


def test_bad_document_ids_and_context_parallel_are_refused():
    c = dataclasses.replace(CASES["gpt2"], params_dtype=torch.float32)
    model = GPTModel(c, ParallelGroups.single(), seed=1)
    tokens = torch.randint(0, V, (2, S))
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq\]"):
        model(tokens=tokens, document_ids=torch.zeros(2, S - 1, dtype=torch.int64))
    attn = model.decoder.layers["0"].self_attention
    attn.cp_group = object()  # what apply_context_parallel sets under --context-parallel-size > 1
    with pytest.raises(ValueError, match="--reset-attention-mask.*--context-parallel-size 1"):
        model(tokens=tokens, document_ids=torch.zeros(2, S, dtype=torch.int64))
