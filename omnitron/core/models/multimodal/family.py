"""The multimodal (LLaVA) family's contract with the engine (see :mod:`omnitron.core.models.family`)."""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError
from omnitron.core.models.family_base import ModelFamily
from omnitron.core.models.multimodal import config as MM


def build_stage(cfg, groups, **kw):
    from omnitron.core.models.multimodal.llava import LLaVAModel

    return LLaVAModel(cfg, groups, **kw)


def forward_step(chunk, m, batch: dict, hidden):
    """One stage; per-token caption loss, masked by the default loss function."""
    return chunk(batch["tokens"], batch["images"], batch["position_ids"], labels=batch["labels"])


def build_datasets(settings, tokenizer, **sizes):
    """Synthetic image captions."""
    from omnitron.core.data.multimodal_dataset import build_multimodal_datasets

    m = settings.model
    return build_multimodal_datasets(settings.data, tokenizer, img_h=m.img_h, img_w=m.img_w,
                                     num_channels=m.num_channels, num_image_tokens=MM.num_image_tokens(m), **sizes)


def check_flags(merged: dict) -> None:
    """GPT-2 BPE captions; no sampling, no packed documents."""
    bad = [k for k in ("prompt", "reset_position_ids", "reset_attention_mask", "eod_mask_loss") if merged.get(k)]
    if bad:
        raise ConfigError(f"--{bad[0].replace('_', '-')} does not apply to --model-type multimodal (one "
                          "image-caption sample per row, no text sampling here); drop it")


def generate(loaded, prompts, tokens, **kw) -> dict:
    from omnitron.core.inference.text import complete_caption

    return complete_caption(loaded, prompts, tokens, **kw)


MULTIMODAL_FAMILY = ModelFamily(
    name="multimodal", description="multimodal (pretrain_vlm: LLaVA, ViT + projector + GPT on synthetic image "
    "captions)", config_cls=MM.MultimodalConfig, presets={"llava_tiny": MM.llava_tiny}, build_stage=build_stage,
    pipelined=False, forward_step=forward_step, build_datasets=build_datasets, num_parameters=MM.num_parameters,
    validate=MM.validate_multimodal, check_flags=check_flags, generate=generate, takes_images=True,
    synthetic_data=True, default_prompt="a")
