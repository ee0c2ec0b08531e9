"""The speed model's FP8 quantizations of an MoE layer (:func:`omnitron.plan.fp8.casts` over
:func:`omnitron.plan.speed.layer_gemms`) against those a real FP8 layer runs: every tensor ``FP8Linear.quantize``
is called on in one forward and backward, by its element count (each is one amax and one cast-transpose kernel;
the model prices a kernel by the elements it reads)."""
from __future__ import annotations

from collections import Counter

import torch

ARGV = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "4",
        "--max-position-embeddings", "4", "--micro-batch-size", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--swiglu",
        "--num-experts", "8", "--moe-router-topk", "1", "--moe-router-pre-softmax", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "0.01",
        "--moe-shared-expert-intermediate-size", "48"]
"""One MoE layer of 8 experts, top 1, on 4 tokens: at most 4 experts get rows, so at least 4 get none."""


def _real_quantizations() -> tuple[Counter, list[int]]:
    """({elements: how many tensors of that size the layer quantizes}, each local expert's rows) of one forward and
    backward of the 1-layer model of :data:`ARGV` (the output layer wide, as FP8 keeps it)."""
    import omnitron.core.transformer.moe.experts as experts_mod
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8.enable import enable_fp8
    from omnitron.core.precision.fp8.linear import FP8Linear
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config

    s = parse_settings(ARGV, 1)
    cfg = model_config(s)
    torch.manual_seed(0)
    m = GPTModel(cfg, ParallelGroups.single()).train()
    enable_fp8(m, s.fp8, None, num_layers=1)
    seen, rows = Counter(), []
    quantize, expert_mlp = FP8Linear.quantize, experts_mod.expert_mlp

    def counted(ex, role, x, fmt):
        seen[x.numel()] += 1
        return quantize(ex, role, x, fmt)

    def routed(mlp, x):
        rows.append(x.shape[0])
        return expert_mlp(mlp, x)

    FP8Linear.quantize, experts_mod.expert_mlp = counted, routed
    try:
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
        loss = m(tokens=tokens, position_ids=torch.arange(cfg.seq_length)[None], labels=tokens)
        loss.float().sum().backward()
    finally:
        FP8Linear.quantize, experts_mod.expert_mlp = quantize, expert_mlp
    return seen, rows


def test_moe_layer_fp8_casts_are_the_quantizations_it_runs():
    """The priced quantizations of the MoE layer at its real routing (the rows each expert got, as a histogram
    row) are the real layer's, tensor for tensor: attention's qkv and proj, the shared expert's fc1 and fc2, each
    routed expert's: input and weight forward, output gradient backward. An expert that gets no rows still runs
    its GEMMs (``expert_mlp``: their amax joins the reductions), so its weights are quantized; its empty input and
    gradient are left out on both sides (no element read: the model prices none). Before 2026-12-07 the casts of
    a GEMM with no rows were dropped whole, its weight's with them (4 of the 8 experts' fc1 and fc2 weights here;
    with a measured histogram an expert that the busiest rank hosts may get none)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import fp8
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import layer_gemms

    real, rows = _real_quantizations()
    assert len(rows) == 8 and rows.count(0) >= 4, rows  # the case this test is for
    s = parse_settings(ARGV, 1)
    cfg = model_config(s)
    share = [r / sum(rows) for r in rows]
    fwd, bwd = fp8.casts(s, layer_gemms(s, cfg, True, share))
    priced = Counter(n for op, n in fwd + bwd if op == fp8.AMAX)
    real.pop(0, None)
    assert priced == real and all(op in (fp8.AMAX, fp8.CAST) for op, _ in fwd + bwd)
    assert len(fwd + bwd) == 2 * sum(priced.values())  # an amax and a cast each
