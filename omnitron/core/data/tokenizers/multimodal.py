"""Megatron's ``MultimodalTokenizer``: a Hugging Face tokenizer plus image special tokens and a chat prompt format.

As Megatron-LM at d98e8a6 (``megatron/core/tokenizers/vision/libraries/multimodal_tokenizer.py``):

* ``--tokenizer-model`` is a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``).
* ``--special-tokens`` (default ``<image>``, as Megatron's multimodal example scripts) are added as special
  tokens after the vocabulary, in order: the first new one gets the id ``len(tokenizer)``.
* ``--image-tag-type nvlm|internvl`` wraps each ``<image>`` in ``<Image>..</Image>`` / ``<img>..</img>`` before
  encoding (the tags are ordinary text unless listed in ``--special-tokens``).
* ``--tokenizer-prompt-format`` names the chat format :meth:`MultimodalTokenizer.tokenize_conversation` renders
  (:data:`PROMPT_FORMATS`) and the pad id; eod is the tokenizer's ``eos_token``.

Differences, each stated: ``encode`` adds no special tokens (omnitron's interface; :meth:`tokenize` adds the
tokenizer's own BOS as Megatron's ``tokenize`` does); ``vocab_size`` counts the added tokens (Megatron's counts
the base vocabulary only, its image ids being replaced before the embedding); ``llama3`` and ``chatml`` render
Meta's Llama 3 and the ChatML template written out here, where Megatron renders the tokenizer's own
``chat_template`` (the same text for Llama 3 and ChatML models).
"""
from __future__ import annotations

from dataclasses import dataclass

from .base import TokenizerError
from .bpe import HuggingFaceTokenizer, hf_special_token, hf_tokenizer_file

IMAGE_TOKEN = "<image>"
IGNORE_INDEX = -100
IMAGE_TAGS = {"nvlm": ("<Image>", "</Image>"), "internvl": ("<img>", "</img>"), "": None}


@dataclass(frozen=True)
class PromptFormat:
    """One chat format: how a turn renders, the assistant prefix's token count, the pad token."""

    turn: str
    """A turn's text, with ``{role}`` and ``{content}``."""
    generation: str
    """What ``add_generation_prompt`` appends (the assistant's header)."""
    assistant_prefix_len: int
    """Tokens of the assistant header masked out of the target."""
    pad: str | None
    """The pad token (None: the tokenizer's ``pad_token``); missing tokens fall back to eod."""
    bos: bool = True
    """The rendering starts with the tokenizer's ``bos_token``."""
    system: bool = True
    """A system turn is kept (else dropped, as Megatron's ``has_system_role=False``)."""
    trim: bool = False
    """Contents are stripped of surrounding whitespace (Jinja's ``| trim``)."""
    capitalize_roles: bool = False


_LLAMA3 = dict(turn="<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>",
               generation="<|start_header_id|>assistant<|end_header_id|>\n\n", assistant_prefix_len=4, trim=True)
_CHATML = dict(turn="<|im_start|>{role}\n{content}<|im_end|>\n", generation="<|im_start|>assistant\n",
               assistant_prefix_len=3, pad=None, bos=False)
PROMPT_FORMATS = {
    "llama3": PromptFormat(**_LLAMA3, pad="<|end_of_text|>"),
    "llama3p1": PromptFormat(**_LLAMA3, pad="<|finetune_right_pad_id|>"),
    "llama3p2": PromptFormat(**_LLAMA3, pad="<|finetune_right_pad_id|>"),
    "chatml": PromptFormat(**_CHATML),
    "qwen2p0": PromptFormat(**_CHATML),
    "qwen2p5": PromptFormat(**_CHATML),
    "nemotron5": PromptFormat(turn="<SPECIAL_14>{role}\n{content}<SPECIAL_15>\n", generation="<SPECIAL_14>assistant\n",
                              assistant_prefix_len=3, pad="<SPECIAL_233>"),
    "nemotron5-aligned": PromptFormat(turn="{role}\n{content}\n[PREFIX]", generation="Assistant\n",
                                      assistant_prefix_len=2, pad="<SPECIAL_233>", capitalize_roles=True),
}
"""Megatron's formats whose rendering is a plain per-turn template (mistral, nvlm-yi-34b and nemotron6-moe
depend on the tokenizer's own template or slow-tokenizer conversion and are refused)."""


