"""The argument parser every omnitron command line uses (``omnitron`` and its sub-commands, ``omnitron train``'s
settings, ``python -m omnitron.train``): Megatron's no-abbreviation rule and close-match suggestions.

It lives in core because core parses training settings (:func:`omnitron.core.training.arguments.parse_settings`)
and core imports nothing from the command line layer (``omnitron.cli``, ``omnitron.commands``).
"""
from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--micro-batch`` is not ``--micro-batch-size``, as in Megatron), and an
    unknown flag gets the closest ones of its own sub-command as suggestions."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        unknown = [a for a in extras if a.startswith("--")]
        if unknown and self._subparsers is None:  # a sub-command's parser: it knows its own flags
            self.error(_unknown(unknown, self))
        return parsed, extras

    def error(self, message: str):
        """One line, not argparse's usage block first (``omnitron train``'s is some 250 lines, and the error
        came after it): the program, the problem and where the flags are listed."""
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def _unknown(flags: list[str], parser: argparse.ArgumentParser) -> str:
    """The error for unknown ``flags``: a flag of another program the parser speaks for (``foreign_flags``:
    Megatron-LM's, on ``omnitron train``) is named as that program's and not implemented here; any other gets
    the parser's closest flags as suggestions."""
    import difflib

    known = [s for s in parser._option_string_actions if s.startswith("--")]
    foreign = getattr(parser, "foreign_flags", None)
    parts = []
    for flag in flags:
        name = flag.split("=", 1)[0]
        if foreign and name in foreign[1]:
            parts.append(f"{name} ({foreign[0]}'s flag, which omnitron does not implement: drop it; "
                         f"docs/megatron-flags.md lists what runs)")
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        parts.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    return "unrecognized arguments: " + ", ".join(parts)
