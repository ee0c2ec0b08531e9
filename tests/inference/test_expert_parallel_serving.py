"""Sharded generation with expert parallelism (``--expert-model-parallel-size``): each rank holds E / ep experts of
every MoE layer, the ep ranks replicate the dense layers and exchange tokens; the tokens and log-probs are the
one-process run's, and layouts that cannot apply are refused before any rank starts.

The checkpoints and the log-prob tolerance are test_sharded_generate's (a random, sharpened 4-layer model written
at tp1; LP_ATOL's analysis there covers these layouts too: ep changes no sum's order, an expert's rows are whole
on its rank, and the combine adds at most topk weighted outputs per token, as in one process).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.inference.test_sharded_generate import (MOE_PROMPT_SETS, _assert_same, _checkpoint, _complete,
                                                   _moe_config, _one_process)

GREEDY = {"temperature": 0.0}


def _rank(root: str, tp: int, ep: int) -> dict:
    """This rank's experts, parameter bytes, tokens its first MoE layer dispatched in the first prefill, and the
    greedy completions of MOE_PROMPT_SETS, loaded through ``omnitron generate``'s job at tp x ep."""
    from omnitron.backends import get_backend
    from omnitron.core.inference.sharded import GenerateJob

    torch.set_num_threads(1)
    job = GenerateJob(load=root, tensor_model_parallel_size=tp, expert_model_parallel_size=ep, world_size=tp * ep)
    groups, loaded = job.load_stage(get_backend())
    moe = [m for m in loaded.model.modules() if hasattr(m, "ep_replicated")]
    dispatched = []
    steps = moe[0].experts_steps

    def spy(x, gates, mask):
        dispatched.append(x.shape[0])
        return steps(x, gates, mask)

    moe[0].experts_steps = spy
    out = [_complete(loaded, GREEDY, p) for p in MOE_PROMPT_SETS]
    return {"experts": [sorted(map(int, m.experts.keys())) for m in moe], "dispatched": dispatched[0],
            "bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()), "out": out,
            "expert_bytes": sum(p.numel() * p.element_size() for n, p in loaded.model.named_parameters()
                                if ".experts." in n),
            "ep_rank": groups.ep.rank, "tp_rank": groups.tp.rank, "read": loaded.read_bytes}


@pytest.mark.parametrize("tp,ep,backend,kind", [
    (1, 2, None, "gpt"),
    pytest.param(2, 2, None, "deepseek", marks=pytest.mark.slow),
    pytest.param(1, 2, "sim", "gpt", marks=[pytest.mark.slow, requires_sim()]),
    pytest.param(2, 2, "sim", "gpt", marks=[pytest.mark.slow, requires_sim()])])
