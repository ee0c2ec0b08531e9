"""The memory model's ``fp8`` term (:mod:`omnitron.plan.fp8_memory`), worked by hand in bytes from the layer's
weight shapes and :mod:`omnitron.core.precision.fp8.linear`'s code path: the layers ``--first-last-layers-bf16``
keeps wide hold no FP8 weight on the stage holding them; the block-wise recipe caches one FP8 byte an element and
one fp32 scale per 128x128 block; the per-tensor recipes the FP8 weight and its transpose; the delayed recipe
its amax histories."""
from __future__ import annotations

import math
import random

import pytest

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
    """Delayed, pp2: the per-tensor weight (2 bytes an element and a scale) plus, per role (input, weight, output
    gradient), the amax history (``--fp8-amax-history-len`` fp32) and three fp32 scalars (scale, its inverse,
    the step's amax)."""
    per_layer = sum(2 * o * i + 4 + 3 * 4 * (history + 3) for o, i in SHAPES)
    assert _stage(_settings("delayed", history=history), 1) == 2 * per_layer


def test_estimate_reports_the_fp8_term():
    """:func:`omnitron.plan.memory.estimate` carries the term, and without ``--fp8-format`` it is 0."""
    from dataclasses import replace

    from omnitron.plan.memory import estimate

    s = _settings("blockwise", wide=(1, 0))
    got = estimate(s, transients=False)
    assert [m.fp8 for m in got] == [_stage(s, 0), _stage(s, 1)]
    assert _stage(s, 0) * 2 == _stage(s, 1)  # stage 0 holds one FP8 layer, stage 1 two
    assert _stage(replace(s, fp8=None), 1) == 0


def _saved(cfg, layout, fp8=None) -> dict:
    """Saved bytes of one micro-batch through every stage chunk (tp 1, in this process), the linears in FP8 when
    ``fp8`` (an ``FP8Config``) is given: ``omnitron.plan.measure``'s storages seen by autograd's saved-tensor
    hooks, deduplicated; with the FP8 weights' cached transposes (saved by each FP8 linear, counted by the ``fp8``
    term, not here) also returned as ``(bytes, count)``."""
    import torch

    from omnitron.core.checkpoint.reshard import skeleton_chunks
    from omnitron.core.precision.fp8.enable import enable_fp8
    from omnitron.plan.measure import SavedBytes

    torch.manual_seed(0)
    chunks = skeleton_chunks(cfg, layout)
    s, out, hidden = cfg.seq_length, {}, None
    tokens = torch.randint(0, cfg.vocab_size, (1, s))
    for key in sorted(chunks, key=lambda k: k[1] * layout.pp + k[0]):
        m = chunks[key].train()
        ex = enable_fp8(m, fp8, None, num_layers=cfg.num_layers) if fp8 is not None else {}
        rec = SavedBytes(m.parameters())
        with rec.record():
            y = m(tokens=tokens, position_ids=torch.arange(s)[None], hidden=hidden,
                  labels=tokens if key == (layout.pp - 1, layout.chunks - 1) else None)
        weights = [e._wcache[2] for e in ex.values() if e._wcache is not None]
        cached = sum(qt.untyped_storage().nbytes() + sw.untyped_storage().nbytes() for _, qt, sw in weights
                     if qt.untyped_storage().data_ptr() in rec.storages)
        out[key] = rec.total - cached
        hidden = y.detach().requires_grad_()
    return out


MLA = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--multi-latent-attention", "--q-lora-rank",
       "32", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
       "--qk-layernorm"]
"""Multi-latent attention: its query and key-value down-projections read one input (saved once wide, twice in FP8).
With ``--qk-layernorm`` (DeepSeek's): without it the key-value up-projection reads a slice of the down-projection's
output, whose whole storage the wide linear keeps (fp8_memory's docstring: not modelled)."""


@pytest.mark.parametrize("recompute", [[], ["--recompute-granularity", "selective"],
                                       ["--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "1"], MLA])
def test_per_tensor_saved_inputs_against_a_real_fp8_forward(recompute):
    """Per-tensor FP8 linears save their input's FP8 transpose (1 byte an element) and a 4-byte scale where the
    wide linear saved the input: what one micro-batch of a real FP8 forward saves (pp2, each stage chunk run in
    this process, the cached FP8 weights left out) is the wide forward's less :func:`saved_less` of that chunk,
    to the byte. Random ends kept wide; no recomputation, selective (core attention rerun: the linears' inputs
    still saved), full block 1 (the first layer of a stage keeps its input only), and multi-latent attention (two
    linears reading one input: ``e - 2`` bytes an element less, here none)."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.fp8_memory import saved_less
    from omnitron.plan.memory import model_config

    wide = random.choice([None, (1, 0), (0, 1), (1, 1)])
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "64", "--bf16", "--pipeline-model-parallel-size", "2",
            "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", *recompute]
    if wide is not None:
        argv += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(wide[0]),
                 "--num-layers-at-end-in-bf16", str(wide[1])]
    s = parse_settings(argv, 2)
    cfg = model_config(s)
    plain, fp8 = _saved(cfg, Layout(pp=2)), _saved(cfg, Layout(pp=2), s.fp8)
    for r in (0, 1):
        assert plain[(r, 0)] - fp8[(r, 0)] == saved_less(s, cfg, r)[0], (r, wide, recompute)


def test_saved_inputs_under_sequence_parallelism_by_hand():
    """tp2, fp32 model (4 bytes an element: a shared input saves ``4 - 2`` bytes, not nothing), multi-latent
    attention: per layer the two down-projections share the input and, replicated, read the sequence shard under
    SP (half the tokens); the up-projections and fc1 save their own all-gathered input; proj and fc2 their
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
    own = (e - 1) * t * (32 + 16 + 4 // tp * 16 + 64 + 96 // tp)  # q_up, kv_up, proj, fc1, fc2
    for sp in (False, True):
        s = settings_of(given | {"sequence_parallel": sp})
        down = (e - 2) * 64 * (t // tp if sp else t)  # q_down and kv_down: one input
        assert saved_less(s, model_config(s), 0) == {0: 2 * (own + down - 4 * 7)}, sp
