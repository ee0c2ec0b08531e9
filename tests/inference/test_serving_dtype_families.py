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
The random weights are sharpened (x3, test_families' models): their logits reach |x| ~ 10-50 and the greedy
margins vary, so the margin rule is exercised as well as the common case.
"""
from __future__ import annotations

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


def _check_row(l32, l16, n_roundings: int, first: int, a: list, b: list, lp_a: list, lp_b: list) -> tuple:
    """The margin rule on one row: ``l32`` / ``l16`` the two models' logits ``[len, V]`` of the bf16 sequence,
    ``first`` the position whose logits pick the first generated token, ``a`` / ``b`` the fp32 / bf16 tokens and
    their log-probs. Returns (max|dlogits| / (U max|logits|), whether the tokens differ)."""
    scale = float(l32.abs().max())
    bound = n_roundings * U * scale
    err = float((l32 - l16).abs().max())
    assert err <= bound, (err, bound)
    same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    if same < len(a):  # the first difference: fp32 hesitated there
        top2 = l32[first + same].topk(2).values
        assert float(top2[0] - top2[1]) <= 2 * bound, (a, b, float(top2[0] - top2[1]), bound)
    torch.testing.assert_close(torch.tensor(lp_b[:same]), torch.tensor(lp_a[:same]), rtol=0, atol=2 * bound)
    return err / (U * scale), same < len(a)


@torch.no_grad()
def test_t5_bf16_generation_against_fp32(tmp_path):
    """A T5 checkpoint (2 + 2 layers) decoded greedily in bf16: tokens, logits and log-probs by the margin rule."""
    from omnitron.core.models.t5 import T5Model
    from omnitron.core.models.t5.config import t5_tiny

    cfg = t5_tiny(num_layers=4, encoder_num_layers=2, decoder_num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  seq_length=24, decoder_seq_length=16, max_position_embeddings=24, num_query_groups=2)
    model = sharpen(T5Model(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=4))
    f32, b16 = _both(_write(model, str(tmp_path / "t5"), {"tokenizer_type": "BertWordPieceLowerCase"}))
    n = 12 * 2 + 19 * 2 + 5
    gen = torch.Generator().manual_seed(11)
    sources = [torch.randint(1000, 8000, (k,), generator=gen).tolist() for k in (5, 17, 9, 12, 3, 20)]
    want = generate_t5(f32, sources, NEW, start=101, return_log_probs=True)
    got = generate_t5(b16, sources, NEW, start=101, return_log_probs=True)
    ratios, moved = [], 0
    for src, a, b, lp_a, lp_b in zip(sources, want.tokens, got.tokens, want.log_probs, got.log_probs):
        enc, dec = torch.tensor([src]), torch.tensor([[101] + b])
        l32 = f32(enc, dec, torch.zeros_like(enc))[:, 0, :cfg.vocab_size]
        l16 = b16(enc, dec, torch.zeros_like(enc))[:, 0, :cfg.vocab_size].float()
        ratio, differs = _check_row(l32, l16, n, 0, a, b, lp_a, lp_b)
        ratios.append(ratio)
        moved += differs
    print(f"T5 bf16: max|dlogits| / (U max|logits|) = {max(ratios):.2f} (bound {n}); rows whose tokens moved: {moved}")
    assert moved < len(sources)  # at least one row's tokens all agree: the comparison is not vacuous


@torch.no_grad()
def test_llava_bf16_caption_against_fp32(tmp_path):
    """A LLaVA checkpoint (2-layer ViT, 2-layer language model) captioning in bf16: tokens, logits and log-probs
    by the margin rule."""
    model = tiny_llava()
    cfg = model.config
    f32, b16 = _both(_write(model, str(tmp_path / "mm"), {"tokenizer_type": "NullTokenizer",
                                                          "vocab_size": cfg.vocab_size - 1}))
    n = 3 + 12 * cfg.vision_num_layers + 3 + 12 * cfg.num_layers + 3
    gen = torch.Generator().manual_seed(12)
    images = torch.rand(4, 3, 16, 16, generator=gen)
    prompts = [[7], [5, 9, 11], [], [40, 2]]
    want = caption(f32, images, prompts, NEW, return_log_probs=True)
    got = caption(b16, images, prompts, NEW, return_log_probs=True)
    k, ratios, moved = num_image_tokens(cfg), [], 0
    for i, (p, a, b, lp_a, lp_b) in enumerate(zip(prompts, want.tokens, got.tokens, want.log_probs, got.log_probs)):
        seq = torch.tensor([[IMAGE_TOKEN] * k + p + b])
        l32 = f32(seq, images[i:i + 1])[:, 0, :cfg.vocab_size]
        l16 = b16(seq, images[i:i + 1])[:, 0, :cfg.vocab_size].float()
        ratio, differs = _check_row(l32, l16, n, k + len(p) - 1, a, b, lp_a[len(p):], lp_b[len(p):])
        ratios.append(ratio)
        moved += differs
    print(f"LLaVA bf16: max|dlogits| / (U max|logits|) = {max(ratios):.2f} (bound {n}); rows whose tokens moved: "
          f"{moved}")
    assert moved < len(prompts)