def test_expert_parallel_generation_matches_one_process(tmp_path, tp, ep, backend, kind):
    """Every rank of tp x ep prints the one-process greedy text (log-probs within LP_ATOL); ep rank r holds experts
    [r E/ep, (r+1) E/ep) of every MoE layer, so its parameters are fewer by the other ranks' experts; each token
    is dispatched once over the ep replicas (the first prefill's padded batch, 5 x 3 = 15 tokens: each tp rank's
    ceil(15 / tp), sliced over ep and padded to ep equal parts)."""
    root = str(tmp_path / "ck")
    cfg = _moe_config(kind)
    _checkpoint(root, cfg, tp=1)
    want = [_one_process(root, GREEDY, p) for p in MOE_PROMPT_SETS]
    ranks = run_distributed(_rank, tp * ep, root, tp, ep, backend=backend)
    e = cfg.num_experts
    first = MOE_PROMPT_SETS[0]  # the first prefill: its prompts padded to the longest
    per_tp = -(-len(first) * max(len(p.split()) for p in first) // tp)
    for rank, got in enumerate(ranks):
        r = got["ep_rank"]
        assert all(x == list(range(r * e // ep, (r + 1) * e // ep)) for x in got["experts"]), (rank, got["experts"])
        assert got["dispatched"] == -(-per_tp // ep), rank
        for g, w, p in zip(got["out"], want, MOE_PROMPT_SETS, strict=True):
            _assert_same(g, w, (tp, ep, rank, p))
    expert = _expert_bytes(cfg, tp) // ep
    assert all(got["expert_bytes"] == expert for got in ranks), (expert, [g["expert_bytes"] for g in ranks])
    if tp == 1:  # the rest is the one-process model's
        from omnitron.core.inference.loader import load_for_inference

        whole = sum(p.numel() * p.element_size() for p in load_for_inference(root).model.parameters())
        assert all(got["bytes"] == whole - _expert_bytes(cfg, 1) + expert for got in ranks)


def _expert_bytes(cfg, tp: int) -> int:
    """fp32 bytes of every MoE layer's experts on one tp rank, counted by hand from the config: fc1 [f or 2f, h]
    (gated: 2f) split over tp (etp = tp), fc2 [h, f / tp], and the biases where the model has them (fc1's split,
    fc2's whole)."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    f, h = cfg.moe_ffn_hidden_size, cfg.hidden_size
    fc1 = (2 if cfg.swiglu or getattr(cfg, "quick_geglu", False) else 1) * f
    per = (fc1 * h + h * f) // tp + (fc1 // tp + h if cfg.add_bias_linear else 0)
    layers = sum(1 for i in range(cfg.num_layers) if is_moe_layer(cfg, i))
    return 4 * layers * cfg.num_experts * per


@pytest.mark.slow  # 40 s on the loaded 2-core machine (2026-12-07)
def test_expert_parallel_ranks_read_only_their_experts_from_safetensors(tmp_path):
    """A gpt-oss-style checkpoint (expert biases, attention sinks, windows) exported to safetensors and served at ep2:
    the one-process tokens, and each rank reads the bytes of what it holds alone: its experts, not the other
    rank's."""
    from omnitron.core.checkpoint.reshard import export_safetensors

    from omnitron.core.transformer.shapes import padded_vocab_size

    root, file, cfg = str(tmp_path / "ck"), str(tmp_path / "m.safetensors"), _moe_config("gpt_oss")
    _checkpoint(root, cfg, tp=1)
    export_safetensors(str(tmp_path / "ck" / "iter_0000000"), file)
    want = [_one_process(root, GREEDY, p) for p in MOE_PROMPT_SETS]
    for rank, got in enumerate(run_distributed(_rank, 2, file, 1, 2)):
        for g, w, p in zip(got["out"], want, MOE_PROMPT_SETS, strict=True):
            _assert_same(g, w, ("safetensors", rank, p))
        # fp32 on disk and in memory: what it holds, it read, except the vocabulary's padding rows (301 -> 384, a
        # multiple of 128) of the embedding and the untied output layer, zeros that no file holds
        assert cfg.untie_embeddings_and_output_weights and cfg.params_dtype == torch.float32
        padding = (padded_vocab_size(cfg, 1) - cfg.vocab_size) * cfg.hidden_size * 4
        assert got["read"] == got["bytes"] - 2 * padding, rank


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_expert_layout_that_cannot_apply_is_refused_before_ranks_start(tmp_path, capsys, monkeypatch, command):
    """ep on a dense checkpoint, ep that does not divide the experts, a process count other than tp x ep x pp: one
    line and exit 2 from the command line; the launcher is never reached."""
    from omnitron.cli import main as cli
    from omnitron.core.training import launch as launch_mod

    dense, moe = str(tmp_path / "dense"), str(tmp_path / "moe")
    _checkpoint(dense)
    _checkpoint(moe, _moe_config("gpt"), tp=1)  # 4 experts
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: pytest.fail("ranks started"))
    extra = ["--prompt", "1"] if command == "generate" else []
    for flags, words in (
            (["--load", dense, "--expert-model-parallel-size", "2"],
             "--expert-model-parallel-size 2 needs an MoE model"),
            (["--load", moe, "--expert-model-parallel-size", "3"],
             "--num-experts 4 is not divisible by --expert-model-parallel-size 3"),
            (["--load", moe, "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
              "--nproc-per-node", "2"],
             "needs tensor x pipeline x expert = 2 x 1 x 2 processes, got 2; set --nproc-per-node 4"),
            (["--load", moe, "--expert-model-parallel-size", "0"], "must be >= 1, got 1, 1 and 0")):
        with pytest.raises(SystemExit) as exit_:
            cli([command, *extra, *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


def test_plan_prices_serving_at_expert_parallelism(capsys):
    """``omnitron plan --inference-max-requests`` with --expert-model-parallel-size 2 (no --nproc-per-node) prices the
    tp x ep x pp serving job: 2 of 4 experts a rank, fewer weight bytes than at ep1 by 2 experts x 4 layers x
    (fc1 [32, 64] + bias 32 + fc2 [64, 32] + bias 64) fp32 numbers."""
    from omnitron.cli import main as cli

    flags = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "48",
             "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
             "--inference-max-requests", "2", "--inference-max-seq-length", "32"]
    totals = []
    for ep in ("1", "2"):
        assert cli([*flags, "--expert-model-parallel-size", ep]) == 0
        out = capsys.readouterr().out
        assert (" ep2 " in out) == (ep == "2"), out
        totals.append(int(out.split("GiB (")[1].split(" bytes")[0]))
    assert totals[0] - totals[1] == 2 * 4 * (32 * 64 + 32 + 64 * 32 + 64) * 4


def test_plan_serving_sets_training_batch_flags_aside(capsys, tmp_path):
    """Serving runs no training step: ``--global-batch-size 1`` at ep2 (dp 2: no multiple of micro-batch x dp), a
    batch a ramp or an interleaved pipeline could not take, from the command line or a config file, give the
    estimate the run without them gives; ``omnitron plan`` for training still refuses the first."""
    import random

    from omnitron.cli import main as cli

    flags = ["plan", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"]
    serve = ["--inference-max-requests", str(random.randint(1, 6))]
    (tmp_path / "batch.yaml").write_text("micro-batch-size: 3\nglobal-batch-size: 7\n")
    outs = []
    for extra in ([], ["--global-batch-size", "1"], ["--micro-batch-size", "2", "--global-batch-size", "3"],
                  ["--rampup-batch-size", "1", "1", "8", "--global-batch-size", "4"],
                  ["--config", str(tmp_path / "batch.yaml")]):
        assert cli([*flags, *serve, *extra]) == 0, extra
        outs.append(capsys.readouterr().out)
    assert all(out == outs[0] for out in outs), outs
    pp = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    assert cli([*flags, *serve, *pp]) == 0 and cli([*flags, *serve, *pp, "--global-batch-size", "2"]) == 0
    capsys.readouterr()
    assert cli([*flags, "--nproc-per-node", "2", "--global-batch-size", "1"]) == 2  # training's plan keeps the check
    assert "--global-batch-size 1 is not a multiple" in capsys.readouterr().err


@pytest.mark.slow  # 59 s on the loaded 2-core machine (2026-12-07)
def test_server_under_expert_parallelism_answers_like_one_process(tmp_path):
    """``omnitron serve --expert-model-parallel-size 2`` on an MoE checkpoint: 2 ranks launched, each with 2 of the
    4 experts; rank 0 answers a greedy request with the one-process text, twice (the replicas still in step), and
    SIGTERM stops both."""
    from tests.inference.test_sharded_serve import _put, serving

    root = str(tmp_path / "ck")
    _checkpoint(root, _moe_config("gpt"), tp=1)
    prompts = MOE_PROMPT_SETS[0]
    want = _one_process(root, GREEDY, prompts)["text"]
    with serving(root, ["--expert-model-parallel-size", "2"], tmp_path) as port:
        greedy = {"prompts": prompts, "tokens_to_generate": 10, "temperature": 0.0}
        assert _put(port, greedy) == (200, {"text": want})
        assert _put(port, {**greedy, "prompts": prompts[:1]}) == (200, {"text": want[:1]})
