"""--reset-attention-mask in the model: a packed sample with document ids gives, per document, the
same logits, loss and word-embedding gradient as running that document alone (float64, GPT-2 and Llama/GQA,
with full, selective and no recomputation); the context-parallel ring refuses the mask with the fix."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.core.data import make_sample
from omnitron.core.models.gpt import gpt2_tiny, llama_tiny
from omnitron.core.models.gpt import GPTModel
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.parity import ADAM_LOOP_REL

V, S, EOD = 61, 24, 60
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S, max_position_embeddings=S,
            vocab_size=V + 1, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float64)
CASES = {"gpt2_full_recompute": gpt2_tiny(ffn_hidden_size=48, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=2, **BASE),
         "llama_gqa": llama_tiny(num_query_groups=2, ffn_hidden_size=40, **BASE),
         "llama_selective": llama_tiny(num_query_groups=2, ffn_hidden_size=40, recompute_granularity="selective",
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
    batch = _packed_batch(gen, 2)
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
    c = dataclasses.replace(CASES["gpt2_full_recompute"], params_dtype=torch.float32)
    model = GPTModel(c, ParallelGroups.single(), seed=1)
    tokens = torch.randint(0, V, (2, S))
    with pytest.raises(ValueError, match=r"document_ids must be \[batch, seq\]"):
        model(tokens=tokens, document_ids=torch.zeros(2, S - 1, dtype=torch.int64))
    attn = model.decoder.layers["0"].self_attention
    attn.cp_group = object()  # what apply_context_parallel sets under --context-parallel-size > 1
    with pytest.raises(ValueError, match="--reset-attention-mask.*--context-parallel-size 1"):
        model(tokens=tokens, document_ids=torch.zeros(2, S, dtype=torch.int64))


def _train_args(tmp: str, *extra: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "64", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2",
            "--lr", "1e-2", "--log-interval", "100", "--no-tensorboard", "--eval-interval", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-dir", tmp, *extra]


FLAGS = ("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss")
LAYOUTS = {"tp2_sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
           "pp2_interleaved": ("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1")}


def _train_layouts(tmp: str) -> dict[str, dict]:
    """Every rank: the flagged run under each layout (one spawn for both)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    return {name: train(settings_in(_train_args(tmp, *FLAGS, *lay), dist.get_world_size(), torch.float64),
                        get_backend())["losses"] for name, lay in LAYOUTS.items()}


@pytest.mark.multiprocess
def test_training_with_document_flags_matches_one_process(tmp_path):
    """tp2 + sequence parallel and pp2 interleaved (middle chunks need the document ids too) train a float64 model
    with the three flags like one process (ADAM_LOOP_REL); the flags change the losses."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.distributed import run_distributed
    from omnitron.testing.training import settings_in

    def alone(root: str, *flags: str) -> dict:
        return train(settings_in(_train_args(root, *flags), 1, torch.float64), get_backend("cpu"))["losses"]

    results = run_distributed(_train_layouts, 2, str(tmp_path / "dist"))
    one = alone(str(tmp_path / "one"), *FLAGS)
    plain = alone(str(tmp_path / "plain"))
    assert sorted(one) == [1, 2]
    for rank_losses in results:
        for name, losses in rank_losses.items():
            assert losses.keys() == one.keys(), name
            for it in one:
                assert losses[it] == pytest.approx(one[it], rel=ADAM_LOOP_REL), (name, it)
    assert any(abs(plain[it] - one[it]) > 1e-4 for it in one)
