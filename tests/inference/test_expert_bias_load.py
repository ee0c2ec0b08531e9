"""A routing bias survives loading for inference: DeepSeek-V3's ``e_score_correction_bias`` (omnitron's
``--moe-router-enable-expert-bias``: the routers' ``expert_bias`` buffers) steers which experts a token reaches.
The loaders copied parameters only, so ``generate`` / ``serve`` routed with zero biases: other experts, other
tokens than the model trained or imported with.

A random sigmoid-routed MoE GPT with biases drawn N(0, 1) (as large as the sigmoid scores, so they move most
picks) is written as a torch checkpoint at pp2, converted to torch_dist and exported to safetensors; each is
loaded in one process and as the two stages of a pp2 job. Reference: the same weights and biases in a float64
one-process model, set directly. Bound: fp32 against float64 through 2 layers of GEMMs over <= 96 terms
(relative error ~ n 2**-24 ~ 6e-6 per GEMM, ~4 GEMMs per layer plus the head: ~5e-5 of max|ref|), provided
no token's top-2 pick is within that error of a tie (the scores' gaps are O(0.1) apart on random inputs, ties
have probability ~1e-4 per token); 2e-4 of max|ref| leaves 4x. A lost bias changes picks and moves the logits by
O(10%) of max|ref|: checked, so the test can fail.
"""
from __future__ import annotations

import dataclasses

import torch

from omnitron.testing.distributed import run_distributed

V = 300
IDS = [[3, 14, 15, 92, 65, 35, 8, 1], [89, 7, 9, 3, 2, 38, 44, 260]]
REL = 2e-4


def _cfg():
    from omnitron.core.models.gpt.presets import llama_tiny

    return llama_tiny(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=V + 1, seq_length=16, num_experts=8, moe_router_topk=2,
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)


def _biases(model) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")}


def _logits(model) -> torch.Tensor:
    ids = torch.tensor(IDS, device=next(model.parameters()).device)
    with torch.no_grad():
        return model(tokens=ids, position_ids=torch.arange(ids.shape[1], device=ids.device).expand_as(ids)).cpu()


def _write(root: str):
    """(torch dir, torch_dist dir, safetensors file, float64 logits with the biases, without them)."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout, convert, export_safetensors
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state, shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = _cfg()
    model = GPTModel(cfg, ParallelGroups.single(), seed=11)
    gen = torch.Generator().manual_seed(5)
    full = {n: t.clone() for n, t in gather_full_state(model, model.groups).items()}
    biases = {n: torch.randn(b.shape, generator=gen) for n, b in _biases(model).items()}
    assert len(biases) == cfg.num_layers
    write_weights_checkpoint({**full, **biases}, cfg, root + "/torch", Layout(pp=2),
                             config={"tokenizer_type": "NullTokenizer", "vocab_size": V})
    dist = convert(root + "/torch/iter_0000000", root + "/dist", Layout(pp=2), "torch_dist")
    export_safetensors(dist, root + "/m.safetensors")
    ref = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), ParallelGroups.single(), seed=0).eval()
    shard_full_state(ref, {n: t.double() for n, t in full.items()}, ref.groups)
    unbiased = _logits(ref)
    with torch.no_grad():
        for name, b in _biases(ref).items():
            b.copy_(biases[name])
    return root + "/torch", root + "/dist", root + "/m.safetensors", _logits(ref), unbiased


def _close(got: torch.Tensor, want: torch.Tensor, unbiased: torch.Tensor) -> None:
    got, want, unbiased = got.double()[..., :V + 1], want[..., :V + 1], unbiased[..., :V + 1]  # no padding rows
    scale = want.abs().max().item()
    assert (unbiased - want).abs().max().item() > 50 * REL * scale  # the biases move these logits
    assert (got - want).abs().max().item() < REL * scale


def _stage_logits(sources: list[str]) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.loader import load_sharded
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=2), backend=be)
    out = []
    for src in sources:
        loaded = load_sharded(src, groups, be)
        ids = torch.tensor(IDS, device=be.device())
        with torch.no_grad():
            logits = loaded.sharded.forward(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        out.append(None if logits is None else logits.cpu())
    return out


def test_one_process_and_pp2_loads_keep_the_routing_biases(tmp_path):
    from omnitron.backends import get_backend
    from omnitron.core.inference.loader import load_for_inference

    *sources, want, unbiased = _write(str(tmp_path))
    for src in sources:
        _close(_logits(load_for_inference(src, get_backend("cpu")).model), want, unbiased)
    last = run_distributed(_stage_logits, 2, sources)[1]
    for got in last:
        _close(got, want, unbiased)
