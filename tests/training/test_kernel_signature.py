"""The C++ kernels' entry in the nodes' software comparison: the digest of the sources a build came from.

A node with an installed ``omnitron._C`` (a wheel, ``setup.py``) and a node with a source checkout, whose kernels
are JIT-built into ``$OMNITRON_CACHE`` under the name ``omnitron_C``, ran the same kernels but refused to start
together: the second reported ``omnitron._C: not installed`` (it looked only for the installed module), the first
``11 ops #...``. Both now report ``sources #DIGEST`` (:func:`omnitron.kernels.cpp.signature`); different sources
are refused in one line naming both digests.
"""
from __future__ import annotations

import random
import shutil
import sys
import types

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.agreement import software
from omnitron.kernels import cpp, sources
from tests.training.test_settings_agreement import BASE, _run_ranks


def _installed(monkeypatch, digest: str | None) -> None:
    """This process sees an installed ``omnitron._C`` built from sources of ``digest`` (None: built before the
    extension carried its digest)."""
    module = types.ModuleType("omnitron._C")
    module.rms_norm_fwd = types.FunctionType((lambda: None).__code__, {})
    module.rms_norm_fwd.__doc__ = "rms_norm_fwd(arg0: torch.Tensor, arg1: float) -> list[torch.Tensor]"
    if digest is not None:
        module.source_digest = sources.DIGEST_PREFIX + digest
    monkeypatch.setitem(sys.modules, "omnitron._C", module)


def _source_checkout(monkeypatch, csrc=None) -> None:
    """This process has no installed ``omnitron._C``: its kernels are JIT-built from ``csrc`` (default: this
    checkout's) on first use."""
    monkeypatch.setitem(sys.modules, "omnitron._C", None)  # the import fails, as where no wheel is installed
    monkeypatch.delenv("OMNITRON_JIT_BUILD", raising=False)
    if csrc is not None:
        monkeypatch.setattr(cpp, "_CSRC", csrc)


def test_a_wheel_and_a_jit_build_of_the_same_sources_agree(monkeypatch):
    _installed(monkeypatch, sources.source_digest(cpp._CSRC))
    wheel = software()
    _source_checkout(monkeypatch)
    jit = software()
    assert wheel["omnitron._C"] == jit["omnitron._C"] == f"sources #{sources.source_digest(cpp._CSRC)}"
    assert _run_ranks([BASE] * 2, softwares=[wheel, jit]) == [None, None]


@pytest.mark.parametrize("jit_on", [0, 1])
def test_different_kernel_sources_are_refused_naming_both(monkeypatch, tmp_path, jit_on):
    """One byte of one kernel source changed (a random file, position and byte) on the node ``jit_on``; the other
    runs a wheel of this checkout's sources. Every rank stops with one line naming both digests."""
    csrc = tmp_path / "csrc"
    shutil.copytree(cpp._CSRC, csrc)
    edited = random.choice(sources.kernel_sources(csrc))
    data = bytearray(edited.read_bytes())
    at = random.randrange(len(data))
    data[at] = (data[at] + random.randrange(1, 256)) % 256
    edited.write_bytes(bytes(data))
    ours, theirs = sources.source_digest(cpp._CSRC), sources.source_digest(csrc)
    assert ours != theirs
    _installed(monkeypatch, ours)
    wheel = software()
    _source_checkout(monkeypatch, csrc)
    jit = software()
    softwares = [jit, wheel] if jit_on == 0 else [wheel, jit]
    got = _run_ranks([BASE] * 2, softwares=softwares)
    line = str(got[0])
    assert all(isinstance(e, ConfigError) and str(e) == line for e in got) and "\n" not in line, got
    rank0, rank1 = (theirs, ours) if jit_on == 0 else (ours, theirs)
    assert (f"(rank 1 of 2 differ from rank 0): omnitron._C sources #{rank1} on rank 1, sources #{rank0} on rank 0. "
            f"Install the same omnitron, torch and C++ extensions") in line, line


def test_an_extension_built_before_it_carried_its_digest_is_told_apart(monkeypatch):
    """An old build cannot say its sources: its functions' signatures stand in, which a new build does not match
    (rebuild it), and "not installed" where there is neither a build nor sources to build."""
    _installed(monkeypatch, None)
    assert software()["omnitron._C"].startswith("1 ops #")
    _source_checkout(monkeypatch)
    monkeypatch.setenv("OMNITRON_JIT_BUILD", "0")
    assert software()["omnitron._C"] == "not installed"


