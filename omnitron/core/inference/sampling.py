"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus), one seed per row.

Megatron's conventions: ``top_k == 1`` (or ``temperature == 0``) is greedy, ``top_k == 0`` and
``top_p == 0`` switch those filters off, and the two filters are not combined: ``top_k > 0`` with
``top_p > 0`` is refused, as Megatron's library refuses it (``TorchSampling.sample_from_logits``, its
default sampling backend, asserts "Cannot have top-p and top-k both greater than zero") and its text
generation server (``/api``: "cannot set both top-k and top-p samplings"). Library, ``omnitron generate``
and ``omnitron serve`` so take the same requests.

Each row samples with its own ``torch.Generator`` and draws exactly one uniform number per step, then
inverts the cumulative distribution over the vocabulary in id order. So a row's tokens depend only on
its own seed and logits, not on the batch it was generated in: a prompt sampled alone with seed ``s``
gives the same continuation as row ``i`` of a batch seeded ``s - i`` (rows are seeded ``seed + i``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


MAX_SEED = 2**63
"""Seeds are below it: row ``i`` seeds a generator with ``seed + i``, which takes at most 64 bits."""


def short_repr(v, limit: int = 60) -> str:
    """``repr(v)``, cut to ``limit`` characters (an error line never echoes a whole request)."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How the next token is chosen (checked on construction, so a bad value fails before any forward)."""

    temperature: float = 1.0
    """Logits are divided by it before top-k / top-p; 0 means greedy."""
    top_k: int = 0
    """Keep the k likeliest tokens; 1 = greedy, 0 = no limit (Megatron). Not with ``top_p``."""
    top_p: float = 0.0
    """Keep the smallest set of likeliest tokens whose probability reaches p; 0 = off (Megatron). Not with
    ``top_k``."""
    seed: int | None = None
    """Row ``i`` samples with a generator seeded ``seed + i``; None: seeded from torch's global RNG."""

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: no top-k filter, 1: greedy), got "
                             f"{short_repr(self.top_k)}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be a number in [0, 1] (0: no nucleus filter), got {short_repr(self.top_p)}")
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be a number in [0, 100] (0: greedy), got "
                             f"{short_repr(self.temperature)}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {short_repr(self.seed)}")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(f"top_k and top_p together (top_k={self.top_k}, top_p={self.top_p:g}): give one of them, "
                             "the other 0, as Megatron's sampling and server require")

    @property
    def greedy(self) -> bool:
        return self.top_k == 1 or self.temperature == 0.0


GREEDY = SamplingParams(top_k=1)


def row_generators(params: SamplingParams, rows: int) -> list[torch.Generator] | None:
    """One CPU generator per row (None when greedy: nothing is drawn)."""
    if params.greedy:
        return None
    base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
    return [torch.Generator().manual_seed(base + i) for i in range(rows)]


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[b, V]`` fp32 (logits - row max) / temperature with the tokens outside top-k or the nucleus at -inf.

    NOTE: the row max is subtracted first, so every entry is <= 0 before the division and the likeliest token
    is exactly 0: a tiny temperature (1e-320) sends the others to -inf (greedy, its limit) instead of the
    real logits to +-inf and their softmax to NaN; the padding columns stay at -inf."""
    x = (logits - logits.max(dim=-1, keepdim=True).values) / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [b, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # the mass of the strictly likelier tokens: the running sum shifted right by one (Megatron's
        # TorchSampling drops a token once the likelier ones' mass exceeds p, so a token that brings the mass
        # to exactly p keeps the next one too; the first token is always kept)
        mass = torch.cumsum(probs, dim=-1)
        before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)
        drop_sorted = before > params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_next(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator] | None) -> torch.Tensor:
    """Next token ids ``[b]`` (int64, on the logits' device) from ``logits [b, V]`` (float32 or wider: greedy picks
    in their dtype, draws in float32)."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    # NOTE: CPU generators and arithmetic, so one seed gives the same tokens on every backend
    probs = torch.softmax(filter_logits(logits.float(), params), dim=-1).cpu()
    cdf = torch.cumsum(probs, dim=-1)  # [b, V]
    u = torch.cat([torch.rand(1, generator=g) for g in generators])  # [b], one draw per row
    # NOTE: never past the last kept token: u <= 1 - 2**-24 (torch.rand's float32 draws are multiples of 2**-24),
    # so u * total rounds strictly below total, and the cdf (a sequential cumsum of non-negative terms) is already
    # total at the last kept token; the first entry above the draw is at or before it
    ids = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    broken = ~torch.isfinite(cdf[:, -1])  # logits holding NaN or +inf: greedy, never a padding column
    if bool(broken.any()):
        ids = torch.where(broken, torch.argmax(torch.nan_to_num(logits.float().cpu(), nan=float("-inf")), dim=-1), ids)
    return ids.to(logits.device)
