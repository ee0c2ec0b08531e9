"""Delayed scaling step by step, FP8 config validation, enable_fp8 selection, and exact resume."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8 import (DelayedScaling, FP8Config, FP8Linear, check_backend, enable_fp8,
                                         fp8_state_dict, load_fp8_state_dict)

AMAXES = [2.0, 0.0, 8.0, 4.0, float("inf"), 1.0, 0.5, 0.25, 3.0]


def _expected(amaxes, fmax, hist_len, algo, margin):
    """The recipe written out longhand: (scale used at each step, history after each step)."""
    hist, scale, used, hists = [0.0] * hist_len, 1.0, [], []
    for a in amaxes:
        used.append(scale)
        hist = [a] + hist[:-1]
        summary = max(hist) if algo == "max" else hist[0]
        if summary > 0 and summary != float("inf"):
            scale = fmax / 2 ** margin / summary
        hists.append(list(hist))
    return used, hists, scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_history_and_scale_follow_the_recipe(algo):
    st = DelayedScaling("e4m3", history_len=3, algo=algo, margin=1)
    used, hists, final = _expected(AMAXES, 448.0, 3, algo, 1)
    for a, u, h in zip(AMAXES, used, hists):
        assert st.scale.item() == pytest.approx(u, rel=1e-7)
        st.push(torch.tensor(a))
        assert st.amax_history.tolist() == h
    assert st.scale.item() == pytest.approx(final, rel=1e-7)


def test_delayed_executor_quantizes_with_the_scale_in_force():
    """Each call uses the previous calls' scale (not its own amax), then records its amax; the first call,
    with no history, uses its own amax."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="e4m3", fp8_amax_history_len=2, fp8_amax_compute_algo="max")
    ex = FP8Linear(cfg, get_backend().fp8)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g)
    x_amax = [3.0, 50.0, 0.1, 0.2]
    used, hists, _ = _expected(x_amax, 448.0, 2, "max", 0)
    used[0] = 448.0 / x_amax[0]  # the first use has no history: scaled from its own amax
    for a, scale, hist in zip(x_amax, used, hists):
        x = torch.randn(8, 32, generator=g)
        x = x / x.abs().max() * a
        y = ex(x, w, None)
        qx = (x * scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() / scale
        ex.states["input"].flush()  # the push of this call's amax is otherwise applied at the next call
        assert ex.states["input"].amax_history.tolist() == pytest.approx(hist)
        w_scale_used = 448.0 / w.abs().max().item()  # w's amax is constant: first use and history agree
        qw = (w * w_scale_used).clamp(-448, 448).to(torch.float8_e4m3fn).double() / w_scale_used
        torch.testing.assert_close(y.double(), qx @ qw.t(), rtol=1e-5, atol=1e-5)


def test_config_validation_names_the_flag():
    with pytest.raises(ConfigError, match="mxfp8"):
        FP8Config(fp8_recipe="mxfp8")
    with pytest.raises(ConfigError, match="--fp8-format"):
        FP8Config(fp8_format="e5m2")
    with pytest.raises(ConfigError, match="--fp8-amax-compute-algo"):
        FP8Config(fp8_amax_compute_algo="mean")
    with pytest.raises(ConfigError, match="--fp8-amax-history-len"):
        FP8Config(fp8_amax_history_len=0)
    with pytest.raises(ConfigError, match="--fp8-margin"):
        FP8Config(fp8_margin=-1)
    assert FP8Config(fp8_format="hybrid").backward_format == "e5m2"
    assert FP8Config(fp8_format="e4m3").backward_format == "e4m3"


def test_megatron_flags_build_the_config():
    import argparse

    from omnitron.core.precision.fp8 import add_fp8_args, fp8_config_from_args

    p = add_fp8_args(argparse.ArgumentParser())
    assert fp8_config_from_args(p.parse_args([])) is None
    cfg = fp8_config_from_args(p.parse_args(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--fp8-margin", "1",
                                             "--first-last-layers-bf16"]))
    assert ((cfg.fp8_format, cfg.fp8_recipe, cfg.fp8_margin, cfg.first_last_layers_bf16)
            == ("e4m3", "blockwise", 1, True))
    with pytest.raises(ConfigError, match="mxfp8"):
        fp8_config_from_args(p.parse_args(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]))


def test_backend_without_fp8_is_refused_with_the_capability_named():
    be = get_backend()
    caps = replace(be.capabilities(), fp8_formats=("e4m3",), fp8_recipes=("delayed",))

    class Limited:
        name, capabilities = "limited", staticmethod(lambda: caps)

    check_backend(FP8Config(fp8_format="e4m3"), Limited)
    with pytest.raises(ConfigError, match="e5m2"):
        check_backend(FP8Config(fp8_format="hybrid"), Limited)
    with pytest.raises(ConfigError, match="blockwise"):
        check_backend(FP8Config(fp8_format="e4m3", fp8_recipe="blockwise"), Limited)


