"""Text in, text out: what ``omnitron generate`` and ``omnitron serve`` call, for every generative family.

:func:`complete` tokenizes the prompts, runs the family's batched generation and returns Megatron's
text-generation-server shape: ``text`` (prompt and generation decoded together for GPT and LLaVA, without
the end-of-document token; the decoded target for T5, whose prompt is the encoder's input), and with log-probs
``segments`` (each token as a string, the prompt's tokens then the generated ones; T5's start with ``[CLS]``, LLaVA's
with one ``"<image>"`` for all its placeholders) and ``logprobs`` (one per segment after the first); and
``warnings`` (one line) when a prompt leaves the context room for fewer tokens than asked, which it then gets.
"""
from __future__ import annotations

import json
import sys
import weakref

import numpy as np
import torch

from omnitron.core.inference.families import caption, generate_t5
from omnitron.core.inference.generation import generate_batch
from omnitron.core.inference.sampling import SamplingParams


def synthetic_image(loaded, index: int) -> tuple[torch.Tensor, str]:
    """Image ``[C, H, W]`` and true caption of sample ``index`` of the synthetic captions' validation split
    (seeded ``--seed + 1``, as training draws it; held out from the training split)."""
    from omnitron.core.data.multimodal_dataset import ImageCaptionDataset
    from omnitron.core.models.multimodal.config import num_image_tokens

    c = loaded.model.config
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise ValueError(f"image index must be an integer >= 0, got {index!r}")
    data = ImageCaptionDataset(index + 1, seq_length=c.seq_length, seed=loaded.seed + 1, tokenizer=loaded.tokenizer,
                               img_h=c.img_h, img_w=c.img_w, num_channels=c.num_channels,
                               num_image_tokens=num_image_tokens(c))
    image, text = data.sample(index)
    return torch.from_numpy(image), text


def load_image(path: str, config) -> torch.Tensor:
    """A ``.npy`` image ``[C, H, W]`` (float, values in [0, 1] as in training) checked against the model."""
    want = (config.num_channels, config.img_h, config.img_w)
    image = np.load(path)
    if image.shape != want:
        raise ValueError(f"{path}: image of shape {image.shape}; the model reads [channels, height, width] = {want}")
    return torch.from_numpy(image.astype(np.float32))


def _encode_all(tokenizer, prompts: list[str], allow_empty: bool) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in prompts]
    for i, p in enumerate(ids):
        if not p and not allow_empty:
            raise ValueError(f"prompt {i} ({prompts[i]!r}) encodes to no tokens; give some text")
    return ids


def complete(loaded, prompts: list[str], tokens_to_generate: int, *, params: SamplingParams,
             logprobs: bool = False, images: torch.Tensor | None = None, **options) -> dict:
    """Generate for every prompt (``images [b, C, H, W]`` for a family that reads images) with the family's
    own entry point (``ModelFamily.generate``); see the module docstring. ``options``: the family's own
    (GPT: ``add_bos``, ``stop_on_eol``)."""
    family = loaded.spec
    if not family.takes_images and images is not None:
        raise ValueError(f"images apply to the multimodal (LLaVA) family; this is a {loaded.family} checkpoint")
    return family.generate(loaded, prompts, tokens_to_generate, params=params, logprobs=logprobs, images=images,
                           **options)


def _result(tok, shown: list[list[int]], texts: list[str], out, logprobs: bool, lead: list[str]) -> dict:
    result = {"text": texts}
    if out.note:  # some prompts get fewer tokens than asked: the context ends first
        result["warnings"] = [out.note]
    if logprobs:
        result["segments"] = [lead + [tok.decode([t]) for t in toks] for toks in shown]
        result["logprobs"] = out.log_probs
    return result


