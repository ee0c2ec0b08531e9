"""The serve command's request checks at their edges, without a model: the prompt count, tokens_to_generate and
logprobs as Megatron's server checks them, the body's size limit (Content-Length and chunked) and its nesting
limit, and image_index's count."""
from __future__ import annotations

import io
import json
import random
from types import SimpleNamespace

import pytest

from omnitron.core.inference.server import (MAX_DEPTH, BadRequest, _TooLarge, parse_body, parse_request,
                                            read_body)

GPT = SimpleNamespace(family="gpt", spec=SimpleNamespace(takes_images=False))


def megatron_answer(body: dict) -> int | None:
    """Megatron-LM d98e8a6's text generation server (megatron/core/inference/text_generation_server/
    text_generation_server.py, ``put``), transcribed for these fields: no prompts or more than 128 refused;
    tokens_to_generate default 64, an int >= 0; logprobs a bool, default false; 0 tokens without logprobs refused.
    Returns the tokens to generate, None where it refuses."""
    prompts = body["prompts"]
    if len(prompts) == 0 or len(prompts) > 128:
        return None
    n = body.get("tokens_to_generate", 64)
    if not isinstance(n, int) or n < 0:
        return None
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool) or (n == 0 and not logprobs):
        return None
    return n


def test_prompt_count_tokens_and_logprobs_as_megatrons_server():
    """Fresh random requests around each edge (127-129 prompts, 0 or absent tokens, logprobs absent or either
    value): accepted exactly where Megatron's server accepts, with its number of tokens."""
    rng = random.Random()
    for _ in range(300):
        body = {"prompts": ["a"] * rng.choice([1, 2, 127, 128, 129, rng.randint(1, 140)])}
        if rng.random() < 0.7:
            body["tokens_to_generate"] = rng.choice([0, 1, rng.randint(0, 100)])
        if rng.random() < 0.6:
            body["logprobs"] = rng.random() < 0.5
        want = megatron_answer(body)
        if want is None:
            with pytest.raises(BadRequest):
                parse_request(body, GPT)
        else:
            assert parse_request(body, GPT)["tokens_to_generate"] == want, body


class _Headers(dict):
    """``self.headers`` of the handler: a case-sensitive mapping is enough here."""


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def test_body_size_limit_is_inclusive_for_both_framings():
    """A body of exactly the limit is read whole, one byte more is refused (413) before it is read: with a
    Content-Length, and chunked, where the chunks only together pass the limit (random split points)."""
    rng = random.Random()
    limit = rng.randint(20, 200)
    data = bytes(rng.randrange(256) for _ in range(limit + 1))
    assert read_body(io.BytesIO(data), _Headers({"Content-Length": str(limit)}), limit) == data[:limit]
    with pytest.raises(_TooLarge):
        read_body(io.BytesIO(data), _Headers({"Content-Length": str(limit + 1)}), limit)
    for size in (limit, limit + 1):
        cuts = sorted(rng.sample(range(1, size), 3))
        parts = [data[a:b] for a, b in zip([0] + cuts, cuts + [size])]
        stream = io.BytesIO(_chunked(parts))
        headers = _Headers({"Transfer-Encoding": "chunked"})
        if size == limit:
            assert read_body(stream, headers, limit) == data[:limit]
        else:
            with pytest.raises(_TooLarge):
                read_body(stream, headers, limit)


def test_nesting_limit_is_max_depth():
    """A field nested exactly MAX_DEPTH levels (counting the body's own object) parses; one level more is refused
    naming the field."""
    for depth, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        inner = depth - 1  # the body's object is the first level
        raw = b'{"temperature": ' + b"[" * inner + b"]" * inner + b"}"
        if ok:
            assert parse_body(raw) == json.loads(raw)
        else:
            with pytest.raises(BadRequest, match="^temperature: JSON nested deeper than"):
                parse_body(raw)


def test_image_index_needs_one_index_per_prompt():
    """A multimodal checkpoint takes one image index per prompt: a list of another length is refused naming
    image_index, before any image is made."""
    loaded = SimpleNamespace(family="llava", spec=SimpleNamespace(takes_images=True))
    rng = random.Random()
    n = rng.randint(1, 5)
    for count in (n - 1, n + 1):
        with pytest.raises(BadRequest, match="^image_index must list one synthetic image index per prompt"):
            parse_request({"prompts": ["a"] * n, "image_index": list(range(count))}, loaded)