class MultimodalTokenizer(HuggingFaceTokenizer):
    """A Hugging Face tokenizer with Megatron's multimodal special tokens, image tags and prompt formats."""

    name = "MultimodalTokenizer"
    _sep_is_eod = False  # Megatron's: AutoTokenizer's eos_token_id, no sep fallback

    def __init__(self, path: str, prompt_format: str | None, special_tokens=None, image_tag_type: str | None = ""):
        if prompt_format not in PROMPT_FORMATS:
            raise TokenizerError(f"--tokenizer-prompt-format {prompt_format!r}: MultimodalTokenizer renders "
                                 f"{', '.join(PROMPT_FORMATS)}; pick one")
        if (image_tag_type or "") not in IMAGE_TAGS:
            raise TokenizerError(f"--image-tag-type {image_tag_type!r}: expected nvlm, internvl or nothing")
        super().__init__(path, include_special_tokens=False)  # ``tokenize`` adds them, as Megatron's
        folder = hf_tokenizer_file(path).parent
        self.format = PROMPT_FORMATS[prompt_format]
        self.image_tag = IMAGE_TAGS[image_tag_type or ""]
        self.special = list(special_tokens) if special_tokens else [IMAGE_TOKEN]
        self._tok.add_special_tokens(self.special)
        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_text = hf_special_token(folder, "bos_token")
        pad = self.format.pad or hf_special_token(folder, "pad_token")
        pad_id = self._tok.token_to_id(pad) if pad else None
        self._pad = self._eod if pad_id is None else pad_id
        self._own_pad = pad_id

    @property
    def image_token_id(self) -> int | None:
        """``<image>``'s id (what the model's image placeholders are), if it is a token."""
        return self._tok.token_to_id(IMAGE_TOKEN)

    def apply_image_tag(self, text: str) -> str:
        """``<image>`` wrapped in the ``--image-tag-type`` tags (unchanged without one)."""
        if self.image_tag is None:
            return text
        return text.replace(IMAGE_TOKEN, f"{self.image_tag[0]}{IMAGE_TOKEN}{self.image_tag[1]}")

    def encode(self, text: str) -> list[int]:
        return super().encode(self.apply_image_tag(text))

    def tokenize(self, text: str) -> list[int]:
        """Megatron's ``tokenize`` of a string: image tags applied, the tokenizer's own special tokens added."""
        return self._tok.encode(self.apply_image_tag(text), add_special_tokens=True).ids

    def render(self, conversation: list[dict], add_generation_prompt: bool = False) -> list[str]:
        """The conversation's text, one string per turn (the first carrying the BOS), plus the generation prompt."""
        fmt = self.format
        turns = [dict(t) for t in conversation if fmt.system or t["role"] != "system"]
        out = []
        for t in turns:
            role = t["role"][:1].upper() + t["role"][1:] if fmt.capitalize_roles else t["role"]
            content = self.apply_image_tag(t["content"])
            out.append(fmt.turn.format(role=role, content=content.strip() if fmt.trim else content))
        if fmt.bos and out:
            out[0] = (self.bos_text or "") + out[0]
        if add_generation_prompt:
            out.append(fmt.generation)
        return out

    def tokenize_conversation(self, conversation: list[dict], add_generation_prompt: bool = False):
        """``(tokens, target)`` of a chat, as Megatron's: the whole rendering encoded at once; the target is the
        tokens with system and user turns and each assistant header set to ``IGNORE_INDEX`` (-100)."""
        turns = [t for t in conversation if self.format.system or t["role"] != "system"]
        pieces = self.render(turns, add_generation_prompt)
        tokens = self._tok.encode("".join(pieces), add_special_tokens=False).ids
        target, n = [], self.format.assistant_prefix_len
        for i, text in enumerate(pieces):
            ids = self._tok.encode(text, add_special_tokens=False).ids
            role = turns[i]["role"].lower() if i < len(turns) else "generation"
            if role == "assistant" and IMAGE_TOKEN in turns[i]["content"]:
                raise TokenizerError(f"{IMAGE_TOKEN} is not allowed in an assistant turn")
            if role in ("system", "user"):
                ids = [IGNORE_INDEX] * len(ids)
            elif role == "assistant":
                ids = [IGNORE_INDEX] * min(n, len(ids)) + ids[n:]
            target += ids
        if len(target) != len(tokens):
            raise TokenizerError("the conversation's turns do not encode to the whole conversation's tokens (a turn "
                                 "boundary merges into one token); Megatron refuses this conversation too")
        return tokens, target
