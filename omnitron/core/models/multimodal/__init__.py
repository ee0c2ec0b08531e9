"""Multimodal (Megatron's pretrain_vlm, LLaVA): ViT encoder, MLP projector, GPT decoder over image + text."""
from omnitron.core.models.multimodal.config import (IMAGE_TOKEN, MultimodalConfig, llava_tiny, num_image_tokens,
                                                    num_parameters, validate_multimodal, vision_config)
from omnitron.core.models.multimodal.llava import LLaVAModel
from omnitron.core.models.multimodal.vision import VisionProjection, VisionTransformer, patchify

__all__ = ["IMAGE_TOKEN", "LLaVAModel", "MultimodalConfig", "VisionProjection", "VisionTransformer", "llava_tiny",
           "num_image_tokens", "num_parameters", "patchify", "validate_multimodal", "vision_config"]
