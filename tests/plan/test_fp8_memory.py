"""The memory model's ``fp8`` term (:mod:`omnitron.plan.fp8_memory`), worked by hand in bytes from the layer's
weight shapes and :mod:`omnitron.core.precision.fp8.linear`'s code path: the layers ``--first-last-layers-bf16``
keeps wide hold no FP8 weight on the stage holding them; the block-wise recipe caches one FP8 byte an element and
one fp32 scale per 128x128 block; the per-tensor recipes the FP8 weight and its transpose; the delayed recipe
its amax histories."""
from __future__ import annotations

import math
import random
from contextlib import nullcontext

import pytest

from omnitron.testing.distributed import run_distributed

H, FFN = 192, 320
"""The test layer: hidden and MLP sizes off multiples of 128, so the block-wise scales' ceilings count."""
SHAPES = [(3 * H, H), (H, H), (FFN, H), (H, FFN)]
"""(out, in) of one GPT layer's linears: qkv, attention projection, fc1, fc2 (the output layer stays wide)."""


def _settings(recipe: str, pp: int = 2, wide: tuple[int, int] | None = None, history: int = 1024):
    from omnitron.commands.plan import settings_of

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 4, "micro_batch_size": 1,
             "bf16": True, "hidden_size": H, "num_attention_heads": 4, "ffn_hidden_size": FFN, "num_layers": 4,
             "layout": f"pp{pp}", "fp8_format": "e4m3" if recipe == "blockwise" else "hybrid", "fp8_recipe": recipe,
             "fp8_amax_history_len": history}
    if wide is not None:
        given |= {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": wide[0],
                  "num_layers_at_end_in_bf16": wide[1]}
    return settings_of(given)


def _stage(settings, r: int) -> int:
    from omnitron.plan.fp8_memory import fp8_bytes
    from omnitron.plan.memory import model_config

    return fp8_bytes(settings, model_config(settings), r)


def test_first_last_layers_bf16_hold_no_fp8_weight_per_stage():
    """4 layers on pp2 (two a stage), tensorwise: each FP8 linear caches its FP8 weight and transpose (2 bytes an
    element) and one fp32 scale. The first ``a`` and last ``z`` layers, kept wide, hold nothing, on whichever
    stage holds them; a random split so both stages and both ends are exercised."""
    per_layer = sum(2 * o * i + 4 for o, i in SHAPES)
    assert per_layer == 2 * (3 * 192 * 192 + 192 * 192 + 2 * 320 * 192) + 4 * 4
    assert [_stage(_settings("tensorwise"), r) for r in (0, 1)] == [2 * per_layer, 2 * per_layer]
    a, z = random.choice([(1, 0), (0, 1), (1, 2), (2, 1), (1, 1)])
    fp8_layers = [[i not in (*range(a), *range(4 - z, 4)) for i in layers] for layers in ((0, 1), (2, 3))]
    s = _settings("tensorwise", wide=(a, z))
    assert [_stage(s, r) for r in (0, 1)] == [sum(f) * per_layer for f in fp8_layers], (a, z)


def test_blockwise_caches_one_byte_and_a_scale_per_128x128_block():
    """Block-wise, pp1: one FP8 byte per weight element and one fp32 scale per 128x128 block (``ceil`` each
    way: qkv 576x192 has 5x2 blocks, fc1 320x192 3x2); no activation scale is saved (the input is saved wide)."""
    blocks = 5 * 2 + 2 * 2 + 3 * 2 + 2 * 3
    assert blocks == sum(math.ceil(o / 128) * math.ceil(i / 128) for o, i in SHAPES)
    per_layer = 3 * 192 * 192 + 192 * 192 + 2 * 320 * 192 + 4 * blocks
    assert _stage(_settings("blockwise", pp=1), 0) == 4 * per_layer


@pytest.mark.parametrize("history", [16, 1024])
def test_delayed_adds_three_amax_histories_per_linear(history):
    """Delayed, pp2: the per-tensor weight (2 bytes an element; its scale's inverse is the weight role's, in the
    state) plus, per role (input, weight, output gradient), the amax history (``--fp8-amax-history-len`` fp32) and
    three fp32 scalars (scale, its inverse, the step's amax); :func:`fp8_state_bytes` is that state alone."""
    from omnitron.plan.fp8_memory import fp8_state_bytes
    from omnitron.plan.memory import model_config

    per_layer = sum(2 * o * i + 3 * 4 * (history + 3) for o, i in SHAPES)
    s = _settings("delayed", history=history)
    assert _stage(s, 1) == 2 * per_layer
    assert fp8_state_bytes(s, model_config(s), 1) == 2 * len(SHAPES) * 3 * 4 * (history + 3)


def test_estimate_reports_the_fp8_term():
    """:func:`omnitron.plan.memory.estimate` carries the term, and without ``--fp8-format`` it is 0."""
    from dataclasses import replace

    from omnitron.plan.memory import estimate

    s = _settings("blockwise", wide=(1, 0))
    got = estimate(s, transients=False)
    assert [m.fp8 for m in got] == [_stage(s, 0), _stage(s, 1)]
    assert _stage(s, 0) * 2 == _stage(s, 1)  # stage 0 holds one FP8 layer, stage 1 two
    assert _stage(replace(s, fp8=None), 1) == 0


