#!/usr/bin/env python3
"""List the torch_musa API as it stands in torch_musa's own source at one git tag.

Why: omnitron's MUSA backend and its test double (omnitron/testing/musa_double.py) were written from
torch_musa's documentation; this script reads the source itself (a bare clone of
github.com/MooreThreads/torch_musa) so tests/backends/test_musa_manifest.py can check both against it.

What it lists, one line each (``name`` or ``name(params)``, Python parameter syntax, no annotations):
- ``torch.musa.<name>``: everything ``torch_musa/__init__.py`` binds (``torch.musa`` *is* that module),
  following its relative imports, ``import *`` (``__all__`` where given) and aliases; the public methods
  of the classes among them (``torch.musa.Stream.query()``); the public names of submodules it binds
  (``torch.musa.amp.autocast``). Signatures are read from the ``def`` (``__init__``/``__new__`` for a class);
  a name bound from the C extension has none.
- ``torch_musa.__version__`` (written by its setup.py from version.txt).
- ``torch.<op>(params)``: the functions torch_musa's patch adds to ATen's ``native_functions.yaml``.
- ``torch.backends.<name>.<attr>``: what a module it installs as ``torch.backends.<name>`` binds, class-level
  properties included (``torch.backends.mudnn.allow_tf32``); ``default:<flag>:<value>`` for its TF32 switch's
  initial value in the C++ (``bool allow_tf32_ = ...``).
- ``process_group:<name>``: process-group backends its C++ registers with ``Backend.register_backend``.
- ``env:<NAME>``: the ``TORCH_MCCL_*`` / ``TORCH_*MUBLAS*`` environment variables its C++ sources spell.

Usage: python scripts/extract_torch_musa_api.py --git-dir <torch_musa.git> --tag v2.7.1 > <out.txt>
Only the standard library and ``git`` are needed; nothing is imported from torch_musa.
"""
from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys

PKG = "torch_musa"
YAML_PATCH = "torch_patches/aten_src_ATen_native_native_functions.yaml.patch"
CPP_DIRS = ("torch_musa/csrc/distributed", "torch_musa/csrc/aten/utils", "torch_musa/csrc/core")
ENV = re.compile(r'"((?:TORCH_MCCL_|TORCH_ALLOW_TF32_)[A-Z0-9_]+)"')
REGISTER = re.compile(r'register_backend\(\s*"(\w+)"')
BACKENDS_MODULE = re.compile(r'torch\.backends\.__setattr__\(\s*"(\w+)",\s*sys\.modules\["([\w.]+)"\]')
TF32_DEFAULT = re.compile(r"bool allow_tf32_ = (true|false);")
TF32_CONTEXT = "torch_musa/csrc/aten/utils/Context.h"


class Source:
    """Files of one commit of a bare git repository."""

    def __init__(self, git_dir: str, tag: str) -> None:
        self.git_dir, self.tag = git_dir, tag
        self.commit = self._git("rev-parse", f"{tag}^{{commit}}").strip()
        self.files = set(self._git("ls-tree", "-r", "--name-only", self.commit).split())

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", self.git_dir, *args], check=True, capture_output=True,
                              text=True).stdout

    def read(self, path: str) -> str:
        return self._git("show", f"{self.commit}:{path}")

    def module_file(self, dotted: str) -> str | None:
        """``torch_musa.core.memory`` -> its file at this commit, or None (a C extension, a missing module)."""
        base = dotted.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.files), None)


