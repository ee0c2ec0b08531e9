"""BertModel against an independent plain-torch float64 BERT (bidirectional attention with a
padding mask, MLM head tied to the word embedding, pooler + binary head, Megatron's loss), and
tensor-parallel (+ sequence-parallel) parity with the one-process model in one spawned run."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.bert import BertConfig, BertModel, bert_loss, num_parameters, validate_bert
from omnitron.core.models.gpt import gather_full_state
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import (assert_parity, on_groups_device, reference_kernels, relative_error as _rel,
                                     tp_sp_parity)
from omnitron.testing.training import settings_in

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=12, vocab_size=203,
            hidden_dropout=0.0, attention_dropout=0.0)
F64 = dict(params_dtype=torch.float64)  # the one-process checks run a float64 model against plain_bert
# F64_REL: a float64 BertModel (reference kernels) against plain_bert on the same float64 weights is the same maths
# in another order (fused QKV views, the layer norm, the softmax, the vocab-parallel cross-entropy's max-shifted
# logsumexp). u = 2**-53 = 1.1e-16, and reordering a sum of n terms moves it by <= n u of its terms' magnitudes.
# The forward chains 2 layers of ~10 such sums of <= 48 terms (hidden 32, ffn 48, 12 keys) and the head's 32-term
# logits and 203-term logsumexp: <= (20 x 48 + 235) u = 1.3e-13 relative at gain ~1 (the layer norms and softmaxes
# are well conditioned at these scales); the backward runs the chain again: <= ~3e-13 on a gradient, norm-wise.
# F64_REL = 1e-12 leaves a factor 3 over that worst case (sqrt(n) u ~ 1e-15 is typical; 7e-16 measured). The
# float32 model needed 1e-5 / 1e-6, above what a float32 rounding of the loss (9e-8: the model's own, fixed with
# these tests) or of the softmax scale (2.3e-11 on the logits, planted) moves.
F64_REL = 1e-12


def plain_bert(W, c, tokens, types, pad, labels, mask, is_random):
    """Batch-first float64 BERT from the maths: (total loss, MLM logits [b, s, V], binary logits [b, 2])."""
    b, s = tokens.shape
    hq, h = c.num_attention_heads, c.hidden_size
    g = c.num_query_groups or hq
    d = h // hq
    lin = lambda t, n: t @ W[n + ".weight"].T + W[n + ".bias"]  # noqa: E731
    ln = lambda t, n: F.layer_norm(t, (h,), W[n + ".weight"], W[n + ".bias"], c.layernorm_epsilon)  # noqa: E731
    x = W["embedding.word_embeddings.weight"][tokens] + W["embedding.position_embeddings.weight"][:s]
    if "embedding.tokentype_embeddings.weight" in W:  # Megatron's BERT without the binary head has none
        x = x + W["embedding.tokentype_embeddings.weight"][types]
    for i in range(c.num_layers):
        p = f"decoder.layers.{i}."
        qkv = lin(ln(x, p + "input_layernorm"), p + "self_attention.linear_qkv").view(b, s, g, hq // g + 2, d)
        q, k, v = qkv[..., : hq // g, :].reshape(b, s, hq, d), qkv[..., -2, :], qkv[..., -1, :]
        k, v = k.repeat_interleave(hq // g, dim=2), v.repeat_interleave(hq // g, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))  # keys only; no causal mask
        att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, h)
        x = x + lin(att, p + "self_attention.linear_proj")
        m = F.gelu(lin(ln(x, p + "pre_mlp_layernorm"), p + "mlp.linear_fc1"), approximate="tanh")
        x = x + lin(m, p + "mlp.linear_fc2")
    x = ln(x, "decoder.final_layernorm")
    y = ln(F.gelu(lin(x, "lm_head.dense")), "lm_head.layer_norm")
    logits = y @ W["embedding.word_embeddings.weight"].T + W["output_layer.bias"]
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    lm = (token_loss * mask.reshape(-1)).sum() / mask.sum()
    if "binary_head.weight" not in W:
        return lm, logits, None
    binary = lin(torch.tanh(lin(x[:, 0], "pooler.dense")), "binary_head")
    return lm + F.cross_entropy(binary, is_random), logits, binary


def _batch(c, gen, b=3):
    s = c.seq_length
    tokens = torch.randint(0, c.vocab_size, (b, s), generator=gen)
    lengths = torch.randint(s // 2, s + 1, (b,), generator=gen)
    lengths[0] = s  # one unpadded row
    pad = torch.arange(s)[None] >= lengths[:, None]
    types = (torch.rand(b, s, generator=gen) < 0.5).long()
    mask = ((torch.rand(b, s, generator=gen) < 0.3) & ~pad).float()
    mask[:, 1] = 1.0  # every row has a masked position
    return {"tokens": tokens, "padding_mask": pad, "tokentype_ids": types, "loss_mask": mask,
            "labels": torch.randint(0, c.vocab_size, (b, s), generator=gen),
            "is_random": torch.randint(0, 2, (b,), generator=gen)}


def _forward(model, batch, labels=True):
    return model(batch["tokens"], batch["padding_mask"], batch["tokentype_ids"],
                 labels=batch["labels"] if labels else None)


@pytest.mark.parametrize("gqa", [False, True])
def test_bert_matches_plain_float64(gqa):
    """A float64 BertModel's loss (in float64: Megatron's ``.float()`` widens, never narrows), logits, binary
    logits and every gradient against plain_bert within F64_REL."""
    c = BertConfig(**BASE, **F64, num_query_groups=2 if gqa else None)
    groups = ParallelGroups.single()
    with reference_kernels():
        model = BertModel(c, groups, seed=11)
        batch = _batch(c, torch.Generator().manual_seed(5 + gqa))
        loss, _ = bert_loss(_forward(model, batch), batch)
        loss.backward()
        with torch.no_grad():
            logits, binary = _forward(model, batch, labels=False)
    assert loss.dtype == binary.dtype == torch.float64
    W = {k: v.detach().clone().requires_grad_() for k, v in gather_full_state(model, groups).items()}
    assert W["output_layer.bias"].shape == (c.vocab_size,)  # padding columns dropped from the full view
    ref, ref_logits, ref_binary = plain_bert(W, c, batch["tokens"], batch["tokentype_ids"], batch["padding_mask"],
                                             batch["labels"], batch["loss_mask"].double(), batch["is_random"])
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < F64_REL
    assert torch.isinf(logits[..., c.vocab_size:]).all()
    assert _rel(logits[..., :c.vocab_size].transpose(0, 1), ref_logits) < F64_REL
    assert _rel(binary, ref_binary) < F64_REL
    grads = gather_full_state(model, groups, grads=True)
    assert grads.keys() == W.keys()
    for k, w in W.items():
        assert _rel(grads[k], w.grad) < F64_REL, k


def test_padding_keys_are_invisible_and_attention_is_bidirectional():
    c = BertConfig(**BASE)
    model = BertModel(c, ParallelGroups.single(), seed=2).eval()
    batch = _batch(c, torch.Generator().manual_seed(9))
    batch["padding_mask"][1, 7:] = True
    other = dict(batch, tokens=batch["tokens"].clone())
    other["tokens"][1, 7:] = (other["tokens"][1, 7:] + 1) % c.vocab_size  # change only padded tokens
    with torch.no_grad():
        a, b = _forward(model, batch, labels=False)[0], _forward(model, other, labels=False)[0]
        # a later real token changes an earlier position's output: attention looks both ways
        later = dict(batch, tokens=batch["tokens"].clone())
        later["tokens"][1, 5] = (later["tokens"][1, 5] + 1) % c.vocab_size
        e = _forward(model, later, labels=False)[0]
    V = c.vocab_size
    assert torch.allclose(a[:7, 1, :V], b[:7, 1, :V], atol=1e-6, rtol=0)
    assert not torch.allclose(a[0, 1, :V], e[0, 1, :V], atol=1e-4, rtol=0)


def test_no_binary_head_and_parameter_count():
    c = BertConfig(**BASE, bert_binary_head=False)
    model = BertModel(c, ParallelGroups.single(), seed=1)
    batch = _batch(c, torch.Generator().manual_seed(3))
    lm, binary = _forward(model, batch)
    assert binary is None and lm.shape == batch["tokens"].shape
    for cfg in (c, BertConfig(**BASE)):
        m = BertModel(cfg, ParallelGroups.single(), seed=1)
        assert num_parameters(cfg) == sum(p.numel() for p in m.parameters())


def test_no_binary_head_builds_megatrons_model():
    """``--bert-no-binary-head`` (Megatron's spelling, accepted as such) builds what Megatron's pretrain_bert
    builds: no token-type embedding (``num_tokentypes = 2 if bert_binary_head else 0``) and no pooler, so the
    loss is the masked-LM mean alone, independent of the token types; float64 reference as above."""
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(["--model", "bert_tiny", "--model-type", "bert", "--bert-no-binary-head", "--mock-data"],
                       world_size=1)
    assert not s.model.bert_binary_head
    c = BertConfig(**BASE, **F64, bert_binary_head=False)
    groups = ParallelGroups.single()
    model = BertModel(c, groups, seed=4)
    W = gather_full_state(model, groups)
    assert not [k for k in W if k.startswith(("embedding.tokentype", "pooler", "binary_head"))]
    batch = _batch(c, torch.Generator().manual_seed(8))
    with reference_kernels():
        loss, _ = bert_loss(_forward(model, batch), batch)
    ref, _, _ = plain_bert(W, c, batch["tokens"], batch["tokentype_ids"], batch["padding_mask"], batch["labels"],
                           batch["loss_mask"].double(), batch["is_random"])
    assert abs(loss.item() - ref.item()) / ref.item() < F64_REL  # float64 on both sides: F64_REL's analysis
    explicit = BertConfig(**BASE, bert_binary_head=False, num_tokentypes=2)  # --num-tokentypes still adds them
    assert "embedding.tokentype_embeddings.weight" in BertModel(explicit, groups, seed=4).state_dict()


def test_unsupported_layouts_are_rejected_with_the_flag():
    c = BertConfig(**BASE)
    validate_bert(c, ParallelConfig(pipeline_model_parallel_size=2))  # pipeline stages run
    for parallel, flag in ((ParallelConfig(pipeline_model_parallel_size=4), "--num-layers 2"),
                           (ParallelConfig(context_parallel_size=2), "--context-parallel-size")):
        with pytest.raises(ConfigError, match=flag):
            validate_bert(c, parallel)
    with pytest.raises(ConfigError, match="--num-tokentypes"):
        validate_bert(dataclasses.replace(c, num_tokentypes=0), ParallelConfig())
    with pytest.raises(ConfigError, match="--num-tokentypes"):
        BertConfig(**BASE, num_tokentypes=-1)


# ---- tensor / sequence parallel parity (one spawn) ----------------------------------------------
def _parity_step(c, g):
    from omnitron.core.models.gpt import allreduce_sequence_parallel_grads

    batch = _batch(c, torch.Generator().manual_seed(4))
    model = BertModel(c, g, seed=8)
    model, batch = on_groups_device(g, model, batch)  # the backend under test (the host for one process)
    lm, binary = _forward(model, batch)
    loss, _ = bert_loss((lm, binary), batch)
    loss.backward()
    allreduce_sequence_parallel_grads(model, g)
    return {"loss": loss, "token_loss": lm, "binary": binary, "grads": gather_full_state(model, g, grads=True)}


def _parity_worker(tp: int) -> dict:
    cfgs = {"mha": BertConfig(**{**BASE, "vocab_size": 251, "make_vocab_size_divisible_by": 1}),
            "gqa_recompute": BertConfig(**{**BASE, "num_query_groups": 2, "recompute_granularity": "selective"})}
    return tp_sp_parity(tp, cfgs, _parity_step)


def test_tensor_and_sequence_parallel_parity_tp2():
    assert_parity(run_distributed(_parity_worker, 2, 2))


# ---- the train command ----------------------------------------------------------------------------
def _train_args(tmp_path, *extra):
    return ["--model", "bert_tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--log-interval", "5",
            "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "logs"),
            *extra]


def test_train_settings_for_bert(tmp_path):
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(_train_args(tmp_path, "--no-bert-binary-head", "--num-tokentypes", "0"), world_size=2)
    assert s.model_type == "bert" and isinstance(s.model, BertConfig) and not s.model.bert_binary_head
    assert s.model.num_tokentypes == 0 and s.data.tokenizer_type == "BertWordPieceLowerCase"
    bad = [(["--context-parallel-size", "2"], "--context-parallel-size 2: BERT"),
           (["--tokenizer-type", "GPT2BPETokenizer"], "BertWordPieceLowerCase"),
           (["--prompt", "hi"], "--prompt")]
    for extra, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_settings(_train_args(tmp_path, *extra), world_size=2)
    with pytest.raises(ConfigError, match="add --model-type bert"):
        parse_settings(["--model", "gpt2_tiny", "--num-tokentypes", "2"], world_size=1)


def test_train_step_logs_megatrons_sop_loss():
    """A training step logs ``sop_loss`` (Megatron's ``sop loss``: the mean over micro-batches of the
    sentence-order cross-entropy) beside ``lm_loss`` (the objective, masked-LM mean + sentence order), an
    evaluation ``val_sop_loss`` beside ``val_loss``, all against the float64 plain BERT on the weights and
    micro-batches each used."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import evaluate, train_step

    args = ["--model", "bert_tiny", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--ffn-hidden-size", "64", "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
            "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "6", "--train-iters", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--no-tensorboard"]
    s = parse_settings(args, 1)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=torch.float64))
    c = build_components(s, get_backend("cpu"))
    W = {k: v.detach().clone() for k, v in gather_full_state(c.modules[0], c.groups).items()}  # before the step
    read = []

    def batches():
        for b in data_iterator(c, c.train_data, 0):  # the first global batch (again for the evaluation)
            read.append(b)
            yield b

    out = train_step(c, batches())
    assert len(read) == c.schedule.num_microbatches == 3
    lm = sop = 0.0
    for b in read:
        total, _, binary = plain_bert(W, s.model, b["tokens"], b["tokentype_ids"], b["padding_mask"], b["labels"],
                                      b["loss_mask"].double(), b["is_random"])
        part = F.cross_entropy(binary, b["is_random"]).item()
        lm, sop = lm + (total.item() - part) / 3, sop + part / 3
    # a float64 model hands out its per-token MLM loss and binary logits in float64 (Megatron's ``.float()`` widens,
    # never narrows) and the step logs float64 sums: F64_REL relative (its count holds for this model within 20%: ffn
    # 64, 16 keys, vocabulary 128) on losses below 10 bounds them by 1e-11 absolute (the float32 narrowing missed it
    # by 4e-8)
    assert abs(out["sop_loss"] - sop) < 10 * F64_REL and abs(out["lm_loss"] - (lm + sop)) < 10 * F64_REL, (out, lm, sop)
    # an evaluation (dropout is off anyway) logs its own: Megatron's ``sop loss validation``, the step's totals reset
    W = {k: v.detach().clone() for k, v in gather_full_state(c.modules[0], c.groups).items()}
    read.clear()
    val = evaluate(c, batches(), 1)
    refs = [plain_bert(W, s.model, b["tokens"], b["tokentype_ids"], b["padding_mask"], b["labels"],
                       b["loss_mask"].double(), b["is_random"]) for b in read]
    sop = sum(F.cross_entropy(r[2], b["is_random"]).item() for r, b in zip(refs, read)) / len(read)
    val_ref = sum(r[0].item() for r in refs) / 3
    assert abs(val["val_sop_loss"] - sop) < 10 * F64_REL and abs(val["val_loss"] - val_ref) < 10 * F64_REL