def _saved(cfg, layout, fp8=None, cached: dict | None = None) -> dict:
    """Saved bytes of one micro-batch through every stage chunk (tp 1, in this process), the linears in FP8 when
    ``fp8`` (an ``FP8Config``) is given, as training converts them (``per_step``; delayed: a forward after the first
    step's, the reducer primed): ``omnitron.plan.measure``'s storages seen by autograd's saved-tensor hooks,
    deduplicated, less the FP8 weights' cached transposes and scales and the delayed roles' scales (saved by each
    FP8 linear, counted by the ``fp8`` term, not here). ``cached``: filled with each chunk's bytes of cached FP8
    weights after the forward (distinct storages)."""
    import torch

    from omnitron.core.checkpoint.reshard import skeleton_chunks
    from omnitron.core.precision.fp8.enable import enable_fp8, fp8_step
    from omnitron.plan.measure import SavedBytes

    torch.manual_seed(0)
    chunks = skeleton_chunks(cfg, layout)
    s, out, hidden = cfg.seq_length, {}, None
    tokens = torch.randint(0, cfg.vocab_size, (1, s))
    for key in sorted(chunks, key=lambda k: k[1] * layout.pp + k[0]):
        m = chunks[key].train()
        ex = enable_fp8(m, fp8, None, num_layers=cfg.num_layers, per_step=True) if fp8 is not None else {}

        def forward():
            return m(tokens=tokens, position_ids=torch.arange(s)[None], hidden=hidden,
                     labels=tokens if key == (layout.pp - 1, layout.chunks - 1) else None)

        if fp8 is not None and fp8.fp8_recipe == "delayed":
            forward()
            fp8_step(ex)
        states = [st.scale_inv for e in ex.values() for st in e.states.values()]
        rec = SavedBytes([*m.parameters(), *states])
        with rec.record():
            y = forward()
        weights = [t for e in ex.values() if e._wcache is not None for t in e._wcache[2][1:]]  # (q_t, scale_inv)
        out[key] = rec.total - sum(rec.storages.get(t.untyped_storage().data_ptr(), 0) for t in weights)
        if cached is not None:
            held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for e in ex.values() if e._wcache is not None for t in e._wcache[2]}
            cached[key] = sum(held.values())
        hidden = y.detach().requires_grad_()
    return out


MLA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--multi-latent-attention", "--q-lora-rank",
       "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
       "--qk-layernorm"]
"""Multi-latent attention: its query and key-value down-projections read one input (saved once wide, twice in FP8).
With ``--qk-layernorm`` (DeepSeek's): without it the key-value up-projection reads a slice of the down-projection's
output, whose whole storage the wide linear keeps (fp8_memory's docstring: not modelled)."""


NO_DROPOUT = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--attention-dropout", "0",
              "--hidden-dropout", "0"]
"""Without attention dropout core attention runs ``scaled_dot_product_attention``'s fused path, which saves its output,
the projection's input: the wide model keeps it whatever the projection saves (``fp8_memory.kept_inputs``)."""


@pytest.mark.parametrize("recipe,recompute", [("tensorwise", []),
                                              ("tensorwise", ["--recompute-granularity", "selective"]),
                                              ("tensorwise", ["--recompute-granularity", "full", "--recompute-method",
                                                              "block", "--recompute-num-layers", "1"]),
                                              ("tensorwise", MLA), ("delayed", []), ("tensorwise", NO_DROPOUT)])
