"""Batched generation with a KV cache: prompts of different lengths at once, on one process.

Prompts are LEFT-padded to the longest, so every row appends its next token at the same cache slot
and one forward of ``[b, 1]`` tokens advances the whole batch. Each row keeps its own positions
(counted from its first real token) and the cache's validity mask hides its padding slots (see
:mod:`omnitron.core.inference.kv_cache`), so a row's logits equal those of the prompt run alone.
A row stops at ``eod`` or when its next position would pass the model's context; the batch stops
when every row has. ``use_cache=False`` recomputes the whole padded sequence every step (the same
masks, no cache): the slow reference.

Log-probs (``return_log_probs``, Megatron's ``--return-log-probs``) are the model's own ``log_softmax``
of the raw logits (before temperature / top-k / top-p; in float32, or in the logits' dtype where wider: a float64
model's log-probs and greedy picks are float64's) of every token after the first: the prompt's
(from the prefill) and the generated ones. Without them the forward computes the output layer at the last
column only (every row's last real token, the prompts being left-padded), as Megatron does
(``materialize_only_last_token_logits``): the prefill's ``[L, b, V]`` logits are the largest serving tensor.

The loop reads logits only through a :class:`Picker` (next tokens and their log-probs; the prompt's
log-probs): one process picks from its own logits, a tensor x pipeline parallel job's
(:mod:`omnitron.core.inference.sharded`) picks on the last stage and broadcasts the choice, so every
rank takes the same decisions.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from omnitron.core.inference.kv_cache import KVCache
from omnitron.core.inference.sampling import GREEDY, SamplingParams, row_generators, sample_next

Forward = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]
"""``(ids [b, s], position_ids [b, s], last) -> logits [s, b, V]`` (padding columns at -inf), or ``last``: the
last position's alone, ``[1, b, V]``."""


@dataclass
class Generation:
    """What :func:`generate_batch` returns, one entry per prompt."""

    tokens: list[list[int]]
    """The generated tokens (without the prompt; ending with ``eod`` when the row stopped there)."""
    log_probs: list[list[float]] | None
    """``log p(token)`` of every token after the first (prompt[1:] then the generated ones), or None."""
    note: str | None = None
    """One line naming the prompts that get fewer than ``max_new_tokens`` because the model's context ends first
    (:func:`context_note`), else None."""


def context_limit(model) -> int:
    """Positions the model can embed (``--max-position-embeddings``, else ``--seq-length``)."""
    return model.config.max_position_embeddings or model.config.seq_length


def _check_prompts(prompts, vocab_size: int, limit: int, check_ids: bool) -> None:
    if not prompts:
        raise ValueError("generate: give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token")
        if len(p) > limit:
            raise ValueError(f"generate: prompt {i} has {len(p)} tokens, more than the model's context of {limit} "
                             "positions; shorten it")
        if check_ids and not all(0 <= t < vocab_size for t in p):
            raise ValueError(f"generate: prompt {i} holds token ids outside [0, {vocab_size}), the model's vocabulary")


NOTE_LISTED = 3
"""Prompts a :func:`context_note` names one by one (the others are counted)."""


def context_note(lengths: list[int], max_new_tokens: int, limit: int) -> str | None:
    """The line saying which prompts leave room for fewer than ``max_new_tokens`` in the model's ``limit``
    positions, and that they get that many, else None. A row stops when prompt and generation fill the context
    (:func:`_decode`): such a request used to return fewer tokens without a word. Megatron's serving engine
    (``DynamicInferenceEngine.add_request``) likewise clamps the tokens to generate to the room left with a
    warning, and Hugging Face's ``generate`` warns past ``max_position_embeddings``; a prompt longer than the
    context is refused before (:func:`_check_prompts`)."""
    short = [(i, n) for i, n in enumerate(lengths) if limit - n < max_new_tokens]
    if not short:
        return None
    each = [f"prompt {i} takes {n} of them, leaving room for {limit - n}" for i, n in short[:NOTE_LISTED]]
    more = f" (and {len(short) - NOTE_LISTED} more prompts)" if len(short) > NOTE_LISTED else ""
    return (f"the model's context is {limit} positions (--max-position-embeddings): {'; '.join(each)}{more} of the "
            f"{max_new_tokens} new tokens asked; generating that many (shorten the prompt or ask for fewer tokens)")


