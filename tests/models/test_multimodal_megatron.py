"""LLaVAModel against Megatron-LM's own LLaVAModel (CLIP ViT, MLP projector, GPT decoder; float64) through the
fixtures ``megatron_llava/make_fixtures.py`` wrote with Megatron's code: the per-token loss over the loss mask
Megatron's preprocessing made (image positions and the position before the image out), and every parameter's
gradient (its norm and its dot product with a seeded random direction), for the GeLU's two forms, RoPE and learned
positions, a frozen ViT, a frozen language model and a tied output layer; and the ViT's patch outputs against
Megatron's ``CLIPViTModel`` forward (its ``ln_pre``, bias-free ``conv1``, no final norm). The same seeded draws give
both models their weights (every parameter: the two have the same ones under the same names).

ViT tolerance: both float64; each output sums ~ 2 layers x (hv + ffn + tokens) = 2 x (24 + 40 + 7) products in
another order, ~ 150 x 1.1e-16 ~ 2e-14 relative to the largest output; bound 1e-12. Under bias-GeLU fusion
Megatron's tanh GeLU takes sqrt(2/pi) as 0.79788456 (fused_bias_gelu.py), 1.0e-9 relative off; it moves a GeLU
output by at most ~0.6e-9 relative (t sech^2 t / (1 + tanh t) <= 0.6 at t = c x (1 + 0.044715 x^2)), twice (two
layers), and a later LayerNorm can raise a relative error by |x|max / std <= sqrt(hv) ~ 5: 6e-9; bound 1e-8.

Tolerance: Megatron's loss is float64; omnitron's per-token loss is float32 (its cross entropy's output), a
relative rounding of 2**-24 ~ 6e-8 per token on losses of ~10, so 1e-6 absolute per token; the gradients come
from that float32 loss's backward (float64 after it), so the same relative 1e-6 on the gradient (its norm, and
the dot product up to |gradient error| x |direction|)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from omnitron.core.models.multimodal import LLaVAModel, MultimodalConfig
from omnitron.core.parallel.groups import ParallelGroups

FIXTURES = json.loads((pathlib.Path(__file__).parent / "megatron_llava" / "fixtures.json").read_text())


def _model(fused: bool, pos: str, frozen, tied: bool) -> LLaVAModel:
    z = FIXTURES["sizes"]
    n = (z["IMG"] // z["P"]) * (z["IMGW"] // z["P"])
    c = MultimodalConfig(num_layers=z["L"], hidden_size=z["H"], num_attention_heads=z["NH"], ffn_hidden_size=z["FF"],
                         seq_length=z["T"] - 1 + n, max_position_embeddings=z["T"] - 1 + n, vocab_size=z["V"],
                         make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                         untie_embeddings_and_output_weights=not tied, params_dtype=torch.float64,
                         position_embedding_type=pos, bias_gelu_fusion=fused, img_h=z["IMG"], img_w=z["IMGW"],
                         patch_dim=z["P"], vision_num_layers=z["LV"], vision_hidden_size=z["HV"],
                         vision_num_attention_heads=z["NH"], vision_ffn_hidden_size=z["FFV"],
                         projector_ffn_hidden_size=z["PF"], freeze_language_model=frozen == "lm",
                         freeze_vision_model=frozen == "vit")
    return LLaVAModel(c, ParallelGroups.single())


def _omnitron_layout(case: dict, n: int, pos: str):
    """Megatron's one image token per row -> omnitron's ``n`` placeholders; the labels before the image and the
    image's own positions are IMAGE_TOKEN; learned positions count the image as one, as Megatron's embedding does."""
    tokens, labels = torch.tensor(case["tokens"]), torch.tensor(case["labels"])
    b, t = tokens.shape
    ours = torch.cat([torch.full((b, n), -200), tokens[:, 1:]], 1)
    our_labels = torch.cat([torch.full((b, n - 1), -200), labels], 1)
    positions = torch.arange(t - 1 + n)[None].expand(b, -1)
    if pos == "learned_absolute":
        positions = torch.cat([torch.zeros(b, n, dtype=torch.long), torch.arange(1, t)[None].expand(b, -1)], 1)
    return ours, our_labels, positions


@pytest.mark.parametrize("name", sorted(FIXTURES["cases"]))
def test_llava_matches_megatron_llava(name):
    case, z = FIXTURES["cases"][name], FIXTURES["sizes"]
    fused, pos, frozen, tied, seed = case["case"]  # bias-GeLU fusion, positions, frozen tower, tied, seed
    model = _model(fused, pos, frozen, tied)
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key in sorted(params):
            p = params[key]
            p.copy_((torch.randn(p.numel(), generator=g, dtype=torch.float64) * 0.3 + (p.dim() == 1)).view(p.shape))
    n = (z["IMG"] // z["P"]) * (z["IMGW"] // z["P"])
    tokens, labels, positions = _omnitron_layout(case, n, pos)
    images = torch.tensor(case["images"], dtype=torch.float64).view(z["B"], 3, z["IMG"], z["IMGW"])
    vit = torch.tensor(case["vit"], dtype=torch.float64).view(z["B"], 1 + n, z["HV"])[:, 1:]  # class token dropped
    with torch.no_grad():
        ours = model.vision_model(images).transpose(0, 1)  # [b, n, hv]
    assert ((ours - vit).abs().max() / vit.abs().max()).item() < (1e-8 if fused else 1e-12)  # module docstring
    mask = torch.tensor(case["final_loss_mask"], dtype=torch.float64)
    per_token = model(tokens, images, positions, labels=labels).double() * mask
    torch.testing.assert_close(per_token, torch.tensor(case["token_loss"], dtype=torch.float64), atol=1e-6, rtol=0)
    (per_token.sum() / mask.sum()).backward()
    gd = torch.Generator().manual_seed(seed + 100)
    for key in sorted(case["grads"]):
        direction = torch.randn(params[key].numel(), generator=gd, dtype=torch.float64)
        grad, ref = params[key].grad, case["grads"][key]
        assert (grad is None) == (ref is None), key
        if grad is not None:
            norm, dot = float(grad.norm()), float(grad.flatten() @ direction)
            assert abs(norm - ref[0]) <= 1e-6 * ref[0], (key, norm, ref[0])
            # |<g - g_ref, d>| <= |g - g_ref| |d|, |d| ~ sqrt(numel): the dot's bound is the norm's relative 1e-6
            assert abs(dot - ref[1]) <= 1e-6 * ref[0] * direction.norm().item(), (key, dot, ref[1])
