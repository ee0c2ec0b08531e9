"""``torch.save`` files from other programs, loaded so that no code they name can run.

Files written by other programs (Megatron's ``model_optim_rng.pt``, a hub's ``pytorch_model.bin``)
are untrusted. :func:`load_untrusted` reads them in two passes:

1. The file's pickles are read opcode by opcode with :mod:`pickletools` (which builds nothing) and
   every global they name is checked against exact ``module.name`` strings: torch.save's own (dtypes,
   storages, the tensor / parameter rebuild functions), the caller's ``extra`` classes, and inert
   :class:`Opaque` placeholders for names the caller vouches for (Megatron's enums). Refused, in one
   line naming it: a name with a dot or a dunder part (pickle protocol 4 walks attributes along the
   dots, so ``torch._utils._rebuild_tensor.__builtins__.get`` reaches ``eval``), any name off the
   list, and an opcode torch.save never writes (``STACK_GLOBAL``, ``INST``, ``OBJ``, ``EXT*``).
2. ``torch.load(weights_only=True)`` loads it, with the extras and placeholders admitted under
   their exact names for this call only (``torch.serialization.safe_globals``). torch's own
   allow-list still applies, so a file must pass both; pass 1 chooses the placeholders and names
   what is refused, and safety does not rest on it alone.
"""
from __future__ import annotations

import io
import pickletools
import zipfile
from typing import Callable, Iterator, Mapping

import torch

from omnitron.core.checkpoint.io import (REFUSAL, CheckpointError, quiet_torch_load, torch_load_reason,
                                         zip_record_problem)

_REBUILD = ("torch._utils._rebuild_tensor", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
            "torch._utils._rebuild_parameter_with_state", "torch._tensor._rebuild_from_type_v2")
_CONTAINERS = ("collections.OrderedDict", "_codecs.encode", "builtins.set", "builtins.complex", "builtins.bytearray",
               "torch.Size", "torch.device", "torch.Tensor", "torch.nn.parameter.Parameter")
# opcodes that look up or call a class by a route other than GLOBAL; torch.save (protocol 2) writes none
_REFUSED_OPS = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}
_LEGACY_PICKLES = 5  # a pre-zip torch.save file: magic, protocol, sys info, the object, storage keys


class UnsafeFileError(CheckpointError):
    """A file refused before anything in it is unpickled (names the global or opcode)."""


class Opaque:
    """An object whose class this reader does not import (a Megatron enum, ...): the arguments it
    was built with and its state are kept; no code of the named class runs."""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__}{self.args}>"


def torch_save_names() -> frozenset[str]:
    """The globals ``torch.save`` writes for tensors, parameters and plain containers, exactly."""
    dtypes = {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}  # "torch.float32", ...
    storages = {f"torch.{n}" for n in dir(torch) if n.endswith("Storage") and isinstance(getattr(torch, n), type)}
    return frozenset(dtypes | storages | set(_REBUILD) | set(_CONTAINERS))


def plain_name(module: str, name: str) -> bool:
    """Whether ``module.name`` is a plain import path: identifiers, no dunder part, no dot in ``name``."""
    return all(p.isidentifier() and not p.startswith("__") for p in (*module.split("."), name))


def pickled_globals(path: str, fix: str = "use a file from a trusted source", data: bytes | None = None
                    ) -> Iterator[tuple[str, str]]:
    """Every ``(module, name)`` the pickles of torch.save file ``path`` (or of its bytes ``data``, ``path``
    then naming them) name, in file order, read without unpickling. Lazily, so a caller refusing a name
    stops before a later unreadable part; raises :class:`UnsafeFileError` at a refused opcode (``fix``: the
    remedy it names), :class:`CheckpointError` when it is not a torch.save file."""
    with open(path, "rb") if data is None else io.BytesIO(data) as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch's own test for its zip format
        f.seek(0)
        try:
            if zipped:
                problem = zip_record_problem(f)
                if problem:
                    raise UnsafeFileError(f"{path}: refused: {problem}; {fix}")
                with zipfile.ZipFile(f) as z:
                    streams = [io.BytesIO(z.read(n)) for n in z.namelist() if n.endswith(".pkl")]
                if not streams:
                    raise ValueError("a zip file without data.pkl")
            else:
                streams = [f] * _LEGACY_PICKLES  # consecutive pickles of one file
            for stream in streams:
                yield from _scan(stream, path, fix)
        except UnsafeFileError:
            raise
        except Exception as err:  # bad zip, truncated or foreign pickle
            raise CheckpointError(f"{path}: not a readable torch.save file ({type(err).__name__}: {err})") from None


def _scan(stream, path: str, fix: str) -> Iterator[tuple[str, str]]:
    """The globals of one pickle in ``stream`` (read up to its STOP)."""
    for op, arg, _ in pickletools.genops(stream):
        if op.name in _REFUSED_OPS:
            raise UnsafeFileError(f"{path}: refused as unsafe: its pickle uses opcode {op.name}, which torch.save "
                                  f"never writes (a way to reach code by name); {fix}")
        if op.name == "GLOBAL":
            module, _, name = arg.partition(" ")
            yield module, name


def load_untrusted(path: str, *, what: str, fix: str, extra: Mapping[str, object] | None = None,
                   vouch: Callable[[str, str], bool] = lambda module, name: False, data: bytes | None = None):
    """``torch.load`` of an untrusted file (module docstring), or of its bytes ``data`` (a torch.save
    payload held inside another file; ``path`` then names it). ``extra`` maps exact names to classes
    or functions the file may hold beside tensors; ``vouch(module, name)`` admits other plain names as
    :class:`Opaque` placeholders. ``what`` names the kind of file and ``fix`` the remedy in errors."""
    if not torch.__version__ >= "2.6":
        raise CheckpointError(f"{path}: reading {what} safely needs torch >= 2.6 (torch.serialization.safe_globals "
                              f"with exact names); this is torch {torch.__version__}: upgrade torch")
    allowed, admitted = torch_save_names(), dict(extra or {})
    for module, name in pickled_globals(path, fix, data):
        full = f"{module}.{name}"
        if not plain_name(module, name) or not (full in allowed or full in admitted or vouch(module, name)):
            kind = "a dotted or dunder name" if not plain_name(module, name) else f"not something {what} holds"
            raise UnsafeFileError(f"{path}: refused as unsafe: its pickle names {full!r} ({kind}; loading it could "
                                  f"run code); {fix}")
        if full not in allowed and full not in admitted:
            admitted[full] = type(name, (Opaque,), {"__module__": module, "__qualname__": name})
    with torch.serialization.safe_globals([(obj, full) for full, obj in admitted.items()]), quiet_torch_load():
        try:
            return torch.load(path if data is None else io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:
            raise _load_error(path, err, fix) from None


def _load_error(path: str, err: Exception, fix: str) -> CheckpointError:
    """One line for a failed ``torch.load``: torch's refusal without its advice to load unsafely."""
    why = torch_load_reason(err)
    if why.startswith(REFUSAL):
        return UnsafeFileError(f"{path}: refused as unsafe by torch's weights-only loader "
                               f"({why.removeprefix(REFUSAL)}); {fix}")
    return CheckpointError(f"{path}: not a readable torch.save file ({why})")

