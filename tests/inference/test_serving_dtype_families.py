"""T5 and LLaVA served in bf16 (``omnitron generate --bf16``): a checkpoint of fp32 weights loaded at bf16, greedy
tokens and logits against the fp32 model's, by the margin rule of test_serving_dtype (tokens equal except where
fp32's top-2 margin at the first difference is within twice the logits' bound).

Bound, first order as in test_serving_dtype: bf16 rounds each weight and each stored activation (relative error
<= U = 2**-8), and each norm rescales to unit RMS, so a relative perturbation reaches the logits with gain ~1:
|dlogits| <= N U max|logits|, N the roundings on the path.
- T5: an encoder layer stores 12 tensors (test_serving_dtype's count); a decoder layer 12 + 7 for its cross-attention
  (norm, query, scores, probabilities, output, projection, residual sum; its keys and values are the encoder
  output's projections, two more), the encoder's and the decoder's embeddings and final norms and the logits: 5.
- LLaVA: the ViT's patch projection, positions and class token, final norm (3, counted generously), 12 a ViT layer,
  the projector's up-projection, activation and down-projection (3), then the language model: its embedding,
  12 a layer, the final norm and the logits (3).
Slack: the bound is the worst case, every rounding at its largest and all of one sign; the roundings are
independent and mostly cancel, so the measured error is 20-40x below it (max|dlogits| / (U max|logits|) ~ 1.5-3.5
against N = 67 and 57). The logits check therefore catches only gross errors (a weight or layer wrong, a tensor
kept in a narrower type than bf16), not a mistake of a few bf16 roundings; and 2 N U ~ 0.5, so the margin rule
accepts a moved token wherever fp32's top two logits are within about half max|logits| of each other: it
rejects a move only where fp32 was decisive. The token and log-prob comparisons carry the rest.
The random weights are sharpened (x3, test_families' models; seeds and inputs fresh, printed on failure). With
them the tokens seldom move, so test_margin_rule_at_a_planted_tie plants a near-tie (the output layer's bias set so
fp32's top two logits at the first step differ by 1e-3, in the order that bf16 then reverses): bf16's token
moves there and the rule accepts it, and on the same logits the rule rejects a move where fp32's margin is just
over twice the bound.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.reshard import Layout
from omnitron.core.inference.families import caption, generate_t5
from omnitron.core.inference.loader import load_for_inference
from omnitron.core.models.gpt.state import gather_full_state
from omnitron.core.models.multimodal.config import IMAGE_TOKEN, num_image_tokens
from omnitron.core.parallel.groups import ParallelGroups
from tests.inference.test_families import sharpen, tiny_llava

U = 2.0 ** -8  # bf16's unit roundoff (8 significand bits)
NEW = 8


def _write(model, root: str, tokenizer: dict) -> str:
    write_weights_checkpoint(gather_full_state(model, ParallelGroups.single()), model.config, root, Layout(tp=1),
                             config=tokenizer)
    return root


def _both(root: str):
    """(fp32 model, bf16 model) of the checkpoint ``root``, loaded as ``omnitron generate`` loads them."""
    f32, b16 = load_for_inference(root).model, load_for_inference(root, dtype=torch.bfloat16).model
    assert {p.dtype for p in b16.parameters()} == {torch.bfloat16}
    assert 2 * sum(p.nbytes for p in b16.parameters()) == sum(p.nbytes for p in f32.parameters())
    return f32, b16


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") >> 1


def _moved_within_margin(l32, first: int, a: list, b: list, bound: float) -> bool:
    """The margin rule: the fp32 / bf16 tokens ``a`` / ``b`` agree, or fp32's top-2 margin at their first
    difference (the logits ``l32[first + j]`` of the shared prefix) is within twice the logits' bound."""
    j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if j == len(a):
        return True
    top2 = l32[first + j].topk(2).values
    return float(top2[0] - top2[1]) <= 2 * bound