def params(args: ast.arguments, drop_first: bool) -> str:
    """A ``def``'s parameters as source text without annotations (``self``/``cls`` dropped for methods)."""
    args = ast.arguments(**{f: getattr(args, f) for f in args._fields})
    positional = list(args.posonlyargs) + list(args.args)
    if drop_first and positional:
        positional = positional[1:]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [a.arg + ("" if d is None else "=" + ast.unparse(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append("*" + args.vararg.arg)
    elif args.kwonlyargs:
        out.append("*")
    out += [a.arg + ("" if d is None else "=" + ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append("**" + args.kwarg.arg)
    return "(" + ", ".join(out) + ")"


class Module:
    """The top-level bindings of one Python module of the package (followed lazily)."""

    def __init__(self, src: Source, dotted: str) -> None:
        self.src, self.dotted = src, dotted
        path = src.module_file(dotted)
        self.tree = ast.parse(src.read(path)) if path else None
        self.is_package = bool(path and path.endswith("__init__.py"))

    def resolve(self, level: int, module: str | None) -> str:
        parts = self.dotted.split(".")
        base = parts if self.is_package else parts[:-1]
        base = base[: len(base) - (level - 1)] if level else []
        return ".".join(base + ([module] if module else [])) if level else (module or "")

    def all_names(self) -> list[str] | None:
        for node in self.tree.body if self.tree else ():
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                return [ast.literal_eval(e) for e in node.value.elts]
        return None


def bindings(src: Source, dotted: str, seen: frozenset = frozenset()) -> dict[str, object]:
    """name -> ``ast.FunctionDef`` / ``ast.ClassDef`` / ``("module", dotted)`` / None (unknown origin)."""
    mod = Module(src, dotted)
    if mod.tree is None or dotted in seen:
        return {}
    seen = seen | {dotted}
    out: dict[str, object] = {}
    for node in mod.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = out.get(node.value.id) if isinstance(node.value, ast.Name) else None
        elif isinstance(node, ast.ImportFrom):
            target = mod.resolve(node.level, node.module)
            if not target.startswith(PKG):
                continue
            if node.names[0].name == "*":
                inner = bindings(src, target, seen)
                wanted = Module(src, target).all_names() or [n for n in inner if not n.startswith("_")]
                out.update({n: inner.get(n) for n in wanted})
                continue
            inner = None
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if src.module_file(sub):
                    out[alias.asname or alias.name] = ("module", sub)
                else:
                    inner = bindings(src, target, seen) if inner is None else inner
                    out[alias.asname or alias.name] = inner.get(alias.name)
    return out


def entries(prefix: str, names: dict[str, object], src: Source, depth: int = 0) -> list[str]:
    """Manifest-spelled lines for ``names`` bound under ``prefix``."""
    lines = []
    for name, obj in names.items():
        if name.startswith("_"):
            continue
        full = f"{prefix}.{name}"
        if isinstance(obj, ast.FunctionDef):
            lines.append(full + params(obj.args, drop_first=False))
        elif isinstance(obj, ast.ClassDef):
            ctor = next((n for n in obj.body if isinstance(n, ast.FunctionDef) and n.name in ("__init__", "__new__")),
                        None)
            lines.append(full + (params(ctor.args, drop_first=True) if ctor else ""))
            for meth in obj.body:
                if isinstance(meth, ast.FunctionDef) and not meth.name.startswith("_"):
                    is_static = any(getattr(d, "id", "") == "staticmethod" for d in meth.decorator_list)
                    lines.append(f"{full}.{meth.name}" + params(meth.args, drop_first=not is_static))
        elif isinstance(obj, tuple) and depth == 0:
            lines.append(full)
            lines += entries(full, bindings(src, obj[1]), src, depth + 1)
        else:
            lines.append(full)
    return lines


def native_functions(src: Source) -> list[str]:
    """``torch.<op>(params)`` for each function-variant op torch_musa's yaml patch adds."""
    lines, patch = [], src.read(YAML_PATCH).splitlines()
    for i, line in enumerate(patch):
        m = re.match(r"^\+- func: (\w+)(?:\.\w+)?\((.*)\) -> ", line)
        if not m:
            continue
        block = []
        for nxt in patch[i + 1:]:
            if not nxt.startswith("+  "):
                break
            block.append(nxt)
        variants = next((b.split(":", 1)[1] for b in block if b.strip().startswith("variants:")), "function")
        if "function" not in variants or any("python_module:" in b for b in block):
            continue
        out = []
        for arg in filter(None, (a.strip() for a in m.group(2).split(", "))):
            out.append(arg if arg == "*" else arg.split(" ", 1)[1])
        lines.append(f"torch.{m.group(1)}(" + ", ".join(out) + ")")
    return lines


def backends_modules(src: Source) -> list[str]:
    """``torch.backends.<name>.<attr>`` for modules ``torch_musa/__init__.py`` installs under ``torch.backends``,
    and the C++ default of the TF32 switch they expose."""
    lines = []
    for name, dotted in BACKENDS_MODULE.findall(src.read(src.module_file(PKG))):
        mod = Module(src, dotted)
        props = [t.id for c in mod.tree.body if isinstance(c, ast.ClassDef) for a in c.body
                 if isinstance(a, ast.Assign) for t in a.targets if isinstance(t, ast.Name) and t.id != "__all__"]
        lines += entries(f"torch.backends.{name}", bindings(src, dotted), src)
        lines += [f"torch.backends.{name}.{p}" for p in props]
        if "allow_tf32" in props and TF32_CONTEXT in src.files:
            default = TF32_DEFAULT.search(src.read(TF32_CONTEXT))
            if default:
                lines.append(f"default:torch.backends.{name}.allow_tf32:{default.group(1).capitalize()}")
    return lines


def cpp_facts(src: Source) -> list[str]:
    """``process_group:<name>`` and ``env:<NAME>`` lines from the C++ sources."""
    groups, env = set(), set()
    for path in sorted(p for p in src.files if p.startswith(CPP_DIRS) and p.endswith((".cpp", ".h"))):
        text = src.read(path)
        groups |= set(REGISTER.findall(text))
        env |= set(ENV.findall(text))
    return [f"process_group:{g}" for g in sorted(groups)] + [f"env:{e}" for e in sorted(env)]


def extract(git_dir: str, tag: str) -> tuple[Source, list[str]]:
    src = Source(git_dir, tag)
    lines = entries("torch.musa", bindings(src, PKG), src)
    lines.append(f"{PKG}.__version__")
    lines += native_functions(src) + backends_modules(src) + cpp_facts(src)
    return src, sorted(set(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--git-dir", required=True, help="a clone of github.com/MooreThreads/torch_musa (bare is fine)")
    parser.add_argument("--tag", required=True, help="the tag (or commit) to read, e.g. v2.7.1")
    ns = parser.parse_args(argv)
    src, lines = extract(ns.git_dir, ns.tag)
    print(f"# torch_musa API at tag {ns.tag}, commit {src.commit}, read from its source by")
    print(f"#   python scripts/extract_torch_musa_api.py --git-dir <torch_musa.git> --tag {ns.tag}")
    print("# One name per line, as backends/musa/manifest.txt spells it; (params) where the source gives a signature.")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