def _build_fails(monkeypatch) -> None:
    """This process's JIT build of the kernels fails (as where no compiler is installed), not yet tried."""
    def fail():
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    import omnitron

    monkeypatch.setattr(cpp, "_state", {})
    monkeypatch.setattr(cpp, "_jit_build", fail)
    monkeypatch.delattr(omnitron, "_C", raising=False)  # `from omnitron import _C` reads an earlier import's attribute


def test_a_node_whose_build_failed_says_it_runs_the_reference(monkeypatch):
    """A source checkout whose JIT build fails runs the reference kernels, yet reported the sources' digest: beside
    a node running those sources' kernels it trained, on other kernels. It reports ``reference (build failed)``
    now (on a backend that takes these kernels the build is tried when the nodes compare, as it would be at the
    first kernel call), and the two nodes are refused in one line."""
    from omnitron.backends import get_backend

    cpu = get_backend("cpu")
    ours = sources.source_digest(cpp._CSRC)
    _installed(monkeypatch, ours)
    built = software(cpu)
    _source_checkout(monkeypatch)
    _build_fails(monkeypatch)
    failed = software(cpu)
    assert failed["omnitron._C"] == "reference (build failed)", failed
    ok, why = cpp.available()
    assert not ok and "building the C++ kernels failed" in why  # the kernels it runs are the reference indeed
    got = _run_ranks([BASE] * 2, softwares=[built, failed])
    line = str(got[0])
    assert all(isinstance(e, ConfigError) and str(e) == line for e in got) and "\n" not in line, got
    assert f"omnitron._C reference (build failed) on rank 1, sources #{ours} on rank 0." in line, line
    # two nodes that both failed run the same (reference) kernels: they agree
    assert _run_ranks([BASE] * 2, softwares=[failed, failed]) == [None, None]


def test_no_build_is_tried_for_a_backend_that_does_not_take_the_kernels(monkeypatch):
    """``OMNITRON_KERNELS=reference`` (or a backend they do not register for) never calls these kernels: the
    comparison does not build them (30-60 s) and reports the sources as before."""
    from omnitron.backends import get_backend, registry

    _source_checkout(monkeypatch)
    _build_fails(monkeypatch)
    monkeypatch.setenv("OMNITRON_KERNELS", "reference")
    registry.reset_cache()
    try:
        assert software(get_backend("cpu"))["omnitron._C"] == f"sources #{sources.source_digest(cpp._CSRC)}"
        assert cpp._state == {}
    finally:
        registry.reset_cache()


@pytest.mark.parametrize("version, std", [("2.13.0+cpu", "-std=c++17"), ("2.9.1", "-std=c++17"),
                                          ("2.14.1", "-std=c++20"), ("2.15.0a0+git", "-std=c++20")])
def test_the_jit_build_uses_setups_standard_and_carries_the_digest(monkeypatch, tmp_path, version, std):
    """The JIT build passed -std=c++17 whatever the torch (setup.py: C++20 from torch 2.14, whose headers use
    concepts), so a source checkout on torch >= 2.14 could not build its kernels; it now takes setup.py's flags
    and the sources' digest."""
    from torch.utils import cpp_extension

    seen = {}
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setenv("OMNITRON_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.update(kw))
    cpp._jit_build()
    flags = seen["extra_cflags"]
    assert std in flags and [f for f in flags if f.startswith("-std=")] == [std], flags
    assert f"-DOMNITRON_SOURCE_DIGEST=src_{sources.source_digest(cpp._CSRC)}" in flags, flags


def test_the_built_extension_says_which_sources_it_was_built_from():
    """The installed (or in-place built) ``omnitron._C`` carries the digest of this checkout's sources (a build
    older than the digest is skipped): setup.py's build and the JIT build agree on what they compiled."""
    try:
        from omnitron import _C
    except ImportError:
        pytest.skip("omnitron._C is not built here")
    if not hasattr(_C, "source_digest"):
        pytest.skip("omnitron._C was built before it carried its sources' digest; rebuild: python setup.py build_ext")
    assert _C.source_digest == sources.DIGEST_PREFIX + sources.source_digest(cpp._CSRC), (
        "omnitron._C was built from other sources than csrc/ holds; rebuild: python setup.py build_ext --inplace")
