"""LLaVAModel (ViT + MLP projector + GPT decoder) against an independent plain-torch float64 model, image
placement and loss masking, frozen towers, tensor (+ sequence) parallel parity in one spawned run, config
errors, and training: a caption model that learns to read the image, and the `omnitron train` command."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.gpt import gather_full_state
from omnitron.core.models.multimodal import (IMAGE_TOKEN, LLaVAModel, MultimodalConfig, num_image_tokens,
                                             num_parameters, validate_multimodal)
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import run_distributed
from omnitron.testing.parity import assert_parity, on_groups_device, relative_error as _rel, tp_sp_parity

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=12, vocab_size=203,
            hidden_dropout=0.0, attention_dropout=0.0, img_h=8, img_w=12, patch_dim=4, num_channels=2,
            vision_num_layers=2, vision_hidden_size=24, vision_num_attention_heads=4, vision_ffn_hidden_size=40,
            projector_ffn_hidden_size=20)  # 6 image tokens
LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", num_query_groups=2,
             untie_embeddings_and_output_weights=True, add_bias_linear=False, vision_class_token=False)


def _attend(W, p, x, hq, g, causal, ln, lin, freqs=None):
    """One pre-LN layer's attention sublayer on batch-first ``x`` (fused QKV rows grouped per kv head)."""
    b, s, h = x.shape
    d = W[p + "self_attention.linear_qkv.weight"].shape[0] // (hq + 2 * g)
    qkv = lin(ln(x, p + "input_layernorm"), p + "self_attention.linear_qkv").view(b, s, g, hq // g + 2, d)
    q, k, v = qkv[..., : hq // g, :].reshape(b, s, hq, d), qkv[..., -2, :], qkv[..., -1, :]
    k, v = k.repeat_interleave(hq // g, dim=2), v.repeat_interleave(hq // g, dim=2)
    if freqs is not None:  # RoPE on channel halves
        cos, sin = freqs.cos()[None, :, None], freqs.sin()[None, :, None]
        rot = lambda t: torch.cat([t[..., :d // 2] * cos - t[..., d // 2:] * sin,  # noqa: E731
                                   t[..., d // 2:] * cos + t[..., :d // 2] * sin], -1)
        q, k = rot(q), rot(k)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return lin(torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, hq * d),
               p + "self_attention.linear_proj")


def plain_llava(W, c, tokens, images, labels, mask):
    """Batch-first float64 LLaVA from the maths: (mean masked text loss, logits [b, s, V])."""
    def lin(t, n):
        return t @ W[n + ".weight"].T + (W[n + ".bias"] if n + ".bias" in W else 0.0)

    def norm(t, n):
        if c.normalization == "RMSNorm" and not n.startswith("vision_model."):  # the ViT is CLIP-style: LayerNorm
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.layernorm_epsilon) * W[n + ".weight"]
        return F.layer_norm(t, t.shape[-1:], W[n + ".weight"], W[n + ".bias"], c.layernorm_epsilon)

    def gelu(y, biased):  # Megatron's tanh form only in its fused bias-GeLU kernel (the default), else exact
        return F.gelu(y, approximate="tanh" if c.bias_gelu_fusion and biased else "none")

    def mlp(t, p, swiglu, biased):
        y = lin(t, p + "mlp.linear_fc1")
        y = F.silu(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1] if swiglu else gelu(y, biased)
        return lin(y, p + "mlp.linear_fc2")

    # ViT: a stride-p convolution is the patch embedding
    v, hv, p = "vision_model.", c.vision_hidden_size, c.patch_dim
    kernel = W[v + "patch_embedding.weight"].reshape(hv, c.num_channels, p, p)
    x = F.conv2d(images, kernel, stride=p).flatten(2).transpose(1, 2)  # [b, n, hv]: Megatron's conv1 has no bias
    if c.vision_class_token:
        x = torch.cat([W[v + "class_token"].expand(x.shape[0], 1, hv), x], 1)
    x = norm(x + W[v + "position_embeddings.weight"], v + "ln_pre")
    for i in range(c.vision_num_layers):
        q = f"{v}decoder.layers.{i}."
        x = x + _attend(W, q, x, c.vision_num_attention_heads, c.vision_num_attention_heads, False, norm, lin)
        x = x + mlp(norm(x, q + "pre_mlp_layernorm"), q, False, True)  # the ViT's linears have biases
    x = x[:, int(c.vision_class_token):]  # no norm after the ViT's layers (Megatron's CLIP ViT)
    img = lin(gelu(lin(x, "vision_projection.linear_fc1"), True), "vision_projection.linear_fc2")  # [b, n, h]
    # language model: placeholders take the image embeddings (in order), text gets word + position embeddings
    b, s = tokens.shape
    is_img = tokens == IMAGE_TOKEN
    h = W["embedding.word_embeddings.weight"][tokens.clamp(min=0)]
    if "embedding.position_embeddings.weight" in W:
        h = h + W["embedding.position_embeddings.weight"][:s]
    h = h.clone()
    for r in range(b):
        h[r, is_img[r]] = img[r]
    freqs = None
    if c.position_embedding_type == "rope":
        d = c.hidden_size // c.num_attention_heads
        freqs = torch.arange(s, dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, d, 2).double() / d)
    for i in range(c.num_layers):
        q = f"decoder.layers.{i}."
        h = h + _attend(W, q, h, c.num_attention_heads, c.num_query_groups or c.num_attention_heads, True, norm,
                        lin, freqs)
        h = h + mlp(norm(h, q + "pre_mlp_layernorm"), q, c.swiglu, c.add_bias_linear)
    h = norm(h, "decoder.final_layernorm")
    out = W["output_layer.weight" if c.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"]
    logits = h @ out.T
    text = labels != IMAGE_TOKEN
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                                reduction="none").view(b, s) * text
    return (per_token * mask).sum() / mask.sum(), logits


def _batch(c, gen, b=3):
    """Random tokens with the image's placeholders at a different offset in each row; labels shifted."""
    s, n = c.seq_length, num_image_tokens(c)
    full = torch.randint(0, c.vocab_size, (b, s + 1), generator=gen)
    for r in range(b):
        start = [0, 3, s - n][r % 3]
        full[r, start:start + n] = IMAGE_TOKEN
    mask = (full[:, 1:] != IMAGE_TOKEN).float()
    mask[0, -1] = 0.0  # a padding-like position
    images = torch.rand(b, c.num_channels, c.img_h, c.img_w, generator=gen)
    return {"tokens": full[:, :-1], "labels": full[:, 1:], "loss_mask": mask, "images": images}


def _loss(model, batch):
    per_token = model(batch["tokens"], batch["images"], labels=batch["labels"])
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum(), per_token


@pytest.mark.parametrize("style", ["gpt2", "llama", "exact_gelu"])
def test_llava_matches_plain_float64(style):
    """exact_gelu: --no-bias-gelu-fusion turns the ViT's and the projector's GeLU exact too (Megatron copies the
    language model's config into both); the tanh form differs from erf by up to ~1e-3, far above the bounds."""
    extra = {"llama": LLAMA, "exact_gelu": dict(bias_gelu_fusion=False)}.get(style, {})
    c = MultimodalConfig(**BASE, **extra)
    groups = ParallelGroups.single()
    model = LLaVAModel(c, groups, seed=3)
    assert num_parameters(c) == sum(p.numel() for p in model.parameters())
    batch = _batch(c, torch.Generator().manual_seed(7 + len(style)))
    loss, per_token = _loss(model, batch)
    loss.backward()
    W = {k: v.double().requires_grad_() for k, v in gather_full_state(model, groups).items()}
    ref, ref_logits = plain_llava(W, c, batch["tokens"], batch["images"].double(), batch["labels"],
                                  batch["loss_mask"].double())
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < 1e-6
    assert (per_token[batch["labels"] == IMAGE_TOKEN] == 0).all()  # image targets carry no loss
    with torch.no_grad():
        logits = model(batch["tokens"], batch["images"])
    assert _rel(logits[..., :c.vocab_size].transpose(0, 1), ref_logits) < 1e-5
    grads = gather_full_state(model, groups, grads=True)
    assert grads.keys() == W.keys() and any(k.startswith("vision_model.") for k in W)
    for k, w in W.items():
        assert _rel(grads[k], w.grad) < 1e-5, k


def test_image_embeddings_land_exactly_at_the_placeholders():
    c = MultimodalConfig(**BASE)
    model = LLaVAModel(c, ParallelGroups.single(), seed=5).eval()
    batch = _batch(c, torch.Generator().manual_seed(1))
    seen = {}
    model.decoder.layers["0"].register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach()))
    with torch.no_grad():
        model(batch["tokens"], batch["images"])
        img = model.image_embeddings(batch["images"])  # [n, b, h]
        text = model.embedding(batch["tokens"].clamp(min=0), torch.arange(c.seq_length).expand_as(batch["tokens"]))
    x, is_img = seen["x"], batch["tokens"] == IMAGE_TOKEN  # [s, b, h], [b, s]
    for r in range(batch["tokens"].shape[0]):
        assert torch.equal(x[is_img[r], r], img[:, r])  # in order, unchanged (no position added)
        assert torch.equal(x[~is_img[r], r], text[~is_img[r], r])
    with pytest.raises(ValueError, match="exactly 6 IMAGE_TOKEN"):
        model(batch["tokens"].clamp(min=0), batch["images"])
    with pytest.raises(ValueError, match="--img-h"):
        model(batch["tokens"], batch["images"][..., :8])


def test_loss_ignores_image_positions_but_sees_the_image():
    c = MultimodalConfig(**BASE)
    model = LLaVAModel(c, ParallelGroups.single(), seed=2).eval()
    batch = _batch(c, torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(batch["tokens"], batch["images"], labels=batch["labels"])
        other = model(batch["tokens"], batch["images"] + 0.5, labels=batch["labels"])
    image_target = batch["labels"] == IMAGE_TOKEN
    assert image_target.any() and (a[image_target] == 0).all() and (a[~image_target] > 0).all()
    after = torch.zeros_like(image_target)  # text positions at or after a row's first image position
    after |= (batch["tokens"] == IMAGE_TOKEN).long().cumsum(1) > 0
    changed = (a - other).abs() > 1e-6
    assert changed[after & ~image_target].any() and not changed[~after].any()  # causal: earlier text unaffected


def _step(model, batch):
    from omnitron.backends import get_backend
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import MixedPrecisionOptimizer

    groups = ParallelGroups.single()
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), OptimizerConfig(lr=1e-2), groups,
                                  backend=get_backend("cpu"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _loss(model, batch)[0].backward()
    opt.step(1e-2)
    return opt, {n: not torch.equal(before[n], p) for n, p in model.named_parameters()}


@pytest.mark.parametrize("tower", ["vision", "language"])
def test_frozen_tower_gets_no_gradient_and_no_update(tower):
    c = MultimodalConfig(**BASE, **{f"freeze_{tower}_model": True})
    model = LLaVAModel(c, ParallelGroups.single(), seed=6)
    batch = _batch(c, torch.Generator().manual_seed(2))
    opt, moved = _step(model, batch)
    in_vision = lambda n: n.startswith("vision_model.")  # noqa: E731
    frozen = {n for n in moved if (in_vision(n) if tower == "vision" else not in_vision(n)
                                   and not n.startswith("vision_projection."))}
    assert frozen and all(model.get_parameter(n).grad is None and not moved[n] for n in frozen)
    assert set(opt.names) == set(moved) - frozen  # the optimizer holds the trainable ones only
    assert all(moved[n] for n in moved if n.startswith("vision_projection.") and n.endswith("weight"))
    assert sum(moved[n] for n in set(moved) - frozen) > len(set(moved) - frozen) // 2


# ---- tensor / sequence parallel parity (one spawn) ----------------------------------------------
def _parity_step(c, g):
    from omnitron.core.models.gpt import allreduce_sequence_parallel_grads

    batch = _batch(c, torch.Generator().manual_seed(4))
    batch["images"] = batch["images"].to(c.params_dtype)  # tp_sp_parity runs a float64 model
    model = LLaVAModel(c, g, seed=8)
    model, batch = on_groups_device(g, model, batch)  # the backend under test (the host for one process)
    loss, per_token = _loss(model, batch)
    loss.backward()
    allreduce_sequence_parallel_grads(model, g)
    return {"loss": loss, "token_loss": per_token, "grads": gather_full_state(model, g, grads=True)}


def _parity_worker(tp: int) -> dict:
    cfgs = {"gpt2": MultimodalConfig(**{**BASE, "vocab_size": 251, "make_vocab_size_divisible_by": 1}),
            "llama": MultimodalConfig(**BASE, **LLAMA)}
    return tp_sp_parity(tp, cfgs, _parity_step)


def test_tensor_and_sequence_parallel_parity_tp2():
    results = run_distributed(_parity_worker, 2, 2)
    assert all(len(r) == 4 for r in results)
    assert_parity(results)


def test_bad_settings_name_the_flag():
    c = MultimodalConfig(**BASE)
    for parallel, flag in ((ParallelConfig(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size"),
                           (ParallelConfig(context_parallel_size=2), "--context-parallel-size"),
                           (ParallelConfig(tensor_model_parallel_size=8), "--num-attention-heads")):
        with pytest.raises(ConfigError, match=flag):
            validate_multimodal(c, parallel)
    with pytest.raises(ConfigError, match="--vision-num-attention-heads 3"):
        validate_multimodal(dataclasses.replace(c, vision_num_attention_heads=3, vision_hidden_size=24),
                            ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError, match="--seq-length 6 leaves no room"):
        validate_multimodal(dataclasses.replace(c, seq_length=6), ParallelConfig())
    with pytest.raises(ConfigError, match="--img-w 10 is not a multiple of --patch-dim 4"):
        MultimodalConfig(**{**BASE, "img_w": 10})
    with pytest.raises(ConfigError, match="--vision-num-layers"):
        MultimodalConfig(**{**BASE, "vision_num_layers": 0})


# ---- training ---------------------------------------------------------------------------------------
class _Words:
    """A word-level tokenizer over the caption vocabulary (a small output layer: a fast CPU run)."""

    def __init__(self):
        from omnitron.core.data.multimodal_dataset import COLOURS, POSITIONS, SHAPES

        words = ["a", "at", "the", *COLOURS, *SHAPES, *{w for p in POSITIONS for w in p.split()}]
        self.ids = {w: i for i, w in enumerate(sorted(words))}
        self.eod = self.pad = self.vocab_size = len(self.ids)
        self.vocab_size += 1

    def encode(self, text):
        return [self.ids[w] for w in text.split()]


@pytest.fixture
def one_thread():
    """Tiny GEMMs: more threads only contend on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_caption_model_learns_to_read_the_image(one_thread):
    """250 AdamW steps from scratch: the held-out caption loss ends well below the best loss WITHOUT the
    image (every caption equally likely: log(6 colours x 3 shapes x 4 quadrants) over 7 targets) and the
    colour word is read from the pixels."""
    torch.manual_seed(0)
    loss, accuracy = _train_captions()
    text_only_floor = math.log(6 * 3 * 4) / 7
    assert loss < 0.85 * text_only_floor, loss
    assert accuracy > 0.9  # chance: 1/6


def _train_captions() -> tuple[float, float]:
    """(held-out loss, colour accuracy) after training a small LLaVA on word-level captions."""
    from omnitron.core.data.multimodal_dataset import ImageCaptionDataset

    tok = _Words()
    c = MultimodalConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=16,
                         vocab_size=tok.vocab_size, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                         attention_dropout=0.0, img_h=32, img_w=32, patch_dim=16)  # 4 image tokens
    kw = dict(seq_length=16, tokenizer=tok, img_h=32, img_w=32, num_channels=3, num_image_tokens=4)
    steps, bs = 250, 32
    train = ImageCaptionDataset(steps * bs, seed=1, **kw)
    valid = ImageCaptionDataset(256, seed=2, **kw)
    stack = lambda items: {k: torch.stack([it[k] for it in items]) for k in items[0]}  # noqa: E731
    model = LLaVAModel(c, ParallelGroups.single(), seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    vb = stack([valid[i] for i in range(len(valid))])
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = 1e-3 * min(1.0, (step + 1) / 10)
        opt.zero_grad()
        _loss(model, stack([train[step * bs + i] for i in range(bs)]))[0].backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        loss = _loss(model, vb)[0].item()
        colour = model(vb["tokens"], vb["images"]).argmax(-1).t()[:, 4]  # position of "a": predicts the colour
    return loss, (colour == vb["labels"][:, 4]).float().mean().item()


def test_train_command_multimodal(tmp_path, one_thread):
    """`omnitron train --model llava_tiny` (GPT-2 BPE captions) through the real loop, optimizer and
    checkpointing: the loss falls from uniform over the GPT-2 vocabulary to well below the captions'
    unigram entropy; with --freeze-vision-model the checkpoint holds no optimizer state for the ViT and
    converts offline to tp2 with identical weights."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.reshard import Layout, convert, read_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.manual_seed(0)
    args = ["--model", "llava_tiny", "--patch-dim", "16", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "8", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0",
            "--log-interval", "10", "--no-tensorboard", "--log-dir", str(tmp_path / "logs"), "--eval-interval", "40",
            "--eval-iters", "1"]
    s = parse_settings(args + ["--train-iters", "40", "--lr-warmup-iters", "3", "--save", str(tmp_path / "ck")],
                       world_size=1)
    assert s.model_type == "multimodal" and isinstance(s.model, MultimodalConfig)
    losses = train(s, get_backend("cpu"))["losses"]
    losses = [losses[i] for i in sorted(losses)]
    # unigram entropy of the 7 targets: "at", "the", eod 1/7 each; 6 colours, 3 shapes, 2 x 2 quadrant words
    unigram = 3 / 7 * math.log(7) + 6 / 42 * math.log(42) + 3 / 21 * math.log(21) + 4 / 14 * math.log(14)
    assert losses[0] > 0.9 * math.log(50257) and sum(losses[-5:]) / 5 < unigram / 2, losses
    s = parse_settings(args + ["--train-iters", "2", "--lr-warmup-iters", "1", "--freeze-vision-model", "--save",
                               str(tmp_path / "fz")], world_size=1)  # a warm-up shorter than the run (Megatron's rule)
    train(s, get_backend("cpu"))
    src = sorted((tmp_path / "fz").glob("iter_*"))[-1]
    full = read_full_state(str(src))
    assert any(k.startswith("vision_model.") for k in full.model)
    assert not any(k.startswith("vision_model.") for k in full.optimizer["exp_avg"])
    assert any(k.startswith("vision_projection.") for k in full.optimizer["exp_avg"])
    tp2 = read_full_state(convert(str(src), str(tmp_path / "tp2"), Layout(tp=2)))
    assert tp2.model.keys() == full.model.keys() and all(torch.equal(tp2.model[k], full.model[k]) for k in full.model)


def test_train_settings_errors():
    from omnitron.core.training.arguments import parse_settings

    base = ["--model", "llava_tiny"]
    for extra, message in ((["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2: the multi"),
                           (["--prompt", "hi"], "--prompt does not apply"),
                           (["--reset-attention-mask"], "--reset-attention-mask does not apply")):
        with pytest.raises(ConfigError, match=message):
            parse_settings(base + extra, world_size=2)
    with pytest.raises(ConfigError, match="add --model-type multimodal"):
        parse_settings(["--model", "gpt2_tiny", "--img-h", "64"], world_size=1)
    # sizes the synthetic samples cannot take: one line from the launcher's checks, before any worker builds a model
    from omnitron.core.training.datacheck import check_tokenizer_and_data

    for extra, message in ((["--num-channels", "1"], "--num-channels 1: the synthetic image-caption data draws RGB"),
                           (["--img-h", "8", "--img-w", "8", "--patch-dim", "8"], "at least 16 x 16 pixels"),
                           (["--seq-length", "18", "--max-position-embeddings", "18"], "use --seq-length >= ")):
        with pytest.raises(ConfigError, match=message):
            check_tokenizer_and_data(parse_settings(base + extra, world_size=1))
    check_tokenizer_and_data(parse_settings(base, world_size=1))
    # LLaVA's launch-script spellings of the tower switches; Megatron's --disable-vision-class-token keeps the
    # class token in the ViT and drops its output before the projector: omnitron's own (and only) handling of it
    mega = parse_settings(base + ["--freeze-LM", "--freeze-ViT", "--disable-vision-class-token"], world_size=1).model
    own = parse_settings(base + ["--freeze-language-model", "--freeze-vision-model"], world_size=1).model
    assert mega == own and mega.freeze_language_model and mega.freeze_vision_model and mega.vision_class_token
    with pytest.raises(ConfigError, match="--disable-vision-class-token means --vision-class-token True"):
        parse_settings(base + ["--disable-vision-class-token", "--no-vision-class-token"], world_size=1)
