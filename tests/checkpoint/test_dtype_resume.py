"""Resuming under another precision: what each saved tensor becomes, against plain torch casts of the saved ones.

One process, a 2-layer model, 2 Adam steps, then a save; a second run of another precision loads it (the torch
format and torch_dist). Reference: the saving run's own tensors (its fp32 masters, moments, loss scaler state), cast
once in plain torch into the loading run's dtypes. Asserted exactly (every value is a single rounding of a saved one):

* --bf16 <-> --fp16 (plain and distributed optimizer): each weight is its saved fp32 master rounded once into the
  run's dtype, the masters bit for bit. Before the fix the weights were the other run's bf16 / fp16 weights rounded
  again: bf16 -> fp16 left 1797 of the word embedding's 2048 elements at bf16's precision (up to 1.8e-4 off), fp16
  -> bf16 136 of them a bf16 step off (up to 4.9e-4), in the resumed run's first forward.
* loss scales (Megatron's rule: a constant --loss-scale is the command line's, ConstantGradScaler loads nothing):
  an fp16 run's dynamic scale does not carry into a bf16 (or fp16) run given --loss-scale (before: the run
  scaled by the checkpoint's 1024 instead of --loss-scale 1); a dynamic scaler resuming a constant one's
  checkpoint starts at --initial-loss-scale (before: KeyError 'growth_tracker'); a dynamic state still carries.

Checks that held before: a float64 checkpoint into bf16 / fp16 / bf16-moment runs gives ``Tensor.to`` of each saved
tensor (NOTE: torch casts float64 to bf16 / fp16 through fp32, so that is the reference, not a correctly rounded
float64 -> bf16 conversion); a float64 checkpoint written before float64 runs kept float64 state (fp32 masters and
moments, commit e0cc1e3) resumes in float64, widened exactly.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

S, V, GBS = 16, 64, 4
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", str(S), "--max-position-embeddings", str(S), "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", str(V - 1), "--make-vocab-size-divisible-by", "1", "--num-workers", "0",
         "--no-tensorboard", "--seed", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", str(GBS), "--lr", "1e-3"]
BF16, FP16 = ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]
ZERO = ["--use-distributed-optimizer"]


def _components(extra: list[str], dtype: torch.dtype | None = None):
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    s = parse_settings([*FLAGS, *extra], 1)
    if dtype is not None:
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=dtype))
    return build_components(s, get_backend())


def _trained(extra: list[str], where: str, fmt: str, dtype: torch.dtype | None = None):
    """Components of ``FLAGS + extra`` after 2 steps on fresh random tokens, saving into ``where`` (not saved yet)."""
    from omnitron.core.training.step import train_step

    c = _components([*extra, "--save", where, "--ckpt-format", fmt], dtype)
    tokens = torch.randint(0, V, (2, GBS, S + 1))
    for it in range(2):
        batches = [{"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(2, S),
                    "position_ids": torch.arange(S)[None].expand(2, S)} for t in tokens[it].split(2)]
        assert not train_step(c, iter(batches))["skipped"]
        c.iteration, c.consumed_samples = it + 1, (it + 1) * GBS
    return c


def _loaded(extra: list[str], where: str, fmt: str):
    from omnitron.core.training.checkpointing import load

    c = _components([*extra, "--load", where, "--ckpt-format", fmt])
    assert load(c)
    return c


def _saved(c, kind: str) -> dict[str, torch.Tensor]:
    """The optimizer's state ``kind`` (``master``, ``exp_avg``, ...) by parameter name, whole (the distributed
    optimizer's slices gathered), as its checkpoints hold it."""
    return {n: e[kind] for n, e in c.optimizer.state_dict()["tensors"].items()}


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("src,dst", [(BF16, FP16), (FP16, BF16), (BF16, [*FP16, *ZERO]), ([*FP16, *ZERO], BF16)],
                         ids=["bf16_fp16", "fp16_bf16", "bf16_fp16_zero", "fp16_zero_bf16"])
def test_bf16_fp16_resume_rounds_each_master_once(tmp_path, fmt, src, dst):
    from omnitron.core.training.checkpointing import save

    s = _trained(src, str(tmp_path), fmt)
    save(s)
    masters = _saved(s, "master")
    t = _loaded(dst, str(tmp_path), fmt)
    got_masters, weights = _saved(t, "master"), dict(zip(t.optimizer.names, t.optimizer.params))
    assert masters.keys() == weights.keys()
    for name, m in masters.items():
        assert torch.equal(got_masters[name], m), name
        w = weights[name].detach()
        assert w.dtype != s.optimizer.params[0].dtype
        assert torch.equal(w, m.to(w.dtype)), (name, int((w != m.to(w.dtype)).sum()))