def _check_row(l32, l16, n_roundings: int, first: int, a: list, b: list, lp_a: list, lp_b: list, tag) -> tuple:
    """The margin rule on one row: ``l32`` / ``l16`` the two models' logits ``[len, V]`` of the bf16 sequence,
    ``first`` the position whose logits pick the first generated token, ``a`` / ``b`` the fp32 / bf16 tokens and
    their log-probs, ``tag`` (the seeds) for the messages. Returns (max|dlogits| / (U max|logits|), whether the
    tokens differ)."""
    scale = float(l32.abs().max())
    bound = n_roundings * U * scale
    err = float((l32 - l16).abs().max())
    assert err <= bound, (tag, err, bound)
    assert _moved_within_margin(l32, first, a, b, bound), (tag, a, b, bound)
    same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    torch.testing.assert_close(torch.tensor(lp_b[:same]), torch.tensor(lp_a[:same]), rtol=0, atol=2 * bound,
                               msg=lambda m: f"{tag}: {m}")
    return err / (U * scale), same < len(a)


def _t5(seed: int):
    from omnitron.core.models.t5 import T5Model
    from omnitron.core.models.t5.config import t5_tiny

    cfg = t5_tiny(num_layers=4, encoder_num_layers=2, decoder_num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  seq_length=24, decoder_seq_length=16, max_position_embeddings=24, num_query_groups=2)
    return sharpen(T5Model(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=seed))


T5_ROUNDINGS = 12 * 2 + 19 * 2 + 5  # the docstring's count for t5's 2 + 2 layers
T5_TOKENIZER = {"tokenizer_type": "BertWordPieceLowerCase"}


@torch.no_grad()
def test_t5_bf16_generation_against_fp32(tmp_path):
    """A T5 checkpoint (2 + 2 layers) decoded greedily in bf16: tokens, logits and log-probs by the margin rule."""
    model_seed, seed = _fresh_seed(), _fresh_seed()
    tag = {"model seed": model_seed, "seed": seed}
    model = _t5(model_seed)
    cfg, n = model.config, T5_ROUNDINGS
    f32, b16 = _both(_write(model, str(tmp_path / "t5"), T5_TOKENIZER))
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randint(1000, 8000, (k,), generator=gen).tolist() for k in (5, 17, 9, 12, 3, 20)]
    want = generate_t5(f32, sources, NEW, start=101, return_log_probs=True)
    got = generate_t5(b16, sources, NEW, start=101, return_log_probs=True)
    ratios, moved = [], 0
    for src, a, b, lp_a, lp_b in zip(sources, want.tokens, got.tokens, want.log_probs, got.log_probs):
        enc, dec = torch.tensor([src]), torch.tensor([[101] + b])
        l32 = f32(enc, dec, torch.zeros_like(enc))[:, 0, :cfg.vocab_size]
        l16 = b16(enc, dec, torch.zeros_like(enc))[:, 0, :cfg.vocab_size].float()
        ratio, differs = _check_row(l32, l16, n, 0, a, b, lp_a, lp_b, tag)
        ratios.append(ratio)
        moved += differs
    print(f"T5 bf16: max|dlogits| / (U max|logits|) = {max(ratios):.2f} (bound {n}); rows whose tokens moved: {moved}")
    assert moved < len(sources), tag  # at least one row's tokens all agree: the comparison is not vacuous


@torch.no_grad()
def test_llava_bf16_caption_against_fp32(tmp_path):
    """A LLaVA checkpoint (2-layer ViT, 2-layer language model) captioning in bf16: tokens, logits and log-probs
    by the margin rule."""
    seed = _fresh_seed()
    model = tiny_llava()  # test_families' weights (its seed); the images fresh
    cfg = model.config
    f32, b16 = _both(_write(model, str(tmp_path / "mm"), {"tokenizer_type": "NullTokenizer",
                                                          "vocab_size": cfg.vocab_size - 1}))
    n = 3 + 12 * cfg.vision_num_layers + 3 + 12 * cfg.num_layers + 3
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(4, 3, 16, 16, generator=gen)
    prompts = [[7], [5, 9, 11], [], [40, 2]]
    want = caption(f32, images, prompts, NEW, return_log_probs=True)
    got = caption(b16, images, prompts, NEW, return_log_probs=True)
    k, ratios, moved = num_image_tokens(cfg), [], 0
    for i, (p, a, b, lp_a, lp_b) in enumerate(zip(prompts, want.tokens, got.tokens, want.log_probs, got.log_probs)):
        seq = torch.tensor([[IMAGE_TOKEN] * k + p + b])
        l32 = f32(seq, images[i:i + 1])[:, 0, :cfg.vocab_size]
        l16 = b16(seq, images[i:i + 1])[:, 0, :cfg.vocab_size].float()
        ratio, differs = _check_row(l32, l16, n, k + len(p) - 1, a, b, lp_a[len(p):], lp_b[len(p):], seed)
        ratios.append(ratio)
        moved += differs
    print(f"LLaVA bf16: max|dlogits| / (U max|logits|) = {max(ratios):.2f} (bound {n}); rows whose tokens moved: "
          f"{moved}")
    assert moved < len(prompts), seed


