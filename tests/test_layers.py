"""The layering contract: omnitron/core imports nothing from the layers above it.

``omnitron.core`` is the engine; ``omnitron.cli`` / ``omnitron.commands`` (the command line),
``omnitron.plan`` (the planner) and ``omnitron.testing`` (test harnesses) are built on it. Every import
statement in omnitron/core -- module level or inside a function, ``import x`` or ``from x import y``,
absolute or relative -- is read from the syntax tree, so a lazy import cannot hide an upward edge.
What core needs from above is passed in (the planner's memory table reaches the training loop as an
argument) or lives in core (the argument parser, generation's printing, the free-port helper).
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "omnitron" / "core"
ABOVE = ("omnitron.cli", "omnitron.commands", "omnitron.plan", "omnitron.testing")


def imported_modules(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``path`` (a file under ``root``, the repository);
    ``from a import b`` also yields ``a.b`` (``from omnitron import cli`` names a module through its package)."""
    package = list(path.relative_to(root).parts[:-1])  # the file's package, __init__.py's too
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def from_base(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from ... import`` statement in ``package`` (a list of names) reads from; relative forms are
    resolved against the package."""
    base = node.module or ""
    if node.level:
        up = package[:len(package) - node.level + 1]
        base = ".".join(up + ([base] if base else []))
    return base


def upward(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in ABOVE)


def test_core_imports_nothing_from_the_layers_above():
    hits = sorted({f"{p.relative_to(ROOT)}:{line}: {name}" for p in CORE.rglob("*.py")
                   for line, name in imported_modules(p) if upward(name)})
    assert not hits, "omnitron/core imports from cli / commands / plan / testing:\n" + "\n".join(hits)


def test_the_reader_sees_every_import_form(tmp_path):
    """Each way of spelling an upward import is found (so the contract test can fail)."""
    pkg = tmp_path / "omnitron" / "core" / "x"
    pkg.mkdir(parents=True)
    src = pkg / "m.py"
    src.write_text("import omnitron.cli\nfrom omnitron import testing\nfrom omnitron.plan.memory import estimate\n"
                   "def f():\n    from ...commands import train\n    import omnitron.core.models\n")
    found = [name for _, name in imported_modules(src, tmp_path) if upward(name)]
    assert found == ["omnitron.cli", "omnitron.testing", "omnitron.plan.memory", "omnitron.plan.memory.estimate",
                     "omnitron.commands", "omnitron.commands.train"]


COMMAND_LAYER = ("omnitron.cli", "omnitron.commands", "omnitron.__main__", "omnitron.train")


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_only_the_command_layer_imports_the_command_layer():
    """The planner, the benchmarks, the backends and the test harnesses are built under the command line."""
    hits = sorted({f"{p.relative_to(ROOT)}:{line}: {name}" for p in (ROOT / "omnitron").rglob("*.py")
                   if not _module(p).startswith(COMMAND_LAYER) for line, name in imported_modules(p)
                   if name.startswith(("omnitron.cli", "omnitron.commands"))})
    assert not hits, "imports of the command layer from below it:\n" + "\n".join(hits)


def test_no_import_cycles_among_the_command_layer_and_the_planner():
    """Module-level graph of omnitron/cli.py, omnitron/commands and omnitron/plan, every import (function-local
    too): no cycle (``checkpoint`` registers ``hf`` / ``megatron``, which share ``checkpoint_args``; the planner's
    settings live in ``plan.settings``, not in ``commands.plan``)."""
    files = [ROOT / "omnitron" / "cli.py", *(ROOT / "omnitron" / "commands").rglob("*.py"),
             *(ROOT / "omnitron" / "plan").rglob("*.py")]
    mods = {_module(p): p for p in files}

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {t for _, n in imported_modules(p) if (t := target(n)) and t != m} for m, p in mods.items()}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (module -> modules it imports), or None."""
    done, path = set(), []

    def visit(m: str) -> list[str] | None:  # depth-first; returns a cycle when one closes
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph[m]):
            if (cycle := visit(n)):
                return cycle
        path.pop()
        done.add(m)
        return None

    return next((c for m in sorted(graph) if (c := visit(m))), None)


def import_graph(files: list[pathlib.Path], root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``files`` whose names it takes (every import statement, function-local too):
    ``import a.b`` -> ``a.b``; ``from p import x`` -> ``p.x`` when that is a module, else ``p``."""
    mods = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    graph = {}
    for m, p in mods.items():
        edges = set()
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, list(p.relative_to(root).parts[:-1]))
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[m] = {e for e in edges if e in mods and e != m}
    return graph


def test_no_import_cycles_among_omnitrons_modules():
    """No module of the package imports, through any chain of imports (function-local ones included), a module
    that imports it: shared names live in the lower module (a function-local import does not hide a cycle)."""
    graph = import_graph(sorted((ROOT / "omnitron").rglob("*.py")))
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_function_local_cycle(tmp_path):
    """A cycle closed only by an import inside a function is found (so the package test can fail)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    from pkg import a\n    return a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    graph = import_graph(sorted(tmp_path.rglob("*.py")), tmp_path)
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    return 1\n")
    assert _cycle(import_graph(sorted(tmp_path.rglob("*.py")), tmp_path)) is None
