"""What identifies a build of the C++ CPU kernels: the digest of their sources, and the C++ standard to build with.

Both builds of ``csrc/cpu`` read this module: ``setup.py`` (the installed ``omnitron._C``, loaded by path, so
nothing else of omnitron is imported while it builds) and the JIT build of a source checkout
(:mod:`omnitron.kernels.cpp`). Each compiles the digest into the extension (``source_digest``), so two nodes
compare the kernels they run (:func:`omnitron.core.training.agreement.software`), not how or where each was built.
Nothing here imports torch or omnitron.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

DIGEST_MACRO = "OMNITRON_SOURCE_DIGEST"
"""The preprocessor name ``csrc/bindings.cpp`` turns into the extension's ``source_digest`` string."""
DIGEST_PREFIX = "src_"
"""The macro's value starts with a letter (an identifier, the same token through a shell and without one)."""


def kernel_sources(csrc: Path | str) -> list[Path]:
    """Every file the extension is compiled from: ``csrc/cpu``'s sources and headers, and the bindings."""
    csrc = Path(csrc)
    return sorted(csrc.glob("cpu/*.cpp")) + sorted(csrc.glob("cpu/*.h")) + [csrc / "bindings.cpp"]


def compiled_sources(csrc: Path | str) -> list[Path]:
    """The files the compiler is given (the headers are only included): what ``setup.py`` and the JIT build
    compile, one list."""
    return [path for path in kernel_sources(csrc) if path.suffix == ".cpp"]


def source_digest(csrc: Path | str) -> str:
    """SHA-256 (first 16 hex digits) of the kernel sources' names (relative to ``csrc``) and bytes."""
    csrc, digest = Path(csrc), hashlib.sha256()
    for path in kernel_sources(csrc):
        digest.update(path.relative_to(csrc).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def digest_define(csrc: Path | str) -> str:
    """The compiler flag that puts :func:`source_digest` into the extension."""
    return f"-D{DIGEST_MACRO}={DIGEST_PREFIX}{source_digest(csrc)}"


def cxx_std(torch_version: str) -> str:
    """The C++ standard of torch's headers: C++20 from torch 2.14 (they use concepts' ``requires``), C++17 before
    (the compiler's default may be older)."""
    major, minor = (int(x) for x in torch_version.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


def interface_digest(module) -> str:
    """``N ops #digest`` of an extension module's functions' names and signatures (their pybind docstrings): what
    a build from other sources changes, when the build does not say which sources it came from."""
    ops = sorted((n, str(getattr(module, n).__doc__)) for n in dir(module) if not n.startswith("__"))
    return f"{len(ops)} ops #{hashlib.sha256(repr(ops).encode()).hexdigest()[:12]}"