def test_train_command_loss_drops(tmp_path):
    """`omnitron train --model bert_tiny` on the bundled corpus (sentence-split, WordPiece) through the
    real loop, optimizer and checkpointing: the MLM + SOP loss falls and a checkpoint is written."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.manual_seed(0)
    s = parse_settings(_train_args(tmp_path, "--train-iters", "30", "--eval-interval", "30", "--eval-iters", "1",
                                   "--save", str(tmp_path / "ckpt")), world_size=1)
    res = train(s, get_backend("cpu"))
    losses = [res["losses"][i] for i in sorted(res["losses"])]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert first > math.log(8192) * 0.9 and last < first - 1.5, losses  # starts near uniform, then learns
    assert res["validation"] and math.isfinite(res["validation"][0]["val_loss"])
    # the checkpoint reshards offline to tp2 and back to the same full weights (BERT skeletons)
    from omnitron.core.checkpoint.reshard import Layout, convert, read_full_state

    src = sorted((tmp_path / "ckpt").glob("iter_*"))[-1]
    tp2 = convert(str(src), str(tmp_path / "tp2"), Layout(tp=2))
    a, b = read_full_state(str(src)), read_full_state(tp2)
    assert a.model.keys() == b.model.keys() and "embedding.tokentype_embeddings.weight" in a.model
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)


# ---- pipeline parallelism (one spawn of 4 ranks) ---------------------------------------------------
PIPE = dict(BASE, num_layers=4, seq_length=16, params_dtype=torch.float64)
STEPS, MB, NMB, LR = 3, 2, 4, 0.5  # steps, micro-batch size, micro-batches per global batch, SGD lr
# PIPE_REL: a float64 model on the reference kernels at every layout against one process (u = 2**-53 = 1.1e-16).
# The layouts differ only in the order of sums: tp splits contractions of <= 48 terms in 2 partial sums, sp's
# reduce-scatter adds the same 2, dp adds 2 replicas' gradients, the micro-batches' gradients add in another
# grouping, the tied embedding's two copies add by an all-reduce; pipeline stages and schedules change no sum. A
# gradient element sums <= NMB x MB x 16 = 128 token terms, so it moves by <= 128 u = 1.4e-14 of its terms'
# magnitudes (a few times that relative to a value that cancels). An SGD step moves the weights by LR x g, and the
# loss's curvature over these weights amplifies a weight error by <= 1 + LR ||H|| ~ 2 a step (LR 0.5 keeps the run
# stable): three steps give <= 2^3 x 1.4e-14 ~ 1e-13 relative on the losses and weights, norm-wise. PIPE_REL =
# 1e-12 leaves a factor 10. A float32 model needed 1e-5, where a stage's hand-off rounded to float32 or a
# micro-batch weighted 1 / NMB +- 1e-6 passed unseen.
PIPE_REL = 1e-12
LAYOUTS = {"pp2_1f1b_dp2": (1, 2, None, False, "1f1b"), "pp2_vp2_dp2": (1, 2, 2, False, "interleaved"),
           "tp2_pp2_sp": (2, 2, None, True, "1f1b"), "pp2_zbh1_dp2": (1, 2, None, False, "zb-h1")}  # tp pp vp sp


def _pipe_batches(c) -> list[list[dict]]:
    """``[step][global micro-batch]`` batches; each carries its index ``mb`` for the loss records."""
    gen = torch.Generator().manual_seed(21)
    return [[dict(_batch(c, gen, b=MB), mb=i) for i in range(NMB)] for _ in range(STEPS)]


def _loss_parts(output, batch) -> tuple[float, float]:
    """(MLM mean over the masked positions, binary cross-entropy) of one micro-batch."""
    return bert_loss((output[0], None), batch)[0].item(), F.cross_entropy(output[1], batch["is_random"]).item()


@torch.no_grad()
def _sgd_step(modules) -> None:
    """Plain SGD on every parameter (the data-parallel wrapper's reduced ``main_grad`` when it has one)."""
    params = [p for m in modules for p in m.parameters()]
    grads = [p.grad if getattr(p, "main_grad", None) is None else p.main_grad for p in params]
    torch._foreach_add_(params, grads, alpha=-LR)


def _pipeline_reference() -> tuple[list[tuple[float, float]], dict]:
    """One process, the whole model: per step the (MLM, binary) means over the micro-batches, final weights."""
    c, groups = BertConfig(**PIPE), ParallelGroups.single()
    with reference_kernels():
        model, losses = BertModel(c, groups, seed=8), []
        for step in _pipe_batches(c):
            model.zero_grad()
            parts = []
            for batch in step:
                out = _forward(model, batch)
                (bert_loss(out, batch)[0] / NMB).backward()
                parts.append(_loss_parts(out, batch))
            losses.append(tuple(sum(p[i] for p in parts) / NMB for i in range(2)))
            _sgd_step([model])
    return losses, gather_full_state(model, groups)


def _pipeline_layouts() -> dict:
    """Each layout: BERT chunks from the training code (build_model_chunks, forward_step) in the data-parallel
    wrapper, STEPS SGD steps; per rank the recorded (MLM, binary) losses per (step, micro-batch), the combined
    loss the schedule returns, the weights this rank holds and the last stage's tied copy of the embedding."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt.state import gather_param
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel, finalize_model_grads
    from omnitron.core.parallel.pipeline import forward_backward
    from omnitron.core.training.components import build_model_chunks
    from omnitron.core.training.step import forward_step

    torch.set_num_threads(1)
    be, c, out = get_backend(), BertConfig(**PIPE), {}
    data = _pipe_batches(c)
    for name, (tp, pp, vp, sp, sched) in LAYOUTS.items():
        groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                     virtual_pipeline_model_parallel_size=vp, sequence_parallel=sp),
                                      backend=be)  # the pipeline's receive buffers on the backend's device
        modules = build_model_chunks(c, groups, 8, be)
        chunks = [DistributedDataParallel(m, groups, DataParallelConfig(bucket_size=4000)) for m in modules]
        per = NMB // groups.dp.size
        records, combined = {}, []
        for s, step in enumerate(data):
            def loss_fn(output, batch, s=s):
                records[(s, batch["mb"])] = _loss_parts(output, batch)
                return bert_loss(output, batch)

            for ch in chunks:
                ch.zero_grad_buffer()
            mine = iter([{k: v.to(be.device()) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                         for b in step[groups.dp.rank * per:(groups.dp.rank + 1) * per]])  # on the modules' device
            res = forward_backward(sched, chunks, mine, groups, num_microbatches=per, seq_length=c.seq_length,
                                   micro_batch_size=MB, hidden_size=c.hidden_size, forward_step_fn=forward_step,
                                   loss_fn=loss_fn, dtype=c.params_dtype)
            combined.append(res["loss"])
            finalize_model_grads(chunks, groups)
            _sgd_step(modules)
        state, copy = {}, None
        for m in modules:
            state.update(gather_full_state(m, groups))
            if m.post_process and not m.pre_process:
                copy = gather_param(m.output_layer.weight.detach(), m.output_layer.weight, groups.tp)
        out[name] = {"records": records, "combined": combined, "state": state, "copy": copy}
    return out


def _train_run(tmp: str, world: int, *layout: str) -> dict:
    """`omnitron train` (mock BERT data) for 3 iterations of a float64 model under ``layout``, saving at the end (the
    real loop, gradient clipping with the tied embedding's duplicate out of the norm).

    SGD with momentum, not Adam, so the final weights can be held to a bound (:func:`_assert_same_training`): a
    layout sums the same gradients in another order, and SGD's weights move by lr times that; Adam's first steps are
    ``lr sign(g)`` for any |g| >> eps, so an element whose gradient nearly cancels (the attention's key bias has
    none at all: the softmax removes it) flips by 2 lr on rounding alone. With Adam the comparison below failed
    under ``--backend sim`` in whole-suite runs (2.5e-5 on three layer-1 tensors, losses equal): there the
    one-process run's backward ran on autograd's device thread, created by an earlier test at 2 intra-op threads
    (``set_num_threads`` does not reach a thread that exists), so its sums took another order than the workers'."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    args = _train_args(Path(tmp), "--num-layers", "4", "--mock-data", "--micro-batch-size", "2", "--global-batch-size",
                       "8", "--train-iters", "3", "--eval-interval", "0", "--clip-grad", "0.05", "--optimizer", "sgd",
                       "--weight-decay", "0", "--save", str(Path(tmp) / "ckpt"), *layout)
    return train(settings_in(args, world, torch.float64), get_backend())["losses"]


def _assert_same_training(got: dict, want: dict, init: dict) -> None:
    """The pp run's final weights against the one-process run's, through what training added to ``init``.

    Each run moves the model by ``U = final - init``. SGD (momentum 0.9, no weight decay, gradients clipped to norm
    0.05, 3 steps at lr 3e-3) bounds it: step t moves by lr ||sum_i 0.9^(t-i) g_i|| <= lr 0.05 (1, 1.9, 2.71), so
    ||U|| <= 8.42e-4 (which also shows ``init`` is the runs' start). Both runs are float64 models and differ only in
    the order of sums: a gradient element sums <= 256 token terms a step (8 sequences x 32 positions), so it differs
    by at most 256 u = 2.8e-14 (u = 2**-53) of its terms' absolute sum, and so does U (the norm over the model allows
    1e-12, a factor 35, for cancellation within a sum and the clip factor's own rounding); and each of the 3 steps
    rounds a weight, where the two runs may land one ulp (<= 2^-52 |w|) apart: 3 2^-52 ||w|| more (~1e-15 here). A
    missing, repeated or stale step changes U by about a third; a float32 rounding anywhere on the way moves it by
    ~1e-7 of U. Per tensor a relative bound cannot hold: a zero-initialised bias whose gradient nearly cancels (the
    binary head's; the attention's key bias, which has no gradient at all) is rounding through and through."""
    keys = sorted(want)
    assert sorted(got) == keys == sorted(init)
    assert all(want[k].dtype == torch.float64 for k in keys)
    flat = {name: torch.cat([s[k].detach().cpu().double().reshape(-1) for k in keys])
            for name, s in (("got", got), ("want", want), ("init", init))}
    moved = (flat["want"] - flat["init"]).norm().item()
    assert 0 < moved <= 0.05 * 3e-3 * (1 + 1.9 + 2.71) * (1 + 1e-12), moved
    bound = 1e-12 * moved + 3 * 2.0**-52 * flat["want"].norm().item()
    assert (flat["got"] - flat["want"]).norm().item() < bound, ((flat["got"] - flat["want"]).norm().item(), bound)


def _pipeline_worker(tmp: str) -> dict:
    """Every rank: the layouts, then the loop at pp2 x vp2 x dp2 and at pp4 (middle stages read batches)."""
    return {"layouts": _pipeline_layouts(),
            "train": _train_run(tmp, 4, "--pipeline-model-parallel-size", "2",
                                "--num-layers-per-virtual-pipeline-stage", "1"),
            "train_pp4": _train_run(tmp + "_pp4", 4, "--pipeline-model-parallel-size", "4")}


@pytest.mark.multiprocess
def test_pipeline_parallel_bert_matches_one_process(tmp_path):
    """pp2 (1F1B) x dp2, pp2 x vp2 (interleaved) x dp2, tp2 x pp2 + SP and pp2 (ZB-H1) x dp2: per-step MLM and
    binary losses and final weights as one process (float64 models, PIPE_REL); the training loop at pp2 x vp2 x dp2
    and pp4 (middle stages need the padding mask) as one process, and the pp2 checkpoint reads, converts and loads at
    pp1 with identical full weights."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.reshard import Layout, convert, read_full_state
    from omnitron.core.training import checkpointing
    from omnitron.core.training.components import build_components

    results = run_distributed(_pipeline_worker, 4, str(tmp_path / "pp"), env=REFERENCE_KERNELS)
    ref_losses, ref_state = _pipeline_reference()
    for name in LAYOUTS:
        records, state = {}, {}
        for rank in results:
            res = rank["layouts"][name]
            records.update(res["records"])
            state.update(res["state"])
            assert res["combined"] == pytest.approx([a + b for a, b in ref_losses], rel=PIPE_REL), name
            if res["copy"] is not None:  # the tied copy moved with the embedding (the same sums: PIPE_REL at most)
                assert _rel(res["copy"], state["embedding.word_embeddings.weight"]) < PIPE_REL, name
        assert sorted(records) == [(s, i) for s in range(STEPS) for i in range(NMB)], name
        for s, (mlm, binary) in enumerate(ref_losses):
            got = [sum(records[(s, i)][k] for i in range(NMB)) / NMB for k in range(2)]
            assert got == pytest.approx([mlm, binary], rel=PIPE_REL), (name, s)
        assert state.keys() == ref_state.keys(), name
        for k, w in ref_state.items():
            assert state[k].dtype == torch.float64 and _rel(state[k], w) < PIPE_REL, (name, k)
    # the training loop, and its pp2 x vp2 checkpoint at pp1
    with reference_kernels():
        one = _train_run(str(tmp_path / "one"), 1)
    for rank in results:
        for run in ("train", "train_pp4"):
            assert rank[run].keys() == one.keys() and len(one) == 3
            # the losses by the same sums as the weights (_assert_same_training): 1e-12 relative bounds them
            assert [rank[run][i] for i in one] == pytest.approx([one[i] for i in one], rel=1e-12), run
    src, ref_ck = (sorted((tmp_path / d / "ckpt").glob("iter_*"))[-1] for d in ("pp", "one"))
    full, single = read_full_state(str(src)), read_full_state(str(ref_ck))
    assert full.model.keys() == single.model.keys()
    pp1 = read_full_state(convert(str(src), str(tmp_path / "pp1"), Layout(pp=1)))
    assert pp1.model.keys() == full.model.keys() and all(torch.equal(pp1.model[k], full.model[k]) for k in full.model)
    settings = settings_in(_train_args(tmp_path / "load", "--num-layers", "4", "--mock-data", "--optimizer", "sgd",
                                       "--load", str(tmp_path / "pp" / "ckpt"),
                                       "--use-checkpoint-opt_param-scheduler"), 1, torch.float64)
    comp = build_components(settings, get_backend("cpu"))
    init = gather_full_state(comp.modules[0], comp.groups)  # the runs' initial weights (same seed), before the load
    _assert_same_training(full.model, single.model, init)
    assert checkpointing.load(comp)
    loaded = gather_full_state(comp.modules[0], comp.groups)
    assert loaded.keys() == full.model.keys() and all(torch.equal(loaded[k], full.model[k]) for k in full.model)