class _Stack(nn.Module):
    """Minimal stand-in with Megatron naming: layers.<i>.fc, output_layer."""

    def __init__(self, n=4, h=32):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential() for i in range(n)})
        for i in range(n):
            self.layers[str(i)].add_module("fc", nn.Linear(h, h))
        self.output_layer = nn.Linear(h, 8)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.output_layer(x)


def test_enable_fp8_selection():
    m = _Stack()
    on = enable_fp8(m, FP8Config(fp8_recipe="tensorwise"), None)
    assert sorted(on) == [f"layers.{i}.fc" for i in range(4)]  # output layer stays wide by default
    m = _Stack()
    on = enable_fp8(m, FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True), None)
    assert sorted(on) == ["layers.1.fc", "layers.2.fc"]
    m = _Stack()
    on = enable_fp8(m, FP8Config(), None, modules=["*output_layer", "layers.3.*"])
    assert sorted(on) == ["layers.3.fc", "output_layer"]
    with pytest.raises(ConfigError, match="selected no linear"):
        enable_fp8(_Stack(), FP8Config(), None, modules=["nothing*"])
    # the patched forward really runs FP8: output differs from the wide model but stays close
    ref = _Stack()
    m = copy.deepcopy(ref)
    enable_fp8(m, FP8Config(fp8_recipe="tensorwise"), None)
    x = torch.randn(16, 32)
    y, yr = m(x), ref(x)
    assert 0 < (y - yr).abs().max() < 0.1 * yr.abs().max()


def _train(model, steps, x, t, opt, enabled=None):
    """``steps`` steps; ``enabled`` (per-step delayed scaling): its update at each step's end."""
    from omnitron.core.precision.fp8.enable import fp8_step

    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), t)
        loss.backward()
        opt.step()
        if enabled is not None:
            fp8_step(enabled)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("per_step", [False, True], ids=["per-use", "per-step"])
def test_resume_is_exact_with_recipe_state(per_step):
    """Checkpoint = weights + optimizer + fp8_state_dict; the resumed run repeats the uninterrupted one bit for bit,
    and without the FP8 state it does not (per step: the restored state also ends the first step's current
    scaling)."""
    torch.manual_seed(0)
    x, t = torch.randn(64, 32), torch.randn(64, 8)
    cfg = FP8Config(fp8_recipe="delayed", fp8_amax_history_len=4)
    base = _Stack()
    a = copy.deepcopy(base)
    enabled = enable_fp8(a, cfg, None, per_step=per_step)
    enabled = enabled if per_step else None
    opt_a = torch.optim.SGD(a.parameters(), lr=0.05)
    _train(a, 3, x, t, opt_a, enabled)
    ckpt = copy.deepcopy({"model": a.state_dict(), "opt": opt_a.state_dict(), "fp8": fp8_state_dict(a)})
    assert all(len(v) == 3 for v in ckpt["fp8"].values())  # input, weight, grad_output per linear
    tail = _train(a, 4, x, t, opt_a, enabled)

    def resumed(with_fp8_state):
        b = _Stack()
        en = enable_fp8(b, cfg, None, per_step=per_step)
        b.load_state_dict(ckpt["model"])
        opt_b = torch.optim.SGD(b.parameters(), lr=0.05)
        opt_b.load_state_dict(ckpt["opt"])
        if with_fp8_state:
            load_fp8_state_dict(b, ckpt["fp8"])
        return _train(b, 4, x, t, opt_b, en if per_step else None)

    assert resumed(True) == tail
    assert resumed(False) != tail
    # a resume under other FP8 flags stops with one line naming the flag (ConfigError), no traceback
    with pytest.raises(ConfigError, match="--fp8-amax-history-len"):
        b = _Stack()
        enable_fp8(b, replace(cfg, fp8_amax_history_len=8), None)
        load_fp8_state_dict(b, ckpt["fp8"])
    for other in ("tensorwise", "blockwise"):
        with pytest.raises(ConfigError, match=f"--fp8-recipe {other}: the checkpoint's FP8 state"):
            b = _Stack()
            enable_fp8(b, replace(cfg, fp8_recipe=other), None)
            load_fp8_state_dict(b, ckpt["fp8"])


