"""LLaVAModel (Megatron's ``pretrain_vlm``): ViT -> projector -> image embeddings in a GPT decoder's input.

``tokens [b, s]`` hold ``n = num_image_tokens`` placeholders ``IMAGE_TOKEN`` per row (anywhere; the
synthetic captions put them first). The GPT embedding runs on the tokens (placeholders looked up as id
0, with their learned positions), then the projected patch embeddings of the row's image REPLACE the
placeholder positions, in order (no position embedding is added to them, as in Megatron's LLaVA, where
image embeddings join the already position-embedded text). The decoder then runs causally over the mixed
sequence; the loss covers text targets only: a position whose label is ``IMAGE_TOKEN`` has loss 0 (the
data's loss mask also drops it, and padding).

The class is a :class:`GPTModel` (one stage: embedding, layers, final norm, output layer, tied or not,
under the GPT names, so GPT's init, layer runner, RoPE and checkpoint tools apply) plus ``vision_model``
and ``vision_projection``. Tensor and sequence parallelism: under SP the embedding output is this rank's
sequence shard; the (replicated) image embeddings are scattered the same way before the replacement.

Freezing (``--freeze-vision-model`` / ``--freeze-language-model``): the tower's parameters get
``requires_grad = False``, so the optimizer, the data-parallel wrapper and the gradient reduction skip
them; a frozen ViT also runs without autograd. The projector always trains.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.multimodal import config as MM
from omnitron.core.models.multimodal.vision import VisionProjection, VisionTransformer
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy


class LLaVAModel(GPTModel):
    """The whole multimodal model on one pipeline stage; ``forward`` documents the tensors in and out."""

    def __init__(self, config: MM.MultimodalConfig, groups, *, backend=None, seed: int = 1234) -> None:
        MM.validate_multimodal(config, groups.config)
        super().__init__(config, groups, backend=backend, seed=seed)  # the language model (all of GPT)
        language = [p for p in self.parameters()]
        self.vision_model = VisionTransformer(config, group=groups.tp, tracker=self.rng_tracker, backend=self.backend)
        self.vision_projection = VisionProjection(config, group=groups.tp)
        self.reset_parameters(seed)  # NOTE: GPT's init ran before the vision modules existed (same values again)
        for frozen, params in ((config.freeze_language_model, language),
                               (config.freeze_vision_model, list(self.vision_model.parameters()))):
            for p in params if frozen else ():
                p.requires_grad_(False)

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """``images [b, C, H, W]`` -> projected patch embeddings ``[n, b, h]`` (replicated over tp)."""
        frozen = self.config.freeze_vision_model
        with torch.no_grad() if frozen else contextlib.nullcontext():
            features = self.vision_model(images)  # [n, b, hv]
        return self.vision_projection(features)

    def _insert_images(self, x: torch.Tensor, images: torch.Tensor, is_image: torch.Tensor) -> torch.Tensor:
        """Replace the placeholder rows of ``x [s(/tp), b, h]`` by ``images [n, b, h]``, row by row in order."""
        b, s = is_image.shape
        placed = x.new_zeros(b, s, x.shape[-1]).masked_scatter(is_image[..., None],
                                                              images.transpose(0, 1).contiguous())
        placed, mask = placed.transpose(0, 1), is_image.t()[..., None]  # [s, b, h], [s, b, 1]
        if self.sp:  # this rank's sequence shard of both (the scatter's backward gathers the gradient)
            placed, mask = M.scatter_to_sp(placed, self.groups.tp), M.split_first(mask, self.groups.tp)
        return torch.where(mask, placed, x)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, *, last_position_only: bool = False) -> torch.Tensor:
        """``tokens [b, s]`` int64 with exactly ``n`` ``IMAGE_TOKEN`` per row; ``images [b, C, H, W]``.
        ``last_position_only`` (generation, no ``labels``): the last position's logits alone, ``[1, b, V_pad/tp]``.

        Returns the per-token float32 loss ``[b, s]`` when ``labels [b, s]`` are given (0 where the label
        is ``IMAGE_TOKEN``), else the tp-local logits ``[s, b, V_pad/tp]`` with padding columns at -inf."""
        n = MM.num_image_tokens(self.config)
        is_image = tokens == MM.IMAGE_TOKEN
        counts = is_image.sum(1)
        if tokens.shape[0] != images.shape[0] or bool((counts != n).any()):
            raise ValueError(f"each row of tokens needs exactly {n} IMAGE_TOKEN ({MM.IMAGE_TOKEN}) placeholders, one "
                             f"per image patch, and one image: got {counts.tolist()} placeholders for "
                             f"{images.shape[0]} images")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embedding(tokens.masked_fill(is_image, 0), position_ids)  # [s(/tp), b, h]
        x = self._insert_images(x, self.image_embeddings(images), is_image)
        x = self._run_layers(x, self._rope_freqs(position_ids, tokens.shape[1], x.device))
        if last_position_only and labels is None:
            x = self._last_position(x)
        x = self.decoder.final_layernorm(x)
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self.output_layer(x, weight)  # [s, b, V_pad/tp]
        if labels is None:
            return self._mask_padding(logits)
        text = labels != MM.IMAGE_TOKEN
        loss = vocab_parallel_cross_entropy(logits, labels.masked_fill(~text, 0).t(), self.groups.tp,
                                            vocab_size=self.config.vocab_size, label_smoothing=self.label_smoothing,
                                            kernels=self.backend.kernels, inplace_backward=True)
        return loss.t() * text  # [b, s] float32

    def shared_embedding_parameters(self) -> list[nn.Parameter]:
        """None: one stage, the output layer uses the word embedding itself."""
        return []
