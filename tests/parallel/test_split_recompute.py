"""The split backward (B, then W: the zero-bubble schedules) under activation recomputation.

torch's checkpoint recomputed once per autograd graph task, and W runs one task per weight boundary: under full
recomputation a GPT layer's forward ran once in B and once more for each of its six weight boundaries in W (eight
forwards a micro-batch against 1F1B's two). Now B and W share one rerun (``tensor/recompute.py``): the split runs
each layer's forward exactly as often as the unsplit backward does, and gives its gradients bit for bit (the same
operations on the same recomputed operands, each weight's gradient made by the same GEMM from the same inputs).
"""
import os
from dataclasses import replace

import pytest
import torch

from omnitron.core.models.gpt.presets import gpt2_tiny
from omnitron.core.parallel.pipeline.wgrad import backward_input
from omnitron.plan.transients import Probe, _chunk

S, B, H = 16, 2, 32

RECOMPUTE = {"full-uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "full-block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
             "selective": dict(recompute_granularity="selective")}


def _layers(chunk) -> list:
    return list(chunk.decoder.layers.values())


def _run(chunk, x, dy, split: bool, params: list) -> tuple[list[int], list[torch.Tensor]]:
    """One micro-batch through ``chunk``: forwards run per layer (a counting hook, reruns included) and the
    input and weight gradients."""
    runs = [0] * len(_layers(chunk))
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: runs.__setitem__(i, runs[i] + 1))
             for i, layer in enumerate(_layers(chunk))]
    for p in params:
        p.grad = None
    try:
        xx = x.clone().requires_grad_()
        out = chunk(hidden=xx)
        if split:
            g_in, plan = backward_input(out, dy, xx, params)
            assert not plan.fallback
            plan.run()
        else:
            out.backward(dy)
            g_in = xx.grad
    finally:
        for h in hooks:
            h.remove()
    return runs, [g_in] + [p.grad.clone() for p in params]


def _chunk_for(recompute: str, dtype: torch.dtype, **extra):
    cfg = gpt2_tiny(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=2 * H, vocab_size=64,
                    hidden_dropout=0.1, attention_dropout=0.1, params_dtype=dtype, **RECOMPUTE[recompute], **extra)
    return _chunk(Probe(cfg, 2, False, False, S, B))


def _compare(chunk, seed: int, dtype: torch.dtype, fp8_step=None, w_reruns: int = 0) -> None:
    """The split backward's gradients equal the unsplit one's bit for bit; each recomputed layer's forward runs
    as often as unsplit, ``w_reruns`` more times (in W)."""
    gen = torch.Generator().manual_seed(seed)
    x, dy = torch.randn(S, B, H, generator=gen).to(dtype), torch.randn(S, B, H, generator=gen).to(dtype)
    params = [p for p in chunk.parameters() if p.requires_grad]
    results, tracker = {}, chunk.rng_tracker
    states = tracker.get_states()
    for split in (False, True):
        torch.manual_seed(seed)  # the same dropout masks in both runs (default generator and tracker streams)
        tracker.set_states(states)
        results[split] = _run(chunk, x, dy, split, params)
        if fp8_step is not None:
            fp8_step()
    (runs, ref), (got_runs, got) = results[False], results[True]
    want = [r + w_reruns * (r > 1) for r in runs]  # a layer run more than once is recomputed
    assert got_runs == want, (seed, runs, got_runs)  # was 8 a recomputed layer (1 + 1 in B + 6 in W) against 2
    for a, b in zip(ref, got):
        assert torch.equal(a, b), seed


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_backward_reruns_each_layer_as_unsplit(recompute, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    chunk = _chunk_for(recompute, dtype)
    _compare(chunk, seed, dtype)
    runs, _ = _run(chunk, torch.zeros(S, B, H, dtype=dtype), torch.zeros(S, B, H, dtype=dtype), True,
                   [p for p in chunk.parameters() if p.requires_grad])
    recomputed = {"full-uniform": [2, 2], "full-block": [2, 1], "selective": [1, 1]}[recompute]
    assert runs == recomputed, runs  # the layer forwards of 1F1B with the same recomputation


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_split_backward_under_full_recompute_fp8(recipe):
    from omnitron.core.precision.fp8 import FP8Config
    from omnitron.core.precision.fp8.enable import enable_fp8, fp8_step

    seed = int.from_bytes(os.urandom(4), "little")
    chunk = _chunk_for("full-uniform", torch.bfloat16)
    fp8 = FP8Config(fp8_recipe=recipe, fp8_format="hybrid")
    enabled = enable_fp8(chunk, fp8, None, num_layers=4, per_step=recipe == "delayed")
    step = (lambda: fp8_step(enabled)) if recipe == "delayed" else None
    _compare(chunk, seed, torch.bfloat16, fp8_step=step)


def test_split_backward_under_full_recompute_moe():
    seed = int.from_bytes(os.urandom(4), "little")
    chunk = _chunk_for("full-uniform", torch.float32, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=H)
    _compare(chunk, seed, torch.float32)


@pytest.mark.parametrize("api, w_reruns", [("_current_autograd_node", 1), ("_current_graph_task_id", 0)])
def test_split_backward_without_private_torch_apis(monkeypatch, api, w_reruns):
    """Without the node API no read is a weight boundary's: B keeps nothing for W, which reruns each recomputed
    layer once (3 forwards against 2). Without the task API only the check for a second read is lost."""
    seed = int.from_bytes(os.urandom(4), "little")
    chunk = _chunk_for("full-block", torch.float32)
    monkeypatch.delattr(torch._C, api)
    _compare(chunk, seed, torch.float32, w_reruns=w_reruns)
