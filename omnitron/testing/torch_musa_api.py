"""torch_musa's API as read from its source at each supported tag (``backends/musa/torch_musa_api/<tag>.txt``).

The lists are written by ``scripts/extract_torch_musa_api.py`` from a clone of MooreThreads/torch_musa;
each file's header names the tag, the commit and the command. This module reads them back as
``inspect.Signature`` objects so a test can check the MUSA backend's calls and the test double's
functions against torch_musa's own definitions rather than against each other.
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import re

API_DIR = pathlib.Path(__file__).resolve().parents[1] / "backends" / "musa" / "torch_musa_api"
_LINE = re.compile(r"^([\w.:]+)(?:\((.*)\))?$")


class SourceText(str):
    """A default value as written in torch_musa's source (not evaluated)."""


ATEN_ENUMS = {"Mean": 1, "Sum": 2}
"""Defaults native_functions.yaml spells by name: ``at::Reduction`` (None 0, Mean 1, Sum 2)."""


def shipped() -> dict[str, pathlib.Path]:
    """tag -> list file, for every tag shipped."""
    return {p.stem: p for p in sorted(API_DIR.glob("*.txt"))}


def _split(text: str) -> list[str]:
    """Split a parameter list on its top-level commas."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def parse_signature(text: str) -> inspect.Signature:
    """``"a, b=1, *, c=None, **kw"`` -> a Signature (defaults kept as their source text)."""
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for item in _split(text):
        if item == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
        elif item.startswith("**"):
            params.append(inspect.Parameter(item[2:], inspect.Parameter.VAR_KEYWORD))
        elif item.startswith("*"):
            params.append(inspect.Parameter(item[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
        else:
            name, _, default = item.partition("=")
            default = SourceText(default) if default else inspect.Parameter.empty
            params.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(params)


def load(path: pathlib.Path) -> dict[str, inspect.Signature | None]:
    """name -> its signature (None where the source gives none: a C-extension binding, a module, a fact)."""
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _LINE.match(line.strip())
        if not m:
            raise ValueError(f"{path.name}: unreadable line {line!r}")
        out[m.group(1)] = None if m.group(2) is None else parse_signature(m.group(2))
    return out


def header(path: pathlib.Path) -> dict[str, str]:
    """The tag and commit a list was read at (from its first line)."""
    m = re.match(r"# torch_musa API at tag (\S+), commit ([0-9a-f]{40})", path.read_text())
    if not m:
        raise ValueError(f"{path.name}: header does not name the tag and commit")
    return {"tag": m.group(1), "commit": m.group(2)}


def calls(source: str, names: set[str]) -> list[tuple[str, int, tuple[str, ...], int]]:
    """Calls spelled ``<name>(...)`` in ``source`` for ``name`` in ``names``: (name, positional count,
    keyword names, line). Calls that unpack ``*args`` / ``**kwargs`` cannot be checked and are left out."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name not in names or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        if any(k.arg is None for k in node.keywords):
            continue
        out.append((name, len(node.args), tuple(k.arg for k in node.keywords), node.lineno))
    return out


def accepts(sig: inspect.Signature, n_positional: int, keywords: tuple[str, ...]) -> str | None:
    """None when a call with ``n_positional`` arguments and ``keywords`` binds to ``sig``, else why not."""
    try:
        sig.bind(*range(n_positional), **{k: None for k in keywords})
    except TypeError as err:
        return str(err)
    return None


def shape(sig: inspect.Signature) -> list[tuple[str, object, object]]:
    """What two signatures must share: each parameter's name, kind and default (literal defaults by value,
    others as present/absent)."""
    out = []
    for p in sig.parameters.values():
        default = p.default
        if isinstance(default, SourceText) and default in ATEN_ENUMS:
            default = ATEN_ENUMS[default]
        elif isinstance(default, SourceText):
            try:
                default = ast.literal_eval(default)
            except (ValueError, SyntaxError):
                default = "<expr>"
        elif default is not inspect.Parameter.empty and not isinstance(default, (int, float, bool, str, type(None))):
            default = "<expr>"
        out.append((p.name, p.kind, default))
    return out
