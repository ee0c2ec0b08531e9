"""The model-family contract: a family defined only in tests/ (``toy_family.py``) trains through
``omnitron train`` (two data-parallel processes), with its own preset, flag, dataset, loss and refusals."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, GBS, LR, SEED, VOCAB = 6, 8, 5.0, 1234, 63


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE] + [p for p in (env.get("PYTHONPATH") or "").split(os.pathsep) if p])
    return env


def _train(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "omnitron", "train", "--model-family-module", "toy_family",
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), *args],
                          capture_output=True, text=True, timeout=timeout, env=_env())


def _reference_losses(toy, cfg) -> list[float]:
    """One process, float64, plain torch: the same window model, data order and SGD (momentum 0.9)."""
    w = {k: v.clone().requires_grad_(True) for k, v in toy.init_weights(cfg, SEED).items()}
    opt = torch.optim.SGD(list(w.values()), lr=LR, momentum=0.9)
    data = toy.ProgressionDataset(STEPS * GBS, cfg.seq_length, cfg.vocab_size, SEED)
    losses = []
    for step in range(STEPS):
        batch = [data[i] for i in range(step * GBS, (step + 1) * GBS)]
        tokens = torch.stack([b["tokens"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        x = toy.window_mean(w["embedding"][tokens], cfg.toy_context)
        logits = x @ w["output"].t() + w["bias"]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())  # every token counts
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_toy_family_trains_through_omnitron_train(tmp_path):
    sys.path.insert(0, HERE)
    try:
        import toy_family as toy
    finally:
        sys.path.remove(HERE)
    save = str(tmp_path / "run")
    proc = _train("--model", "toy_tiny", "--toy-context", "2", "--nproc-per-node", "2", "--micro-batch-size", "2",
                  "--global-batch-size", str(GBS), "--train-iters", str(STEPS), "--lr", str(LR),
                  "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--optimizer", "sgd", "--weight-decay", "0",
                  "--clip-grad", "0", "--eval-interval", "0", "--log-interval", "1", "--seed", str(SEED),
                  "--save", save, "--save-interval", str(STEPS), "--no-tensorboard")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(save, "metrics.jsonl")) as f:
        got = [json.loads(line)["lm_loss"] for line in f]
    cfg = toy.toy_tiny(vocab_size=VOCAB + 1, toy_context=2)  # NullTokenizer: V ids + eod
    want = _reference_losses(toy, cfg)
    # Error analysis: the engine runs fp32, the reference float64. A loss evaluation's largest reduction
    # has n = V + h + b*s = 64 + 16 + 32 = 112 terms, so its relative rounding error is <= n * u32 =
    # 112 * 6e-8 = 6.7e-6, 2.8e-5 absolute at L ~ 4.2. Gradients carry the same relative error; SGD's
    # momentum buffer weighs them by at most 1 / (1 - 0.9) = 10, so one step's weight error is
    # <= lr * 10 * n * u32 * |g| = 5 * 10 * 6.7e-6 * 1 = 3.4e-4 (|g| <= 1 for a mean cross-entropy), moving
    # later losses by at most |dL/dw| <= 1 times that. Over 6 steps: <= 6 * (2.8e-5 + 3.4e-4) = 2.2e-3.
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, want)) < 2.5e-3, (got, want)
    assert want[-1] < want[0] - 0.3  # the run learns (so a wrong dataset or loss could not match it)
    meta = json.load(open(os.path.join(save, f"iter_{STEPS:07d}", "metadata.json")))
    assert meta["config"]["model_type"] == "toy" and meta["model"]["toy_context"] == 2


@pytest.mark.parametrize("args, message", [
    (["--model", "gpt2_tiny", "--toy-context", "3"], "--toy-context only applies to TOY; add --model-type toy"),
    (["--model", "toy_tiny", "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"],
     "the toy family has no tensor or pipeline parallelism"),
    (["--model", "toy_tiny", "--model-family-module", "no_such_family_module"],
     "--model-family-module no_such_family_module: cannot import it"),
])
def test_toy_family_refusals_are_one_line(args, message):
    proc = _train(*args, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr


def _recorder(kind: str):
    """A build_datasets of one signature: the contract's first (no is_node_builder), one naming every keyword,
    one taking ``**kwargs``; it returns the keywords it was given."""
    if kind == "first":
        def build(settings, tokenizer, *, train_samples, valid_samples, test_samples, is_builder_rank=True,
                  barrier=None):
            return dict(train_samples=train_samples, valid_samples=valid_samples, test_samples=test_samples,
                        is_builder_rank=is_builder_rank, barrier=barrier)
    elif kind == "named":
        def build(settings, tokenizer, train_samples, valid_samples, test_samples, is_builder_rank=True,
                  barrier=None, is_node_builder=False):
            return dict(train_samples=train_samples, valid_samples=valid_samples, test_samples=test_samples,
                        is_builder_rank=is_builder_rank, barrier=barrier, is_node_builder=is_node_builder)
    else:
        def build(settings, tokenizer, **kw):
            return kw
    return build


@pytest.mark.parametrize("kind", ["first", "named", "kwargs"])
@pytest.mark.parametrize("rank0, node_first", [(True, True), (False, True), (False, False)])
def test_build_datasets_of_every_signature_gets_what_it_takes(kind, rank0, node_first, caplog):
    """A family's build_datasets written before ``is_node_builder`` is called without it (it raised TypeError);
    one that names it or takes ``**kwargs`` gets it; only another node's first rank warns about the drop."""
    import dataclasses

    from omnitron.core.models.gpt.family import GPT_FAMILY

    family = dataclasses.replace(GPT_FAMILY, build_datasets=_recorder(kind))
    barrier = object()
    sizes = dict(train_samples=8, valid_samples=2, test_samples=0, is_builder_rank=rank0, barrier=barrier,
                 is_node_builder=node_first)
    with caplog.at_level("WARNING", logger="omnitron.core.models.family_base"):
        got = family.datasets(None, None, **sizes)
    want = {k: v for k, v in sizes.items() if kind != "first" or k != "is_node_builder"}
    assert got == want
    warned = [r.getMessage() for r in caplog.records]
    if kind == "first" and node_first and not rank0:
        assert len(warned) == 1 and "takes no is_node_builder keyword" in warned[0], warned
        assert "--data-cache-path" in warned[0]
    else:
        assert warned == []
