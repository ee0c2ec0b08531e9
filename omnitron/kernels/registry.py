"""The kernel registry: named fused ops, each with a plain-PyTorch reference and fast versions.

An implementation declares where it can run (``available``: library present, backend match)
and what calls it accepts (``supports``: returns None, or the reason it cannot take this call).
A call no fast version accepts runs the reference, and the reason is logged once per
(op, implementation, reason). ``OMNITRON_KERNELS`` overrides the choice:

* ``OMNITRON_KERNELS=reference`` forces every op onto its reference;
* ``OMNITRON_KERNELS=triton,reference`` sets the preference order for every op;
* ``OMNITRON_KERNELS=rms_norm=triton,swiglu=reference`` pins single ops (may be mixed with the above); a pinned
  kernel that cannot run on this backend is refused when the table is built, and a call it declines raises.

Under ``torch.compile`` (``--torch-compile``) a call only goes to an implementation marked ``traceable``
(plain torch / ATen ops the compiler traces and fuses; every reference is one); the others (pybind C++
functions, raw Triton launches) would each split the compiled graph, so the reference runs in their place
and the compiler generates the fused kernel itself. Eager calls are unaffected.
"""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("omnitron.kernels")

REFERENCE = "reference"
ENV_VAR = "OMNITRON_KERNELS"


def _always() -> tuple[bool, str]:
    return True, ""


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op."""

    op: str
    name: str
    fn: Callable
    available: Callable[[], tuple[bool, str]] = _always
    """() -> (usable in this process?, reason when not)."""
    supports: Callable[..., str | None] | None = None
    """Called with the op's arguments; None when this call is accepted, else the reason it is not."""
    backends: tuple[str, ...] | None = None
    """Backends allowed to select this implementation (None: any)."""
    traceable: bool = False
    """True when ``torch.compile`` traces ``fn`` without a graph break (plain torch / ATen calls only)."""


_OPS: dict[str, dict[str, Implementation]] = {}


class KernelContractError(RuntimeError):
    """A backend's kernels break the registry's contract (their module fails to import, or an implementation cannot
    take every call its op's reference takes); raised in one line naming the fix when the backend's table is built."""


