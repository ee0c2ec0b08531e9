"""Backend selection: ``OMNITRON_BACKEND=cpu|cuda|musa|sim|auto`` plus out-of-tree plug-ins.

A vendor outside this repository ships a package that declares an entry point in the group
``omnitron.backends`` (``name = "pkg.module:BackendClass"``); it is found here without any
change to omnitron. ``OMNITRON_EXTRA_BACKENDS="name=pkg.module:Class,..."`` adds backends the
same way without packaging (a backend under development, or a test double such as
``omnitron.testing.musa_double``); it is read in every process, so spawned workers see it too.
``OMNITRON_COLLECTIVES=host-staged`` runs the chosen backend's collectives over gloo on host copies
(``backends/staged.py``: several ranks on one device, or a chip whose collective library is not ready).
"""
from __future__ import annotations

import importlib
import os
from importlib import metadata

from omnitron.backends import staged
from omnitron.backends.base import Backend

ENV_VAR = "OMNITRON_BACKEND"
EXTRA_ENV_VAR = "OMNITRON_EXTRA_BACKENDS"
AUTO_ORDER = ("musa", "cuda", "cpu")
_BUILTIN = {
    "cpu": "omnitron.backends.cpu:CPUBackend",
    "cuda": "omnitron.backends.cuda:CUDABackend",
    "musa": "omnitron.backends.musa:MUSABackend",
    "sim": "omnitron.backends.sim:SimBackend",
}
_instances: dict[str, Backend] = {}


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here; the message lists every backend and why."""


def _plugin_entry_points() -> list:
    try:
        return list(metadata.entry_points(group="omnitron.backends"))
    except TypeError:  # Python < 3.10 API
        return list(metadata.entry_points().get("omnitron.backends", []))


def _entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in _plugin_entry_points()}


def _dist_of(name: str, target: str, eps: list | None):
    """The installed distribution whose entry point makes backend ``name`` as ``target`` (None: there is none)."""
    eps = _plugin_entry_points() if eps is None else eps
    return next((getattr(ep, "dist", None) for ep in eps if ep.name == name and ep.value == target), None)


PINNED = ("omnitron", "torch")
"""The installed packages a plug-in's requirements are checked against before it is imported: the contract it was
written for (omnitron's) and the torch its compiled parts were built against."""


def version_problem(name: str, target: str, eps: list | None = None) -> str | None:
    """Why the installed package whose entry point makes backend ``name`` (as ``target``) was not made for the
    omnitron or torch running here, from the requirements pip recorded for it (None: it was, or it is no installed
    package). pip installs a plug-in beside an omnitron outside its range with ``--no-deps`` and keeps it, with a
    warning, when omnitron or torch is upgraded under it; importing it then fails in its own code, or not at all.
    ``eps``: the entry points, when the caller read them already (reading them scans every installed package)."""
    if _BUILTIN.get(name) == target:
        return None
    dist = _dist_of(name, target, eps)
    if dist is None or not dist.requires:
        return None
    import torch
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    import omnitron

    running = {"omnitron": omnitron.__version__, "torch": torch.__version__}
    for line in dist.requires:
        req = Requirement(line)
        key = canonicalize_name(req.name)
        if key not in PINNED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(running[key], prereleases=True):
            plugin = f"{dist.metadata['Name']} {dist.version}"
            return (f"the plug-in package {plugin} requires {req.name}{req.specifier}, and {key} {running[key]} is "
                    f"installed: install a release of {dist.metadata['Name']} made for {key} {running[key]} (or "
                    f"{req.name}{req.specifier} in an environment of its own)")
    return None


def _extra_backends() -> dict[str, str]:
    found = {}
    for item in filter(None, (s.strip() for s in os.environ.get(EXTRA_ENV_VAR, "").split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise BackendUnavailableError(f"{EXTRA_ENV_VAR} entry {item!r} is not name=module:Class (for example "
                                          "mychip=mychip_omnitron.backend:MyChipBackend): correct it or unset it")
        found[name.strip().lower()] = target.strip()
    return found


def known_backends() -> dict[str, str]:
    """Backend name -> ``module:Class`` for built-ins, installed plug-ins and ``$OMNITRON_EXTRA_BACKENDS``."""
    found = dict(_BUILTIN)
    found.update(_entry_points())
    found.update(_extra_backends())
    return found


class PluginContractError(TypeError):
    """A backend class that does not meet the contract (its message names what to implement)."""


def _load_class(target: str) -> type[Backend]:
    """The backend class ``module:Class`` names, refused when it could not be instantiated: a plug-in missing one
    of the contract's methods is "not usable" with their names here, not a traceback after it was reported usable."""
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise PluginContractError(f"{target} is not an omnitron Backend subclass (docs/backends.md, section 1)")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise PluginContractError(f"{cls.__name__} does not implement {', '.join(missing)}: implement every abstract "
                                  "method of omnitron.backends.base.Backend (docs/backends.md, section 1)")
    return cls


def probe_all() -> dict[str, tuple[bool, str]]:
    """Every known backend with (usable, reason)."""
    report, eps = {}, _plugin_entry_points()
    for name, target in known_backends().items():
        report[name] = _probe(name, target, eps)[:2]
    return report


def _probe(name: str, target: str, eps: list | None = None) -> tuple[bool, str, type[Backend] | None]:
    """(usable, reason, class) of backend ``name`` at ``target``: a plug-in package made for another omnitron or
    torch is refused before it is imported, and one that fails to load is "not usable" with the reason (a broken
    plug-in must not hide the others)."""
    try:
        problem = version_problem(name, target, eps)
        if problem is not None:
            return False, problem, None
        cls = _load_class(target)
        return (*cls.probe(), cls)
    except PluginContractError as err:
        return False, f"failed to load {target}: {err}", None
    except Exception as err:  # noqa: BLE001 - the plug-in's import or probe: what failed, whose, and the way out
        return False, f"failed to load {target}: {type(err).__name__}: {err}{_way_out(name, target, eps)}", None


def _way_out(name: str, target: str, eps: list | None) -> str:
    """How to fix or remove the plug-in behind backend ``name`` (empty for a built-in: omnitron's own)."""
    if _BUILTIN.get(name) == target:
        return ""
    if _extra_backends().get(name) == target:
        return f"; install what it needs, or remove {name}={target} from {EXTRA_ENV_VAR}"
    dist = _dist_of(name, target, eps)
    package = dist.metadata["Name"] if dist is not None else "the package that declares it"
    return f"; install what it needs, or uninstall the plug-in (pip uninstall {package})"


def _explain(report: dict[str, tuple[bool, str]]) -> str:
    return "\n".join(f"  {n}: {'usable' if ok else 'not usable'} — {why}" for n, (ok, why) in report.items())


_auto_choice: list[str] = []


def resolve_name(name: str | None = None) -> str:
    """The backend name to use: ``name``, else ``$OMNITRON_BACKEND``, else ``auto``.

    The ``auto`` choice is probed once per process (probing imports every plug-in: ~30 ms) and
    cached, so hot paths may call :func:`get_backend` freely."""
    name = (name or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if name != "auto":
        return name
    if _auto_choice:
        return _auto_choice[0]
    report = probe_all()
    for candidate in AUTO_ORDER:
        if report.get(candidate, (False, ""))[0]:
            _auto_choice.append(candidate)
            return candidate
    raise BackendUnavailableError("no backend is usable:\n" + _explain(report))


def get_backend(name: str | None = None) -> Backend:
    """The (cached) backend instance for ``name`` / ``$OMNITRON_BACKEND`` / auto.

    Raises :class:`BackendUnavailableError` naming every backend and why it is or is not usable.
    """
    name = resolve_name(name)
    if name in _instances:
        return _instances[name]
    known = known_backends()
    if name not in known:
        raise BackendUnavailableError(
            f"unknown backend {name!r} (set {ENV_VAR} to one of: auto, {', '.join(known)}):\n" + _explain(probe_all()))
    ok, why, cls = _probe(name, known[name])
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} cannot run here: {why}\nall backends:\n"
                                      + _explain(probe_all()))
    try:
        cls = staged.apply(cls)
    except ValueError as err:
        raise BackendUnavailableError(str(err)) from None
    _instances[name] = cls()
    _instances[name]._registry_name = name  # the name chosen, where the class's own differs (Backend.label)
    return _instances[name]


def reset_cache() -> None:
    """Forget cached backend instances and the auto choice (tests that swap backends or test doubles)."""
    _instances.clear()
    _auto_choice.clear()