def test_per_tensor_saved_inputs_against_a_real_fp8_forward(recipe, recompute):
    """Per-tensor FP8 linears save their input's FP8 transpose (1 byte an element) and, tensorwise, a 4-byte scale
    (delayed: its input role's, held by its state) where the wide linear saved the input: what one micro-batch of a
    real FP8 forward saves (pp2, each stage chunk run in this process, the cached FP8 weights and the delayed
    states left out) is the wide forward's less :func:`saved_less` of that chunk, to the byte. Random ends kept wide;
    no recomputation, selective (core attention rerun: the linears' inputs still saved), full block 1 (the first
    layer of a stage keeps its input only), multi-latent attention (two linears reading one input: ``e - 2`` bytes
    an element less, here none), delayed after its first step, and without dropout (the projection's FP8 input
    saved beside the wide one core attention keeps: 1 byte an element more)."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import saved_less
    from omnitron.plan.memory import model_config

    wide = None if recipe == "delayed" else random.choice([None, (1, 0), (0, 1), (1, 1)])  # Megatron refuses
    # --first-last-layers-bf16 with delayed (FP8Config)
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--bf16", "--pipeline-model-parallel-size", "2",
            "--fp8-format", "hybrid", "--fp8-recipe", recipe, *recompute]
    if wide is not None:
        argv += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(wide[0]),
                 "--num-layers-at-end-in-bf16", str(wide[1])]
    s = parse_settings(argv, 2)
    cfg = model_config(s)
    plain, fp8 = _saved(cfg, Layout(pp=2)), _saved(cfg, Layout(pp=2), s.fp8)
    for r in (0, 1):
        assert plain[(r, 0)] - fp8[(r, 0)] == saved_less(s, cfg, r)[0], (r, wide, recompute)


MOE = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--num-experts", "4",
       "--moe-aux-loss-coeff", "0.01"]
"""A tiny Mixtral-style MoE layer (dropless, softmax top-k: the rows its experts see sum to ``T k`` whatever the
routing)."""


def _top1(k: int) -> list[str]:
    """Top-1 softmax routing trains only with --moe-router-pre-softmax (as Megatron requires)."""
    return ["--moe-router-pre-softmax"] if k == 1 else []


@pytest.mark.parametrize("recipe,extra", [("tensorwise", ["--bf16"]),
                                          ("tensorwise", ["--bf16", "--moe-shared-expert-intermediate-size", "32"]),
                                          ("delayed", ["--moe-shared-expert-intermediate-size", "32"])])
def test_moe_experts_saved_inputs_against_a_real_fp8_forward(recipe, extra):
    """FP8 experts (:mod:`omnitron.plan.fp8_moe`): each routed expert's fc1 saves its rows' FP8 transpose where the
    wide ones saved views of the dispatched rows, each fc2 its input's, the shared expert's two likewise; what one
    micro-batch of a real FP8 forward saves (pp2, 4 layers, all MoE, each stage chunk in this process) is the wide
    forward's less :func:`saved_less`, to the byte: bf16; with a shared expert; float32 delayed with a shared expert
    (the router keeps the shared fc1's input as it is: its FP8 copy costs ``T h + 0`` bytes more). Random top-k and
    expert width (``T k`` a multiple of the 4 experts: balanced rows sum to the real ones)."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import saved_less
    from omnitron.plan.memory import model_config

    k, f = random.choice([1, 2]), random.choice([32, 48, 64])
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--pipeline-model-parallel-size", "2", "--fp8-format", "hybrid", "--fp8-recipe", recipe, *MOE,
            "--moe-router-topk", str(k), "--moe-ffn-hidden-size", str(f), *extra, *_top1(k)]
    s = parse_settings(argv, 2)
    cfg = model_config(s)
    plain, fp8 = _saved(cfg, Layout(pp=2)), _saved(cfg, Layout(pp=2), s.fp8)
    for r in (0, 1):
        assert plain[(r, 0)] - fp8[(r, 0)] == saved_less(s, cfg, r)[0], (r, k, f)