@torch.no_grad()
def test_margin_rule_at_a_planted_tie(tmp_path):
    """A T5 whose fp32 top two logits at the first step are planted 1e-3 apart (output-layer bias) so that bf16
    picks the other: its logits within the bound and its moved tokens accepted by the rule; on the same fp32
    logits the rule rejects a move where fp32's margin is 1% over twice the bound (step 1's pick raised) and
    accepts one 1% inside."""
    model_seed, seed = _fresh_seed(), _fresh_seed()
    tag = {"model seed": model_seed, "seed": seed}
    model = _t5(model_seed)
    cfg = model.config
    src = torch.randint(1000, 8000, (9,), generator=torch.Generator().manual_seed(seed)).tolist()
    enc = torch.tensor([src])
    logits = model(enc, torch.tensor([[101]]), torch.zeros_like(enc))[0, 0, :cfg.vocab_size]
    # fp32 prefers one of the pair by 1e-3; bf16 (ulp ~ 1e-2 here) rounds the two alike (its argmax then takes the
    # lower id) or its own error favours one: one of the two orders moves the token unless a bf16 rounding
    # boundary falls between them; then the next runner-up is tried (up to fifteen: in 20 runs on 2026-12-07 the
    # first runner-up moved in 19, the second in the other, so a search finding no move is not a flake to expect)
    bias, top = model.output_layer.bias.clone(), int(logits.argmax())
    for runner, sign in [(r, s_) for r in logits.topk(16).indices.tolist()[1:] for s_ in (1, -1)]:
        model.output_layer.bias.copy_(bias)
        model.output_layer.bias[runner] += float(logits[top] - logits[runner]) + sign * 1e-3
        f32, b16 = _both(_write(model, str(tmp_path / f"t5_{runner}_{sign}"), T5_TOKENIZER))
        (a,), (b,) = (generate_t5(m, [src], NEW, start=101).tokens for m in (f32, b16))
        if a[0] != b[0]:
            break
    print(f"planted tie: tokens {a[0]} / {b[0]} (top {top}, runner-up {runner})")
    l32 = f32(enc, torch.tensor([[101] + a]), torch.zeros_like(enc))[:, 0, :cfg.vocab_size]
    l16 = b16(enc, torch.tensor([[101] + b]), torch.zeros_like(enc))[:, 0, :cfg.vocab_size].float()
    top2 = l32[0].topk(2)
    assert set(top2.indices.tolist()) == {top, runner} and a[0] != b[0], (tag, a, b)  # bf16 moved at the tie
    assert float(top2.values[0] - top2.values[1]) < 2e-3, tag
    bound = T5_ROUNDINGS * U * float(l32.abs().max())
    l32_b = f32(enc, torch.tensor([[101] + b]), torch.zeros_like(enc))[:, 0, :cfg.vocab_size]
    assert float((l32_b - l16).abs().max()) <= bound, tag
    assert _moved_within_margin(l32_b, 0, a, b, bound), (tag, a, b)  # the move at the tie: accepted
    # a decisive step 1: fp32's pick set above the rest of its row by 2 bound x (1 +- 1%), against this bound
    others = torch.cat([l32[1, :a[1]], l32[1, a[1] + 1:]]).max()
    for factor, accepted in ((1.01, False), (0.99, True)):
        wide = l32.clone()
        wide[1, a[1]] = others + factor * 2 * bound
        moved = a[:1] + [(a[1] + 1) % cfg.vocab_size] + a[2:]
        assert _moved_within_margin(wide, 0, a, moved, bound) == accepted, (tag, factor)