@pytest.mark.parametrize("per_step", [False, True], ids=["per-use", "per-step"])
def test_delayed_scaling_is_exact_under_activation_recomputation(per_step):
    """A forward recomputed during backward re-quantizes with its original scale and changes no state (per use:
    it records no amax; per step: the scale is the step's and re-observing an amax is a no-op): gradients and
    the recipe state equal those of the run that keeps its activations."""
    from torch.utils.checkpoint import checkpoint

    from omnitron.core.precision.fp8.enable import fp8_step

    torch.manual_seed(3)
    cfg = FP8Config(fp8_recipe="delayed", fp8_amax_history_len=4)
    plain = _Stack()
    recomputed = copy.deepcopy(plain)
    enabled = [enable_fp8(m, cfg, None, per_step=per_step) for m in (plain, recomputed)]

    def run(model, x, ckpt):
        for layer in model.layers.values():
            x = checkpoint(lambda h, m=layer: torch.tanh(m(h)), x,
                           use_reentrant=False) if ckpt else torch.tanh(layer(x))
        return model.output_layer(x)

    for step in range(4):
        x = torch.randn(32, 32) * (1 + step)
        grads = []
        for model, ckpt in ((plain, False), (recomputed, True)):
            model.zero_grad()
            run(model, x.clone().requires_grad_(), ckpt).square().mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for a, b in zip(*grads):
            assert torch.equal(a, b), f"step {step}"
        for e in enabled:
            fp8_step(e)
    sa, sb = fp8_state_dict(plain), fp8_state_dict(recomputed)
    for name in sa:
        for role in sa[name]:
            assert torch.equal(sa[name][role]["amax_history"], sb[name][role]["amax_history"]), (name, role)


def test_enable_fp8_on_gpt_stages_keeps_global_first_and_last_layers_wide():
    from omnitron.core.models.gpt import GPTConfig, GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                    make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
    single = ParallelGroups.single()
    recipe = FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True)
    whole = enable_fp8(GPTModel(cfg, single), recipe, single)
    assert {n.split(".")[2] for n in whole} == {"1", "2"} and not any("output_layer" in n for n in whole)
    assert len(whole) == 2 * 4  # qkv, proj, fc1, fc2 per FP8 layer
    # a later pipeline stage (layers 2, 3): layer numbers are global, so only layer 3 stays wide
    stage = GPTModel(cfg, single, pre_process=False, layer_offset=2, num_layers=2)
    assert {n.split(".")[2] for n in enable_fp8(stage, recipe, single)} == {"2"}


def test_layout_change_names_a_restart_only_where_there_is_state():
    """A checkpoint read under another layout drops the FP8 state; the log says so when the recipe keeps one
    (delayed: histories and scales), and says nothing for the stateless recipes (nothing restarts)."""
    from omnitron.core.training.checkpointing import _holds_tensors

    held = {}
    for recipe in ("delayed", "tensorwise", "blockwise"):
        m = _Stack()
        enable_fp8(m, FP8Config(fp8_recipe=recipe), None)
        m(torch.randn(8, 32)).sum().backward()
        held[recipe] = _holds_tensors(fp8_state_dict(m))
    assert held == {"delayed": True, "tensorwise": False, "blockwise": False}


def test_first_last_layers_bf16_leaves_multi_token_prediction_in_fp8():
    """Megatron gives MTP layers ``layer_no=-1``, never kept wide by ``--first-last-layers-bf16``: the MTP depth's
    linears are converted with the flag as without it, and only the decoder's first and last layers stay wide.
    Fails when ``mtp.layers.0`` is numbered as decoder layer 1 (it was: the flag then dropped the depth)."""
    from omnitron.core.models.gpt import GPTConfig, GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                    make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                    position_embedding_type="rope", mtp_num_layers=1)
    single = ParallelGroups.single()
    plain = enable_fp8(GPTModel(cfg, single), FP8Config(fp8_recipe="tensorwise"), single)
    ends = enable_fp8(GPTModel(cfg, single), FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True), single)
    mtp = {n for n in plain if n.startswith("mtp.")}
    assert len(mtp) == 4 and mtp <= set(ends)  # qkv, proj, fc1, fc2 of the depth's layer, in both
    assert {n.split(".")[2] for n in ends if n.startswith("decoder.")} == {"1", "2"}


def test_first_last_layers_bf16_keeping_every_layer_wide_names_the_flags():
    """--num-layers 2 --fp8-format e4m3 --first-last-layers-bf16 (one layer kept wide at each end by default) leaves
    nothing in FP8: the refusal names the flags to change (it said "check the module patterns", which no flag
    sets; found by fuzzing the command line)."""
    from omnitron.core.models.gpt import GPTConfig, GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
                    make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0)
    single = ParallelGroups.single()
    with pytest.raises(ConfigError, match="selected no linear layer: --first-last-layers-bf16 keeps every layer "
                                          r"wide \(decoder.layers.0, decoder.layers.1\); lower --num-layers-at-start"):
        enable_fp8(GPTModel(cfg, single), FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True), single)
    recipe = FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_end_in_bf16=0)
    assert {n.split(".")[2] for n in enable_fp8(GPTModel(cfg, single), recipe, single)} == {"1"}
