"""Which layers are Mixture-of-Experts: Megatron's ``--moe-layer-freq``.

An integer ``N`` makes every N-th layer MoE (layers 0, N, 2N, ...; 1 = every layer). A pattern is
one 0/1 entry per layer, written as a list (``[1,0,1,0]``) or as Megatron's list expression
(``([0]+[1]*3)*2``: lists, ``+`` concatenation, ``* int`` repetition, parentheses). The
expression is parsed here, never evaluated by Python.
"""
from __future__ import annotations

import re

from omnitron.core.config.parallel import ConfigError

_TOKEN = re.compile(r"\s*(\d+|[\[\](),+*])")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos:]!r}")
        out.append(m.group(1))
        pos = m.end()
    return out


class _Parser:
    """``expr := term ('+' term)*``; ``term := atom ('*' INT)*``; ``atom := '[' ints ']' | '(' expr ')'``."""

    def __init__(self, tokens: list[str]) -> None:
        self.toks, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (want is not None and tok != want):
            raise ValueError(f"expected {want or 'more'} at token {self.i}, got {tok!r}")
        self.i += 1
        return tok

    def expr(self) -> list[int]:
        out = self.term()
        while self.peek() == "+":
            self.take("+")
            out = out + self.term()
        return out

    def term(self) -> list[int]:
        out = self.atom()
        while self.peek() == "*":
            self.take("*")
            n = self.take()
            if not n.isdigit():
                raise ValueError(f"'*' needs an integer, got {n!r}")
            out = out * int(n)
        return out

    def atom(self) -> list[int]:
        if self.peek() == "(":
            self.take("(")
            out = self.expr()
            self.take(")")
            return out
        self.take("[")
        out = []
        while self.peek() != "]":
            tok = self.take()
            if not tok.isdigit():
                raise ValueError(f"list entries are integers, got {tok!r}")
            out.append(int(tok))
            if self.peek() == ",":
                self.take(",")
        self.take("]")
        return out


def moe_layer_pattern(spec, num_layers: int, flag: str = "--moe-layer-freq",
                      meaning: tuple[str, str] = ("dense MLP", "MoE")) -> list[bool]:
    """``[num_layers]`` True where the layer is MoE, from ``--moe-layer-freq`` (int, digit string,
    0/1 list or list expression). Raises ConfigError naming the flag and the fix. ``flag`` / ``meaning``: the
    names in the errors when another per-layer 0/1 pattern is read (``--window-attn-skip-freq``)."""
    if isinstance(spec, (list, tuple)):
        pattern = [int(v) for v in spec]
    elif isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        n = int(spec)
        if n < 1:
            raise ConfigError(f"{flag} {n} must be >= 1 (every N-th layer is {meaning[1]})")
        return [i % n == 0 for i in range(num_layers)]
    else:
        try:
            parser = _Parser(_tokens(str(spec)))
            pattern = parser.expr()
            if parser.peek() is not None:
                raise ValueError(f"trailing {parser.peek()!r}")
        except ValueError as e:
            raise ConfigError(f"{flag} {spec!r} is not an integer or a 0/1 list expression such as "
                              f"'([0]+[1]*3)*2' ({e})") from None
    if len(pattern) != num_layers or any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"{flag} {spec!r} gives {pattern}: it needs exactly --num-layers {num_layers} "
                          f"entries, each 0 ({meaning[0]}) or 1 ({meaning[1]})")
    return [bool(v) for v in pattern]


def is_moe_layer(c, index: int) -> bool:
    """Whether global layer ``index`` (0-based) of model config ``c`` is a Mixture-of-Experts layer."""
    return bool(c.num_experts) and moe_layer_pattern(c.moe_layer_freq, c.num_layers)[index]