def signature_problem(impl: Implementation, reference: Implementation) -> str | None:
    """Why ``impl`` cannot take every call its op's reference takes, or None. Callers pass an op's arguments as the
    reference declares them, positionally or by name and relying on its defaults, so an implementation must accept
    each of the reference's parameters by the same name (a positional one at the same position) with the same
    default, and need nothing more; otherwise the first call fails mid-run, or a default silently differs."""
    try:
        got, want = inspect.signature(impl.fn).parameters, inspect.signature(reference.fn).parameters
    except (TypeError, ValueError):  # a compiled function without a signature: the conformance suite judges it
        return None
    kinds = {p.kind for p in got.values()}
    if {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return None  # a wrapper passing everything on: the conformance suite judges what it calls
    order = [n for n, p in got.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, (name, ref) in enumerate(want.items()):
        mine = got.get(name)
        if mine is None and ref.kind is ref.KEYWORD_ONLY and inspect.Parameter.VAR_KEYWORD in kinds:
            continue
        if mine is None or mine.kind is mine.POSITIONAL_ONLY:
            return f"it has no parameter {name!r}"
        if ref.kind is ref.POSITIONAL_OR_KEYWORD and (i >= len(order) or order[i] != name):
            return f"{name!r} is not its parameter {i + 1}"
        if ref.default is not ref.empty and ref.default is not mine.default and ref.default != mine.default:
            return f"the default of {name!r} is {_default(mine)}, the reference's {_default(ref)}"
    extra = [n for n, p in got.items() if n not in want and p.default is p.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"it requires {', '.join(map(repr, extra))}, which the reference does not take" if extra else None


def register(op: str, name: str, fn: Callable | None = None, *, available=None, supports=None, backends=None,
             traceable: bool | None = None):
    """Register ``fn`` as implementation ``name`` of ``op``; usable as a decorator when ``fn`` is None.
    ``traceable`` defaults to True for the reference (plain torch by contract), False otherwise."""

    def _do(f: Callable) -> Callable:
        impls = _OPS.setdefault(op, {})
        impls[name] = Implementation(op, name, f, available or _always, supports,
                                     tuple(backends) if backends else None,
                                     name == REFERENCE if traceable is None else traceable)
        return f

    return _do(fn) if fn is not None else _do


def ops() -> list[str]:
    """Names of every registered op."""
    _ensure_loaded()
    return sorted(_OPS)


def implementations(op: str) -> dict[str, Implementation]:
    """Every registered implementation of ``op`` (usable here or not)."""
    _ensure_loaded()
    if op not in _OPS:
        raise KeyError(f"unknown kernel op {op!r}; known ops: {', '.join(sorted(_OPS))}")
    return dict(_OPS[op])


def get_impl(op: str, name: str = REFERENCE) -> Callable:
    """The callable of implementation ``name`` of ``op``, no fall-back (for tests and benchmarks)."""
    impls = implementations(op)
    if name not in impls:
        raise KeyError(f"op {op!r} has no implementation {name!r}; it has: {', '.join(impls)}")
    ok, why = impls[name].available()
    if not ok:
        raise RuntimeError(f"implementation {name!r} of {op!r} is not usable here: {why}")
    return impls[name].fn


def _parse_env() -> tuple[tuple[str, ...] | None, dict[str, str]]:
    raw = os.environ.get(ENV_VAR, "").strip()
    order: list[str] = []
    pins: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        if "=" in item:
            op, name = item.split("=", 1)
            pins[op.strip()] = name.strip()
        else:
            order.append(item)
    return (tuple(order) if order else None), pins


class _Dispatcher:
    """Callable for one op: the first accepting candidate runs; the reference closes the list."""

    def __init__(self, op: str, candidates: list[Implementation], reference: Implementation,
                 pinned: bool = False) -> None:
        self.op, self.candidates, self.reference, self.pinned = op, candidates, reference, pinned
        self._said: set[tuple[str, str]] = set()
        self.ran: dict[str, int] = {}
        """Eager calls per implementation name (the dispatch log: which kernel really ran)."""
        self.__doc__ = reference.fn.__doc__

    def __call__(self, *args, **kwargs):
        compiling = torch.compiler.is_compiling()  # a constant while dynamo traces: the branch is free
        for impl in self.candidates:
            if compiling and not impl.traceable:
                continue  # would break the graph; the reference traces and the compiler fuses it
            why = impl.supports(*args, **kwargs) if impl.supports is not None else None
            if why is None:
                if not compiling:
                    self.ran[impl.name] = self.ran.get(impl.name, 0) + 1
                return impl.fn(*args, **kwargs)
            if self.pinned and not compiling:
                raise KernelContractError(f"{ENV_VAR}: {self.op}={impl.name}: {impl.name!r} declined a call ({why}), "
                                          f"which would run the reference; unset the pin for this model")
            if not compiling and (impl.name, why) not in self._said:
                self._said.add((impl.name, why))
                log.info("kernel %s: %s declined this call (%s); running the reference", self.op, impl.name, why)
        if not compiling:
            self.ran[REFERENCE] = self.ran.get(REFERENCE, 0) + 1
        return self.reference.fn(*args, **kwargs)

    @property
    def chosen(self) -> str:
        """Name of the implementation tried first."""
        return self.candidates[0].name if self.candidates else REFERENCE


def _default(p: inspect.Parameter) -> str:
    return "none" if p.default is p.empty else repr(p.default)


def _plain(fn: Callable) -> str:
    """``fn``'s parameters as written, without annotations (for a one-line message)."""
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                           return_annotation=sig.empty))


def _check_signature(impl: Implementation, reference: Implementation, backend: str) -> None:
    """Refuse ``impl`` for ``backend``'s table in one line when it, or its ``supports`` (called with the same
    arguments before every call), cannot take the reference's calls: a ``supports`` whose parameters differ is
    handed the wrong values or raises a TypeError at the first layer of every worker."""
    for what, fn in (("kernel", impl.fn), ("'supports' of kernel", impl.supports)):
        why = None if fn is None else signature_problem(Implementation(impl.op, impl.name, fn), reference)
        if why is not None:
            raise KernelContractError(
                f"{what} {impl.name!r} of {impl.op!r} (backend {backend}) cannot take the reference's calls: {why}; "
                f"give it the reference's signature {impl.op}{_plain(reference.fn)} (docs/backends.md, "
                f"section 2), or pin the reference with {ENV_VAR}={impl.op}={REFERENCE}")


def _unusable_pin(op: str, name: str, backend: str, why: str) -> KernelContractError:
    """The one-line refusal of a pin naming an implementation registered here but not usable on ``backend``."""
    return KernelContractError(f"{ENV_VAR}: {op}={name}: {name!r} cannot run here ({why}), so the pin would run "
                               f"the reference; run on a backend it supports, or unset the pin")


def _check_pins(pins: dict[str, str]) -> None:
    """Refuse an ``op=name`` pin naming no op, or no implementation of it registered in this process: a typo would
    otherwise run the reference silently (the run a parity check meant to pin the vendor's kernel for)."""
    for op, name in pins.items():
        if op not in ops():
            raise KernelContractError(f"{ENV_VAR}: {op}={name}: there is no op {op!r} (ops: {', '.join(ops())})")
        if name not in _OPS[op]:
            raise KernelContractError(f"{ENV_VAR}: {op}={name}: {op} has no implementation {name!r} here (registered: "
                                      f"{', '.join(sorted(_OPS[op]))}); correct the name or unset {ENV_VAR}")


class KernelTable:
    """The ops resolved for one backend: ``table.rms_norm(x, w, eps)`` runs the best usable version."""

    def __init__(self, backend: str, preference: tuple[str, ...]) -> None:
        self.backend = backend
        self.env = os.environ.get(ENV_VAR, "").strip()
        """The ``OMNITRON_KERNELS`` it was resolved under (a table outliving a changed one is stale)."""
        order, pins = _parse_env()
        _check_pins(pins)
        self.preference = order or preference
        self.pins = pins
        self._cache: dict[str, _Dispatcher] = {}

    def _candidates(self, op: str) -> tuple[list[Implementation], Implementation]:
        impls = implementations(op)
        if REFERENCE not in impls:
            raise RuntimeError(f"op {op!r} has no reference implementation (every op must have one)")
        pinned = op in self.pins
        names = (self.pins[op],) if pinned else self.preference
        chosen = []
        for name in names:
            impl = impls.get(name)
            if impl is None or name == REFERENCE:
                if name == REFERENCE:
                    break
                continue
            if impl.backends is not None and self.backend not in impl.backends:
                if pinned:
                    raise _unusable_pin(op, name, self.backend, f"it is registered for backend(s) "
                                        f"{', '.join(impl.backends)}, not {self.backend}")
                continue
            ok, why = impl.available()
            if ok:
                _check_signature(impl, impls[REFERENCE], self.backend)
                chosen.append(impl)
            elif pinned:
                raise _unusable_pin(op, name, self.backend, f"unavailable: {why}")
            else:
                log.debug("kernel %s: %s unavailable (%s)", op, name, why)
        return chosen, impls[REFERENCE]

    def get(self, op: str) -> _Dispatcher:
        if op not in self._cache:
            chosen, ref = self._candidates(op)
            self._cache[op] = _Dispatcher(op, chosen, ref, pinned=op in self.pins)
        return self._cache[op]

    def __getattr__(self, op: str) -> _Dispatcher:
        if op.startswith("_"):
            raise AttributeError(op)
        try:
            return self.get(op)
        except KeyError as err:
            raise AttributeError(str(err)) from None

    def resolved(self, op: str) -> str:
        """Name of the implementation this backend tries first for ``op``."""
        return self.get(op).chosen

    def table(self) -> dict[str, str]:
        """op -> implementation tried first, for every op."""
        return {op: self.resolved(op) for op in ops()}


_loaded = False


def _ensure_loaded() -> None:
    """Import the modules that register implementations (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib

    for mod in ("omnitron.kernels.reference", "omnitron.kernels.cpp", "omnitron.kernels.triton_kernels"):
        try:
            importlib.import_module(mod)
        except ImportError as err:
            if not mod.endswith("reference") and (err.name or "").startswith("omnitron.kernels"):
                continue  # optional implementation family not present in this tree
            if mod.endswith("reference"):
                raise
            log.debug("kernel family %s not loaded: %s", mod, err)