def test_moe_grouped_gemm_experts_run_fp8_as_priced():
    """``--moe-grouped-gemm`` under FP8: the engine runs each FP8 expert's own GEMMs (the grouped GEMM takes no FP8
    seam), so a real FP8 forward with the flag (pp2, 4 MoE layers, each stage chunk in this process) caches every
    expert's FP8 weight, the stage's ``fp8`` term to the byte, and saves the per-expert wide forward's bytes (the
    one the activation term prices) less :func:`saved_less`, to the byte, as the plan runs it
    (:func:`omnitron.plan.fp8_moe.experts_as_run`). Random top-k and expert width, tensorwise bf16."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import fp8_bytes, saved_less
    from omnitron.plan.fp8_moe import experts_as_run
    from omnitron.plan.memory import model_config

    k, f = random.choice([1, 2]), random.choice([32, 48, 64])  # bf16 widths 16-byte aligned: grouped would run
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--pipeline-model-parallel-size", "2", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", *MOE,
            "--moe-router-topk", str(k), "--moe-ffn-hidden-size", str(f), "--bf16", "--moe-grouped-gemm", *_top1(k)]
    s = parse_settings(argv, 2)
    cfg = model_config(s)
    priced, cached = experts_as_run(s, cfg), {}
    plain, fp8 = _saved(priced, Layout(pp=2)), _saved(cfg, Layout(pp=2), s.fp8, cached)
    for r in (0, 1):
        assert cached[(r, 0)] == fp8_bytes(s, priced, r), (r, k, f)
        assert plain[(r, 0)] - fp8[(r, 0)] == saved_less(s, priced, r)[0], (r, k, f)


def test_moe_experts_saved_inputs_on_a_skewed_ep_rank_by_hand():
    """Under a routing histogram each ep rank's FP8 experts are priced at their rows: ep2, 4 experts of top-2 over
    ``T = 32`` tokens a rank, shares (1/2, 1/4, 1/8, 1/8): expert ``i`` receives ``T k share_i`` rows from each of the
    two ep ranks; rank 0 holds experts 0 and 1 (64 + 32 rows), rank 1 experts 2 and 3 (16 + 16). Each row saves
    ``(e - 1)`` bytes less per element of fc1's input (hidden 64) and fc2's (expert width 96), each of the rank's
    four linears one 4-byte scale more; a shared expert (width 32) on the rank's 32 tokens likewise, its fc1 adding
    its FP8 copy of the input (32 x 64) where the router keeps the wide one (in the model's dtype, the default), and
    freeing the wide 2-byte input too where the router keeps its own float32 copy (--moe-router-dtype fp32)."""
    from dataclasses import replace

    import torch

    from omnitron.core.models.gpt.config import GPTConfig
    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.plan.fp8_moe import layer_less

    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=96, swiglu=True, params_dtype=torch.bfloat16)
    share = (0.5, 0.25, 0.125, 0.125)
    tw = FP8Config(fp8_recipe="tensorwise")
    got = [layer_less(tw, cfg, 32, 1, 1, False, 2, 1, share, r) for r in (0, 1)]
    assert got == [(64 + 32) * (64 + 96) - 4 * 4, (16 + 16) * (64 + 96) - 4 * 4]
    shared = replace(cfg, moe_shared_expert_intermediate_size=32)
    assert layer_less(tw, shared, 32, 1, 1, False, 2, 1, share, 1) == got[1] - 32 * 64 + 32 * 32 - 2 * 4
    fp32_router = replace(shared, moe_router_dtype="fp32")
    assert layer_less(tw, fp32_router, 32, 1, 1, False, 2, 1, share, 1) == got[1] + 32 * (64 + 32) - 2 * 4
    assert layer_less(FP8Config(fp8_recipe="delayed"), cfg, 32, 1, 1, False, 2, 1, share, 0) == got[0] + 4 * 4
    assert layer_less(FP8Config(fp8_recipe="blockwise", fp8_format="e4m3"), cfg, 32, 1, 1, False, 2, 1, share, 0) == 0


def test_saved_inputs_under_sequence_parallelism_by_hand():
    """tp2, fp32 model (4 bytes an element: a shared input saves ``4 - 2`` bytes, not nothing), multi-latent
    attention: per layer the two down-projections share the input and, replicated, read the sequence shard under
    SP (half the tokens); the up-projections and fc1 save, in FP8, their own all-gathered input (1 byte, the whole
    sequence) where the wide ones keep the shard (4 bytes, half the tokens; since 2026-12-05); proj and fc2 their
    tp-local input; each linear one 4-byte scale. Worked from the layer's widths, with and without SP."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.fp8_memory import saved_less
    from omnitron.plan.memory import model_config

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 64,
             "seq_length": 32, "max_position_embeddings": 32, "global_batch_size": 2, "micro_batch_size": 2,
             "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96, "num_layers": 2, "layout": "tp2",
             "fp8_format": "hybrid", "fp8_recipe": "tensorwise", "normalization": "RMSNorm", "swiglu": True,
             "disable_bias_linear": True, "multi_latent_attention": True, "q_lora_rank": 32, "kv_lora_rank": 16,
             "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16, "qk_layernorm": True}
    t, e, tp = 32 * 2, 4, 2
    local = (e - 1) * t * (4 // tp * 16 + 96 // tp)  # proj, fc2
    for sp in (False, True):
        s = settings_of(given | {"sequence_parallel": sp})
        gathers = (e * t // tp - t if sp else (e - 1) * t) * (32 + 16 + 64)  # q_up, kv_up, fc1
        down = (e - 2) * 64 * (t // tp if sp else t)  # q_down and kv_down: one input
        assert saved_less(s, model_config(s), 0) == {0: 2 * (local + gathers + down - 4 * 7)}, sp


# ---- one FP8 linear's own transients, and the probe replayed with them -------------------------------------------
def _passes(recipe: str, t: int, inp: int, out: int, bias: bool = False, native: bool = False) -> tuple[int, int]:
    """(forward, backward) peak bytes one FP8 linear (weight ``[out, inp]``, bf16, no bias) creates for ``t`` tokens on
    this CPU (emulated GEMMs), measured with ``PeakTracker``, the planner's step tracker; the forward with the weight's
    FP8 form already cached, as every micro-batch after a step's first finds it; delayed as training runs it (one
    amax reduction a step), after its first step (the reducer primed); ``bias``: with a bf16 bias ``[out]``;
    ``native``: the per-tensor GEMMs through ``torch._scaled_mm`` (the provider's path set to it; it runs on CPUs too),
    the casts still the reference's."""
    from omnitron.backends import get_backend

    provider = get_backend().fp8
    assert provider.path == "emulated" and provider.block_path == "emulated", provider.describe()
    provider.path = "scaled_mm" if native else "emulated"
    try:
        return _measured(provider, recipe, t, inp, out, bias)
    finally:
        provider.path = "emulated"


def _measured(provider, recipe: str, t: int, inp: int, out: int, bias: bool) -> tuple[int, int]:
    """:func:`_passes` on ``provider`` as it is."""
    import torch

    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.core.precision.fp8.linear import FP8Linear
    from omnitron.core.precision.fp8.scaling import AmaxReducer
    from omnitron.kernels.benchmark import PeakTracker

    w = torch.randn(out, inp, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(t, inp, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(out, dtype=torch.bfloat16, requires_grad=True) if bias else None
    reducer = AmaxReducer((), None, per_step=True) if recipe == "delayed" else None
    ex = FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="e4m3" if recipe == "blockwise" else "hybrid"), provider,
                   reducer=reducer)
    if reducer is not None:  # the first step: every role's amax observed, then pushed
        ex(x, w, b).backward(torch.randn(t, out, dtype=torch.bfloat16))
        reducer.step()
    ex(x, w, b)  # caches the weight's FP8 form
    fwd, bwd = PeakTracker(), PeakTracker()
    with fwd:
        y = ex(x, w, b)
    g = torch.randn_like(y)
    with bwd:
        y.backward(g)
    return fwd.peak, bwd.peak


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_one_linear_pass_against_the_bytes_it_allocates(recipe):
    """What one FP8 linear's forward and backward create on the emulated path (the output gradient's FP8 form and
    transpose or its two block quantizations and the input's, each GEMM's fp32 operands and product, the casts' fp32
    copies, dx, dw; delayed: no new scale, the amax taken after the cast) against the bytes the tracker sees, to the
    byte (every size is an integer count of elements: nothing to round), on random shapes: any for the per-tensor
    recipes, whole 128-tiles for block-wise (ragged ones pad, not modelled)."""
    from omnitron.plan.fp8_passes import (blockwise_backward, blockwise_forward, per_tensor_backward,
                                          per_tensor_forward)

    if recipe != "blockwise":
        t, inp, out = (random.randint(16, 200) for _ in range(3))
        d = recipe == "delayed"
        want = per_tensor_forward(t, out, inp, 2, False, d), per_tensor_backward(t, out, inp, 2, 2, False, d)
    else:
        t, inp, out = (128 * random.randint(1, 3) for _ in range(3))
        want = blockwise_forward(t, out, inp, 2, False), blockwise_backward(t, out, inp, 2, 2, False)
    assert _passes(recipe, t, inp, out) == want, (t, inp, out)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_one_linear_backward_with_a_bias(recipe):
    """With a bias, the backward makes its gradient (an fp32 sum of the output gradient's rows, cast to the weight's
    dtype) after dx and before the weight-gradient GEMM, and holds it through that GEMM: the planned backward
    (``bias=True``) against the tracker's bytes, to the byte, on random shapes as above. The forward's bias add (a
    second ``y``) is not priced: only the backward is compared."""
    from omnitron.plan.fp8_passes import blockwise_backward, per_tensor_backward

    if recipe != "blockwise":
        t, inp, out = (random.randint(16, 200) for _ in range(3))
        want = per_tensor_backward(t, out, inp, 2, 2, False, recipe == "delayed", True)
    else:
        t, inp, out = (128 * random.randint(1, 3) for _ in range(3))
        want = blockwise_backward(t, out, inp, 2, 2, False, True)
    assert _passes(recipe, t, inp, out, True)[1] == want, (t, inp, out)


@pytest.mark.skipif("not __import__('omnitron.backends.fp8').backends.fp8.scaled_mm_runs('cpu')",
                    reason="torch._scaled_mm does not run on this CPU")
def test_native_forward_with_a_bias_against_the_bytes_it_allocates():
    """On the native per-tensor GEMM path (``torch._scaled_mm``, which takes no bias here) the forward adds the bias
    after the GEMM: ``y + bias`` is made beside the GEMM's ``y``, one more ``[t, out]`` at the input's dtype. Measured
    with the GEMMs through ``torch._scaled_mm`` on this CPU (the cast the reference's: its fp32 copy is its own peak
    candidate), to the byte, on random shapes in multiples of 16 (no alignment padding) with ``out >= 2 inp``, where
    the bias add is the peak: priced without it (before 2026-12-07) 28-44% under. Emulated, the GEMM's fp32 product
    (``4 t out``) beside ``y`` already exceeds the sum at bf16, so only the native path shows it."""
    from omnitron.plan.fp8_passes import per_tensor_cast, per_tensor_forward

    t, inp = 16 * random.randint(2, 8), 16 * random.randint(2, 6)
    out = 16 * random.randint(2 * inp // 16, 12)
    for bias in (False, True):
        want = max(per_tensor_cast(t, inp, False)[0], per_tensor_forward(t, out, inp, 2, True, bias=bias))
        assert _passes("tensorwise", t, inp, out, bias, native=True)[0] == want, (t, inp, out, bias)


def test_native_path_by_hand():
    """Where the device runs ``_scaled_mm`` (profiles with an ``fp8`` peak), a per-tensor linear's backward creates
    the output gradient's FP8 form and transpose (1 byte an element each) and its scale, then dx; the FP8 form goes
    once dx is made (the weight-gradient GEMM reads the transpose), then dw, no fp32 copies (peak: at dx here); its
    forward the input's FP8 form and transpose, its scale and y. The 1.3B GPT's fc1 at 8192 tokens, worked
    by hand; delayed: no new scale, and its cast (the Triton kernel's) writes one fp32 amax per 64x64 tile beside the
    FP8 tensors, then their max. Block-wise GEMMs are native only where the profile says so (the h200's: emulated)."""
    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.plan.fp8_passes import native_gemm, per_tensor_backward, per_tensor_cast, per_tensor_forward
    from omnitron.plan.profile import load

    t, out, inp = 8192, 8192, 2048
    mib = 2**20
    assert per_tensor_backward(t, out, inp, 2, 2, True) == (64 + 64) * mib + 4 + 32 * mib  # > 64 + 4 + 32 + 32
    assert per_tensor_forward(t, out, inp, 2, True) == (16 + 16) * mib + 4 + 128 * mib
    assert per_tensor_backward(t, out, inp, 2, 2, True, True) == (64 + 64) * mib + 32 * mib
    assert per_tensor_backward(1024, out, inp, 2, 2, True) == 8 * mib + 4 + 4 * mib + 32 * mib  # at dw: qg_t, dx, dw
    assert per_tensor_forward(t, out, inp, 2, True, True) == (16 + 16) * mib + 128 * mib
    assert per_tensor_cast(t, inp, True, True) == ((16 + 16) * mib + 4 * (128 * 32 + 1), (16 + 16) * mib)
    assert per_tensor_cast(100, 10, True, True)[0] == 2000 + 4 * (2 + 1)  # 2 tiles (ragged rows), their max
    tensorwise, blockwise = FP8Config(fp8_recipe="tensorwise"), FP8Config(fp8_recipe="blockwise", fp8_format="e4m3")
    h200, a100 = load("h200"), load("a100-80gb-sxm")
    assert [native_gemm(tensorwise, h200), native_gemm(blockwise, h200), native_gemm(tensorwise, a100)] == \
        [True, False, False]


@pytest.mark.parametrize("recipe,extra", [("tensorwise", []), ("tensorwise", ["--recompute-granularity", "selective"]),
                                          ("tensorwise", ["--recompute-granularity", "full", "--recompute-method",
                                                          "block", "--recompute-num-layers", "1"]),
                                          ("delayed", []), ("blockwise", []), ("tensorwise", NO_DROPOUT),
                                          ("tensorwise", MOE + ["--moe-shared-expert-intermediate-size", "32"]),
                                          ("tensorwise", MOE + ["--moe-grouped-gemm"]),
                                          pytest.param("delayed", MOE, marks=pytest.mark.slow)])
def test_replayed_probe_against_a_real_fp8_probe(recipe, extra):
    """The wide transient probe's log replayed with the FP8 linears' passes added at their markers and their saved
    inputs accounted at theirs (:func:`replay_fp8`) peaks where the same probe chunk run with its linears in FP8
    peaks, to the byte (integer byte counts replayed in the same order: nothing to round): a 2-layer chunk with the
    embedding and head; tensorwise (a random MLP width moves the peak between fc2's forward, where fc1's wide input,
    the MLP's argument, is still live beside its FP8 copy, and backward); with selective recomputation (the peak in
    the rerun attention, after the top layer's MLP backward: it holds none of those linears' saved inputs); with full
    recomputation of the lower layer (its rerun forward holds its FP8 saved inputs, which the activation term does
    not take off); delayed after its first step (no new scales; the amax taken after the cast); block-wise at whole
    128-tiles; without dropout (core attention keeps the projection's wide input); MoE layers, probed as the plan
    probes them (every expert padded to ``T k / E`` rows), their experts' FP8 passes and saved inputs included (the
    dispatched rows freed when the experts are done; the shared expert's input, which the router and the dispatch
    read too, gets its whole gradient after the experts' backward, its FP8 copy is freed when its own backward ends);
    MoE with ``--moe-grouped-gemm``, the real probe run with the flag, which its FP8 experts ignore (each runs its own
    GEMMs), the wide one as the plan runs it (:func:`omnitron.plan.fp8_moe.experts_as_run`: without the grouped GEMM,
    which marks no expert); delayed MoE (slow: three steps of the probe before the logged one)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.kernels.alloc_log import peak
    from omnitron.plan.fp8_memory import chunk_linears, replay_fp8
    from omnitron.plan.fp8_moe import experts_as_run
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe_activations import transient_probe
    from omnitron.plan.transients import Probe, _timeline

    h, f, s, b = (128, 256, 128, 1) if recipe == "blockwise" else (64, random.choice([160, 224]), 32, 2)
    argv = ["--num-layers", "2", "--hidden-size", str(h), "--num-attention-heads", "4", "--ffn-hidden-size", str(f),
            "--seq-length", str(s), "--max-position-embeddings", str(s), "--micro-batch-size", str(b), "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--bf16", "--fp8-recipe", recipe,
            "--fp8-format", "e4m3" if recipe == "blockwise" else "hybrid", *extra]
    settings = parse_settings(argv, 1)
    cfg = model_config(settings)
    priced = experts_as_run(settings, cfg)

    def probe(c):
        return Probe(transient_probe(c, c, 1, 1, 1) if c.num_experts else c, 2, True, True, s, b)

    wide = _timeline(probe(priced))
    best, _ = replay_fp8(settings, priced, wide, [float(n) for _, n in wide], chunk_linears(settings, priced, 0)[0],
                         False, 2)
    assert best == peak(_timeline(probe(cfg), settings.fp8))


FULL = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
MOE_BIAS = ["--normalization", "RMSNorm", "--swiglu", "--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
            "--moe-shared-expert-intermediate-size", "32"]
"""MoE layers with linear biases (``--add-bias-linear``, the default) and a shared expert."""


@pytest.mark.parametrize("recipe,extra,last", [("tensorwise", [], False), ("delayed", ["--disable-bias-linear"], True),
                                               ("blockwise", [], False), ("tensorwise", FULL, False),
                                               ("blockwise", FULL, True), ("tensorwise", MOE_BIAS, True)])
def test_replayed_split_probe_against_a_real_fp8_split_probe(recipe, extra, last):
    """The zero-bubble schedules' split backward (``--pipeline-schedule zb-h1``), a middle or last chunk of 2 layers
    (stage 0 runs its whole backward in W): the wide split probe replayed with the FP8 linears (:func:`replay_fp8`)
    peaks where the same probe run in FP8 peaks, to the byte. B runs each FP8 linear's output-gradient cast, dx and
    bias gradient only (priced with the weight-gradient GEMM and its block-wise input quantization before: 2.8% over
    at block-wise), keeps its 1-byte saved input for W's GEMM (freed at its backward's end before: tensorwise 4.9%
    under, 3.0% under with full recomputation, 5.3% under with MoE layers), and its one-element stand-ins come when B
    has ended. MoE layers probed as the plan probes them (:func:`omnitron.plan.moe_activations.transient_probe`)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.kernels.alloc_log import peak
    from omnitron.plan.fp8_memory import chunk_linears, replay_fp8
    from omnitron.plan.fp8_moe import experts_as_run
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe_activations import transient_probe
    from omnitron.plan.transients import Probe, _timeline

    h, f, s, b = (128, 256, 128, 1) if recipe == "blockwise" else (64, random.choice([160, 224]), 32, 2)
    argv = ["--num-layers", "2", "--hidden-size", str(h), "--num-attention-heads", "4", "--ffn-hidden-size", str(f),
            "--seq-length", str(s), "--max-position-embeddings", str(s), "--micro-batch-size", str(b), "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--bf16", "--fp8-recipe", recipe,
            "--fp8-format", "e4m3" if recipe == "blockwise" else "hybrid", "--pipeline-schedule", "zb-h1", *extra]
    settings = parse_settings(argv, 1)
    cfg = model_config(settings)
    priced = experts_as_run(settings, cfg)

    def probe(c):
        return Probe(transient_probe(c, c, 1, 1, 1) if c.num_experts else c, 2, False, last, s, b, split=True)

    wide = _timeline(probe(priced))
    best, _ = replay_fp8(settings, priced, wide, [float(n) for _, n in wide], chunk_linears(settings, priced, 0)[0],
                         False, 2)
    assert best == peak(_timeline(probe(cfg), settings.fp8))


@pytest.mark.parametrize("extra", [["--swiglu"], MOE_BIAS])
def test_bias_flags_follow_the_executor_calls(extra):
    """Whether the plan prices a linear's bias in its FP8 passes (the ``bias`` of :func:`chunk_linears`' entries, an
    MoE layer's experts' included) equals whether the FP8 executor is called with one in a forward of the probe chunk
    the plan replays: a bias ``skip_bias_add`` hands to a fused op (SwiGLU's fc1 on this CPU's kernel table), a
    routed expert's fc2 bias (added after the combine) and a row-parallel bias over tp > 1 (after the reduction) do
    not reach it. Before 2026-12-07 the entries said ``m.bias is not None`` (SwiGLU's fc1: priced with a bias it does
    not get) and an MoE layer's experts carried no bias field (the shared expert's and the experts' fc1 biases never
    priced)."""
    planned, called = _planned_and_called_biases(extra)
    assert planned == called and any(called.values())


@pytest.mark.host_only("the host's C++ SwiGLU, the fused activation the fc1 branch of gemm_bias reads")
def test_a_fused_swiglu_fc1_prices_no_bias_as_the_executor_gets_none():
    """The fc1 branch of :func:`~omnitron.plan.fp8_passes.gemm_bias` where ``fused_activation`` is True: on the
    host's kernel table (its C++ SwiGLU takes fc1's bias) every fc1 is priced without a bias in its FP8 GEMM, and
    the FP8 executor is called without one; the other linears still carry theirs (the case is not vacuous)."""
    from omnitron.backends import get_backend

    assert get_backend().kernels.resolved("swiglu") != "reference"  # the fused case, not sim's reference
    planned, called = _planned_and_called_biases(["--swiglu"])
    fc1 = [k for k in called if k[1].endswith("linear_fc1")]
    assert fc1 and not any(planned[k] or called[k] for k in fc1) and any(called.values()), (planned, called)


@pytest.mark.parametrize("extra", [["--swiglu"], MOE_BIAS, []], ids=["swiglu", "moe", "gelu"])
def test_bias_flags_follow_a_device_kernel_table(extra, reference_kernel_backend):
    """As :func:`test_bias_flags_follow_the_executor_calls` on a backend without the host's fused activation kernels
    (sim's table: its SwiGLU is the reference, which the MLP's fc1 does not hand its bias; the chunk built as the plan's
    probes build it, :func:`~omnitron.plan.measure.probing`'s pins). The plan's skeletons are built on the host's table
    (its C++ SwiGLU takes the bias), so before 2026-12-07 the fc1s of a SwiGLU model (the shared expert's and the
    routed experts' too) were priced without the bias add in the forward and the bias gradient in the backward."""
    from omnitron.plan.measure import probing

    planned, called = _planned_and_called_biases(extra, probing)
    assert planned == called and any(called.values())


def _planned_and_called_biases(extra: list[str], probe=nullcontext) -> tuple[dict, dict]:
    """({(layer from the top, name): whether the plan prices a bias in the linear's FP8 GEMM}, {the same: whether the
    FP8 executor is called with one}) of a 2-layer bf16 tensorwise model of ``extra``'s flags, one forward of the
    probe chunk built and run inside ``probe()`` (the plan's entries are made outside it, as the estimate makes
    them)."""
    import torch

    from omnitron.core.precision.fp8.enable import enable_fp8
    from omnitron.core.precision.fp8.linear import FP8Linear
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import chunk_linears
    from omnitron.plan.fp8_moe import experts_as_run
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe_activations import transient_probe
    from omnitron.plan.transients import DECODER, Probe, _chunk

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--bf16", "--fp8-recipe", "tensorwise",
            "--fp8-format", "hybrid", *extra]
    settings = parse_settings(argv, 1)
    cfg = experts_as_run(settings, model_config(settings))
    planned = {key: entry[5] for key, entry in chunk_linears(settings, cfg, 0)[0].items()}
    called, real = {}, FP8Linear.__call__

    def call(ex, x, weight, bias=None):
        d = DECODER.search(names[id(ex)])
        if d:
            called[(1 - int(d.group(1)), names[id(ex)][d.end():])] = bias is not None
        return real(ex, x, weight, bias)

    FP8Linear.__call__ = call
    try:
        with probe():
            m = _chunk(Probe(transient_probe(cfg, cfg, 1, 1, 1) if cfg.num_experts else cfg, 2, True, True, 16, 1))
            names = {id(ex): name for name, ex in enable_fp8(m, settings.fp8, None, num_layers=2,
                                                             per_step=True).items()}
            tokens = torch.randint(0, 64, (1, 16))
            m(tokens=tokens, position_ids=torch.arange(16)[None], labels=tokens)
    finally:
        FP8Linear.__call__ = real
    return planned, called


def _tp2_sp_fp8_saved(cases: list[list[str]]) -> list[tuple[int, float]]:
    """Per case: (the wide forward's saved bytes less the FP8 forward's, cached FP8 weights left out; saved_less) of
    this rank's tp2 + SP model, one micro-batch, the loss included."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8.enable import enable_fp8
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import saved_less
    from omnitron.plan.measure import SavedBytes
    from omnitron.plan.memory import model_config

    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                                  backend=get_backend())
    out = []
    for argv in cases:
        s = parse_settings(argv, 2)
        cfg, got = model_config(s), []
        for fp8 in (None, s.fp8):
            torch.manual_seed(0)
            m = GPTModel(cfg, groups).train()
            ex = enable_fp8(m, fp8, None, num_layers=cfg.num_layers) if fp8 is not None else {}
            tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length))
            rec = SavedBytes(m.parameters())
            with rec.record():
                m(tokens=tokens, position_ids=torch.arange(cfg.seq_length)[None], labels=tokens)
            weights = [t for e in ex.values() if e._wcache is not None for t in e._wcache[2][1:]]
            got.append(rec.total - sum(rec.storages.get(t.untyped_storage().data_ptr(), 0) for t in weights))
        out.append((got[0] - got[1], saved_less(s, cfg, 0)[0]))
    return out


@pytest.mark.host_only("the cpu kernel table's attention, as the other saved-input checks")
def test_saved_inputs_under_sequence_parallelism_against_a_real_tp2_forward():
    """tp2 + SP, bf16, tensorwise: the wide forward's saved bytes less the FP8 forward's equal :func:`saved_less` to the
    byte, GPT and multi-latent attention (a shared input of two replicated down-projections beside all-gathering
    up-projections). The wide column-parallel linears keep their input shard (gather_linear), the FP8 ones their own
    1-byte copy of the gathered input: priced as before 2026-12-05 (the gathered wide input taken off) the GPT case is
    13,280 B against the real 5,088."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
    for rank in run_distributed(_tp2_sp_fp8_saved, 2, [base, base + MLA]):
        for real, priced in rank:
            assert real == priced, rank