BF16_MOMENTS = [*BF16, *ZERO, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype",
                "bf16"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("dst", [BF16, [*FP16, *ZERO], BF16_MOMENTS], ids=["bf16", "fp16_zero", "bf16_moments"])
def test_a_float64_checkpoint_resumes_cast_once(tmp_path, fmt, dst):
    """A float64 run's checkpoint (float64 weights, no masters, float64 moments) into a bf16 / fp16 run: each weight
    is the float64 one cast to the run's dtype, each master cast to fp32 (with master remainders: the fp32 master
    split, its bf16 half rounded ties away from zero, TE's rule, so that weight is not compared), each moment cast
    to its storage dtype (bf16 moments; fp32 ones otherwise) -- ``Tensor.to`` of the saved tensor, exactly."""
    from omnitron.core.training.checkpointing import save

    s = _trained([], str(tmp_path), fmt, torch.float64)
    save(s)
    weights = {n: p.detach().clone() for n, p in zip(s.optimizer.names, s.optimizer.params)}
    moments = {k: _saved(s, k) for k in s.optimizer.state}
    t = _loaded(dst, str(tmp_path), fmt)
    masters, live = _saved(t, "master"), dict(zip(t.optimizer.names, t.optimizer.params))
    remainders = any(r is not None for r in t.optimizer.remainders)
    for name, w in weights.items():
        assert torch.equal(masters[name], w.float()), name
        mine = live[name].detach()
        assert remainders or torch.equal(mine, w.to(mine.dtype)), name
    for key, by_name in moments.items():
        got = _saved(t, key)
        for name, m in by_name.items():
            assert torch.equal(got[name], m.to(got[name].dtype)), (key, name)


def _scale_after(tmp_path, fmt, src: list[str], dst: list[str], caplog):
    from omnitron.core.training.checkpointing import save

    s = _trained(src, str(tmp_path), fmt)
    saved = s.optimizer.loss_scaler.state_dict()
    save(s)
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        t = _loaded(dst, str(tmp_path), fmt)
    return saved, t.optimizer.loss_scaler, caplog.text


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_dynamic_fp16_scale_does_not_carry_into_a_constant_one(tmp_path, fmt, caplog):
    saved, scaler, text = _scale_after(tmp_path, fmt, FP16, [*BF16, "--loss-scale", "1"], caplog)
    assert saved["scale"] == 1024.0 and "growth_tracker" in saved
    assert scaler.scale == 1.0 and scaler.state_dict() == {"scale": 1.0}
    assert "the checkpoint's loss scale 1024 is not loaded: --loss-scale 1" in text


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_dynamic_scaler_resuming_a_constant_one_starts_at_its_initial_scale(tmp_path, fmt, caplog):
    saved, scaler, text = _scale_after(tmp_path, fmt, ["--fp16", "--loss-scale", "8"],
                                       ["--fp16", "--initial-loss-scale", "64"], caplog)
    assert saved == {"scale": 8.0}
    assert scaler.state_dict() == {"scale": 64.0, "growth_tracker": 0, "hysteresis_tracker": 2}
    assert "was constant (--loss-scale): the dynamic scale starts at --initial-loss-scale 64" in text


def test_a_dynamic_scale_still_carries_and_a_bf16_run_drops_it(tmp_path, caplog):
    saved, scaler, text = _scale_after(tmp_path / "a", "torch", [*FP16, "--loss-scale-window", "1"],
                                       ["--fp16", "--initial-loss-scale", "2"], caplog)
    assert saved == {"scale": 4096.0, "growth_tracker": 0, "hysteresis_tracker": 2}  # doubled after each clean step
    assert scaler.state_dict() == saved and "loss scale" not in text
    _, none, text = _scale_after(tmp_path / "b", "torch", FP16, BF16, caplog)
    assert none is None and "the checkpoint's loss scale 1024 is dropped: this run scales no loss" in text


def _as_saved_before_float64_masters(s, monkeypatch) -> None:
    """Make float64 run ``s`` save as omnitron did before 2026-12-07 (commit e0cc1e3): an fp32 master beside every
    float64 weight (the weights were copied from the masters at every step, so they equal them) and fp32 moments."""
    from omnitron.core.checkpoint import dist

    opt = s.optimizer
    with torch.no_grad():
        for p in opt.params:
            p.copy_(p.float())  # the old run's weights: its fp32 masters, widened
    old = {k: [t.float() for t in ts] for k, ts in opt.state.items()}

    def state_dict():
        entries = {n: {**{k: old[k][i] for k in old}, "master": p.detach().float()}
                   for i, (n, p) in enumerate(zip(opt.names, opt.params))}
        return {"step": opt.step_count, "optimizer": opt.config.optimizer, "tensors": entries}

    monkeypatch.setattr(opt, "state_dict", state_dict)  # the torch format's shard
    monkeypatch.setattr(opt, "saved_state", lambda: old)  # torch_dist's pieces: fp32 moments, fp32 masters
    monkeypatch.setattr(opt, "saved_masters", lambda: [p.detach().float() for p in opt.params])
    monkeypatch.setattr(dist, "keeps_master", lambda dtype: dtype != torch.float32)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_float64_checkpoint_with_fp32_masters_resumes_in_float64(tmp_path, fmt, monkeypatch):
    """A float64 checkpoint written before float64 runs kept float64 state (fp32 masters and moments) resumes in a
    float64 run: its weights are the fp32 masters widened (equal to the saved weights, which were copied from them),
    its moments the fp32 ones widened, both exactly; the state is float64 from there on."""
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.reshard import read_full_state
    from omnitron.core.training.checkpointing import load, save

    s = _trained([], str(tmp_path), fmt, torch.float64)
    with monkeypatch.context() as patched:
        _as_saved_before_float64_masters(s, patched)
        saved = s.optimizer.state_dict()["tensors"]
        save(s)
    full = read_full_state(find_latest(str(tmp_path)))  # as the old code wrote it: fp32 masters and moments
    assert {t.dtype for kind in full.optimizer.values() for t in kind.values()} == {torch.float32}
    assert full.optimizer["master"].keys() == full.model.keys() and len(full.model) == len(saved)
    t = _components(["--load", str(tmp_path), "--ckpt-format", fmt], torch.float64)
    assert load(t)
    weights = dict(zip(t.optimizer.names, t.optimizer.params))
    for name, entry in t.optimizer.state_dict()["tensors"].items():
        assert "master" not in entry and torch.equal(weights[name].detach(), saved[name]["master"].double()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].dtype == torch.float64 and torch.equal(entry[key], saved[name][key].double()), key