def _left_pad(prompts, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [b, L]`` (padding id 0), ``valid [b, L]`` bool and per-row ``positions [b, L]``."""
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    pad = (width - lengths)[:, None]  # [b, 1]
    slots = torch.arange(width)[None, :]
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), (slots >= pad).to(device), (slots - pad).clamp(min=0).to(device)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32 or their own dtype where wider (a float32 cast cost a float64 model's log-probs
    1e-7 against a float64 reference)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class Picker:
    """Decisions taken from the logits, on one process: the next tokens and the prompt's log-probs."""

    def prompt_log_probs(self, logits: torch.Tensor | None, ids: torch.Tensor,
                         valid: torch.Tensor) -> list[list[float]]:
        """Per row, ``log p(prompt[j + 1] | prompt[:j + 1])`` from the prefill logits ``[L, b, V]``; targets
        that are placeholders (negative ids: LLaVA's image positions) have none and are skipped."""
        return self.kept(self.prompt_picked(logits, ids), ids, valid)

    @staticmethod
    def prompt_picked(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``[b, L-1]`` log-probs of each next prompt slot's token (placeholders read as id 0)."""
        lp = torch.log_softmax(_wide(logits), dim=-1).transpose(0, 1)[:, :-1]  # [b, L-1, V]
        return torch.gather(lp, 2, ids[:, 1:].clamp(min=0)[..., None])[..., 0]

    @staticmethod
    def kept(picked: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor) -> list[list[float]]:
        """Per row, the entries of ``picked [b, L-1]`` predicted from a real slot for a real token."""
        keep = valid[:, :-1] & (ids[:, 1:] >= 0)
        return [picked[i][keep[i]].tolist() for i in range(ids.shape[0])]

    def next_tokens(self, logits: torch.Tensor | None, params: SamplingParams, gens, want_lp: bool,
                    rows: int) -> tuple[torch.Tensor, list[float] | None]:
        """The next token of each of the ``rows`` rows ``[b]`` from the last position's logits, and its
        log-prob when asked."""
        last = _wide(logits[-1])  # [b, V]
        nxt = sample_next(last, params, gens)
        step_lp = torch.log_softmax(last, dim=-1).gather(1, nxt[:, None])[:, 0].tolist() if want_lp else None
        return nxt, step_lp


@torch.no_grad()
def generate_batch(model, prompts: list[list[int]], max_new_tokens: int, *, params: SamplingParams = GREEDY,
                   eod: int | frozenset[int] | None = None, return_log_probs: bool = False, use_cache: bool = True,
                   forward: Forward | None = None, check_ids: bool = True, picker: Picker | None = None) -> Generation:
    """Continue every prompt by up to ``max_new_tokens`` tokens (see the module docstring). ``eod``: the token a
    row stops at, or a set of them (the server's ``stop_on_eol`` adds the line-ending tokens).

    ``forward`` runs the model on ``(ids, positions)`` (default: ``model(tokens=, position_ids=)``, a GPT);
    the T5 and LLaVA wrappers pass their own; a sharded job passes its stage's, with its ``picker``.
    ``model.decoder.layers`` get the KV cache."""
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = context_limit(model)
    _check_prompts(prompts, model.config.vocab_size, limit, check_ids)
    forward = forward or (lambda ids, pos, last: model(tokens=ids, position_ids=pos, last_position_only=last))
    device = next(model.parameters()).device
    ids, valid, pos = _left_pad(prompts, device)
    padded = not bool(valid.all())
    gens = row_generators(params, len(prompts))
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(model, cache_slots(prompts, max_new_tokens, limit)) if use_cache else contextlib.nullcontext()
        lengths = [len(p) for p in prompts]
        with cache:
            out = _decode(forward, cache if use_cache else None, ids, valid, pos, padded, max_new_tokens, params,
                          gens, _stops(eod), return_log_probs, limit, lengths, picker or Picker(), model)
        out.note = context_note(lengths, max_new_tokens, limit)
        return out
    finally:
        model.train(was_training)


def cache_slots(prompts, max_new_tokens: int, limit: int) -> int:
    """Slots the KV cache allocates per layer: the padded prompt width plus the tokens a row can add
    (``max_new_tokens``, or fewer where the shortest prompt reaches the context ``limit`` first), the longest
    sequence of the batch. The last token picked is never fed back, so one slot stays spare (Megatron's static context
    likewise holds prompt + tokens to generate)."""
    lengths = [len(p) for p in prompts]
    return max(lengths) + min(max_new_tokens, limit - min(lengths))


def _stops(eod) -> frozenset[int]:
    return frozenset() if eod is None else frozenset([eod]) if isinstance(eod, int) else frozenset(eod)


def _run(model, forward, cache, ids, valid, pos, padded, step: int, last: bool):
    """Logits ``[s, b, V]`` of this step (``last``: ``[1, b, V]``): the new slot with the cache, else the whole
    sequence."""
    if cache is not None:
        cache.valid = valid if padded else None
        return forward(ids[:, step:], pos[:, step:], last)
    with KVCache(model) as fresh:  # a throwaway cache: its masks, no reuse
        fresh.valid = valid if padded else None
        return forward(ids, pos, last)


def _decode(forward, cache, ids, valid, pos, padded, max_new, params, gens, stops, want_lp, limit, lengths, picker,
            model):
    """The decoding loop of :func:`generate_batch` (inside the cache context)."""
    b = ids.shape[0]
    new = [[] for _ in range(b)]
    lps = None
    done = [n >= limit or max_new == 0 for n in lengths]
    logits = _run(model, forward, cache, ids, valid, pos, padded, 0, not want_lp)  # the prompt's log-probs: all
    if want_lp:
        lps = picker.prompt_log_probs(logits, ids, valid)
    while not all(done):
        nxt, step_lp = picker.next_tokens(logits, params, gens, want_lp, b)
        for i, t in enumerate(nxt.tolist()):
            if done[i]:
                continue
            new[i].append(t)
            if want_lp:
                lps[i].append(step_lp[i])
            done[i] = t in stops or len(new[i]) >= max_new or lengths[i] + len(new[i]) >= limit
        if all(done):
            break
        step = ids.shape[1]
        ids = torch.cat([ids, nxt[:, None]], 1)
        valid = torch.cat([valid, valid.new_ones(b, 1)], 1)
        pos = torch.cat([pos, (pos[:, -1:] + 1).clamp(max=limit - 1)], 1)  # finished rows stay in range
        logits = _run(model, forward, cache, ids, valid, pos, padded, step, True)
    return Generation(tokens=new, log_probs=lps)
