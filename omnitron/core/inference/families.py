"""Generation for the encoder-decoder (T5) and multimodal (LLaVA) families, on the batched GPT loop.

T5 (:func:`generate_t5`): the encoder runs ONCE over the right-padded source texts (its padding mask
hides the padding, as in training); the decoder then starts every row from ``start`` (the tokenizer's
``[CLS]``, which begins the decoder input in training) and decodes with a self-attention KV cache
while :class:`~omnitron.core.inference.kv_cache.CrossKVCache` keeps each layer's cross-attention
keys/values of the encoder output. Stops at ``eod`` (``[SEP]``, which ends a T5 target).

LLaVA (:func:`caption`): each row's prompt is its image's ``IMAGE_TOKEN`` placeholders followed by
some text (the synthetic captions begin with "a"); the prefill runs the full multimodal forward
(ViT, projector, images in place of the placeholders), later steps only the language model on the
new text token, whose keys/values join the cache of the image and prompt positions.
"""
from __future__ import annotations

import contextlib

import torch

from omnitron.core.inference.generation import Generation, context_limit, generate_batch
from omnitron.core.inference.kv_cache import CrossKVCache
from omnitron.core.inference.sampling import GREEDY, SamplingParams
from omnitron.core.models.gpt.model import GPTModel


@torch.no_grad()
def generate_t5(model, sources: list[list[int]], max_new_tokens: int, *, start: int, eod: int | None = None,
                params: SamplingParams = GREEDY, return_log_probs: bool = False,
                use_cache: bool = True) -> Generation:
    """Decode a target for each encoder input in ``sources`` (token ids); see the module docstring.
    Log-probs cover the generated tokens (the decoder prompt is ``start`` alone)."""
    limit = context_limit(model)
    for i, src in enumerate(sources):
        if not src or len(src) > limit or not all(0 <= t < model.config.vocab_size for t in src):
            raise ValueError(f"generate_t5: source {i} must hold 1 to {limit} token ids in [0, "
                             f"{model.config.vocab_size}); got {len(src)} tokens")
    if not sources:
        raise ValueError("generate_t5: give at least one source text")
    device = next(model.parameters()).device
    width = max(len(s) for s in sources)
    enc = torch.zeros(len(sources), width, dtype=torch.long, device=device)
    for i, src in enumerate(sources):
        enc[i, :len(src)] = torch.tensor(src, dtype=torch.long)
    padding = torch.arange(width, device=device)[None, :] >= torch.tensor([len(s) for s in sources],
                                                                           device=device)[:, None]  # [b, s_enc]
    was_training = model.training
    model.eval()
    try:
        # NOTE: T5Model's encoder / stack helpers; the encoder output is the decoder's fixed memory
        memory = model.encoder.final_layernorm(model._run_stack(model.encoder, model._embed(enc), padding))

        def forward(ids, pos, last=False):
            y = model._run_stack(model.decoder, model.embedding(ids, pos), memory, padding)
            y = y[-1:] if last else y  # [s or 1, b, h]: the output layer at the last position only
            logits = model.output_layer(model.decoder.final_layernorm(y), model.embedding.word_embeddings.weight)
            return model._mask_padding(logits)  # [s, b, V_pad]

        with CrossKVCache(model) if use_cache else contextlib.nullcontext():
            return generate_batch(model, [[start]] * len(sources), max_new_tokens, params=params, eod=eod,
                                  return_log_probs=return_log_probs, use_cache=use_cache, forward=forward)
    finally:
        model.train(was_training)


@torch.no_grad()
def caption(model, images: torch.Tensor, prompts: list[list[int]], max_new_tokens: int, *, eod: int | None = None,
            params: SamplingParams = GREEDY, return_log_probs: bool = False, use_cache: bool = True) -> Generation:
    """Continue ``[IMAGE_TOKEN] * n + prompt`` for each image ``images [b, C, H, W]`` and text prompt
    (token ids, may be empty); see the module docstring. Log-probs cover the text after the images."""
    from omnitron.core.models.multimodal.config import IMAGE_TOKEN, num_image_tokens

    c = model.config
    want = (len(prompts), c.num_channels, c.img_h, c.img_w)
    if images.dim() != 4 or tuple(images.shape) != want:
        raise ValueError(f"caption: images must be [batch, channels, height, width] = {want} (one per prompt, the "
                         f"model's --num-channels/--img-h/--img-w), got {tuple(images.shape)}")
    for i, p in enumerate(prompts):
        if not all(0 <= t < c.vocab_size for t in p):
            raise ValueError(f"caption: prompt {i} holds token ids outside [0, {c.vocab_size}), the vocabulary")
    n = num_image_tokens(c)
    images = images.to(next(model.parameters()).device, torch.float32)

    def forward(ids, pos, last=False):
        if bool((ids == IMAGE_TOKEN).any()):  # the prefill (or a full recompute): images in place
            return model(ids, images, position_ids=pos, last_position_only=last)
        return GPTModel.forward(model, tokens=ids, position_ids=pos, last_position_only=last)  # the language model

    return generate_batch(model, [[IMAGE_TOKEN] * n + list(p) for p in prompts], max_new_tokens, params=params,
                          eod=eod, return_log_probs=return_log_probs, use_cache=use_cache, forward=forward,
                          check_ids=False)