def complete_gpt(loaded, prompts: list[str], tokens_to_generate: int, *, params: SamplingParams,
                 logprobs: bool = False, images=None, add_bos: bool = False, stop_on_eol: bool = False) -> dict:
    """GPT: continue each prompt; the text is prompt and generation decoded together (without EOD). Megatron's
    server options: ``add_bos`` puts the end-of-document token before each prompt (it conditions the model as
    a document start; the text leaves it out), ``stop_on_eol`` ends a row at a token that ends a line."""
    tok, eod = loaded.tokenizer, getattr(loaded.tokenizer, "eod", None)
    ids = _encode_all(tok, prompts, allow_empty=False)
    lead = [eod] if add_bos else []
    stops = ({eod} if eod is not None else set()) | (line_end_tokens(tok) if stop_on_eol else set())
    sharded = loaded.sharded.generate_kwargs() if loaded.sharded is not None else {}  # a tp x pp job's stage
    out = generate_batch(loaded.model, [lead + p for p in ids], tokens_to_generate, params=params,
                         eod=frozenset(stops), return_log_probs=logprobs, **sharded)
    return _result(tok, [lead + p + t for p, t in zip(ids, out.tokens)],
                   [tok.decode(p + [t for t in toks if t != eod]) for p, toks in zip(ids, out.tokens)], out, logprobs,
                   [])


_LINE_ENDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def line_end_tokens(tok) -> frozenset[int]:
    """The ids whose text holds a newline (Megatron's ``stop_on_eol`` for any vocabulary), computed once per
    tokenizer."""
    if tok not in _LINE_ENDS:
        _LINE_ENDS[tok] = frozenset(i for i in range(tok.vocab_size) if "\n" in tok.decode([i]))
    return _LINE_ENDS[tok]


def complete_t5(loaded, prompts: list[str], tokens_to_generate: int, *, params: SamplingParams,
                logprobs: bool = False, images=None) -> dict:
    """T5: decode a target for each prompt (the encoder's input); segments start with ``[CLS]``."""
    tok = loaded.tokenizer
    sources = _encode_all(tok, prompts, allow_empty=False)
    out = generate_t5(loaded.model, sources, tokens_to_generate, start=tok.cls, eod=tok.sep, params=params,
                      return_log_probs=logprobs)
    return _result(tok, [[tok.cls] + t for t in out.tokens],
                   [tok.decode([t for t in toks if t != tok.sep]) for toks in out.tokens], out, logprobs, [])


def complete_caption(loaded, prompts: list[str], tokens_to_generate: int, *, params: SamplingParams,
                     logprobs: bool = False, images: torch.Tensor | None = None) -> dict:
    """LLaVA: caption one image per prompt, continuing the prompt (may be empty); the image is one leading
    segment, ``"<image>"``, from which the first text token is scored."""
    if images is None:
        raise ValueError("the multimodal (LLaVA) family captions an image: give one image per prompt")
    tok, eod = loaded.tokenizer, getattr(loaded.tokenizer, "eod", None)
    ids = _encode_all(tok, prompts, allow_empty=True)
    out = caption(loaded.model, images, ids, tokens_to_generate, eod=eod, params=params, return_log_probs=logprobs)
    return _result(tok, [p + t for p, t in zip(ids, out.tokens)],
                   [tok.decode(p + [t for t in toks if t != eod]) for p, toks in zip(ids, out.tokens)], out, logprobs,
                   ["<image>"])


def print_result(out: dict, as_json: bool, log_probs: bool, truth: str | None) -> None:
    """The command's output: JSON (the server's response shape), or each text (and its tokens' log-probs); a
    warning (:func:`omnitron.core.inference.generation.context_note`) also goes to stderr, one line."""
    for line in out.get("warnings", ()):  # omnitron generate's output (one process, or a sharded job's rank 0)
        print(f"omnitron generate: warning: {line}", file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps(out), flush=True)
        return
    for i, text in enumerate(out["text"]):
        print(f"--- {i} ---\n{text}")
        if log_probs:
            lps = [None] + out["logprobs"][i]
            print(" ".join(f"{s!r}" + ("" if lp is None else f":{lp:.3f}") for s, lp in zip(out["segments"][i], lps)))
    if truth is not None:
        print(f"--- true caption ---\n{truth}")
    sys.stdout.flush()
