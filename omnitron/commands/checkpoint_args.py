"""What the ``omnitron checkpoint`` actions share (and ``generate`` / ``serve``, which read checkpoints too):
the ``--model-family-module`` flag, resolving a checkpoint directory, the one-line failure, the plain
``export`` action (``export-hf`` reuses it with its own writer). Kept apart from
:mod:`omnitron.commands.checkpoint`, which registers :mod:`~omnitron.commands.hf` and
:mod:`~omnitron.commands.megatron`, so that those import nothing that imports them.
"""
from __future__ import annotations

import argparse
import os
import sys


def add_family_module_flag(p) -> None:
    """``--model-family-module`` on a command that reads an omnitron checkpoint (``omnitron.cli.main``
    imports the modules before parsing): the way to load a checkpoint of a family of the user's own."""
    p.add_argument("--model-family-module", action="append", metavar="MODULE", help="import MODULE first: the "
                   "model family of your own the checkpoint was trained with (a checkpoint never imports the "
                   "modules it names; repeatable)")


def resolve(path: str) -> str:
    """An ``iter_N`` directory from a --save directory (its latest) or an ``iter_N`` directory."""
    from omnitron.core.checkpoint import CheckpointError, find_latest

    if os.path.exists(os.path.join(path, "metadata.json")):
        return path
    found = find_latest(path)
    if found is None:
        raise CheckpointError(f"{path}: no checkpoint there (no metadata.json, no 'latest', no iter_* directory)")
    return found


def check_output(flag: str, path: str, *, file: bool = False) -> None:
    """Before any work: ``path`` (a directory; with ``file``, a file to write) can be written, else ConfigError
    in one line naming ``flag``, the path and the fix (the check training applies to ``--save``)."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.outputs import probe_writable

    if not file:
        return probe_writable(flag, path)
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give the name of the file to write")
    probe_writable(flag, os.path.dirname(os.path.abspath(path)), shown=path,
                   fix="give a file path in a directory this job can write")


def check_save(flag: str, save: str, load: str, path: str) -> None:
    """Before any work, for a command writing checkpoint ``path`` (an ``iter_N`` that ``--load`` ``load``
    resolved to) as the same iteration under ``save``: ``save`` is writable, is not the ``--load`` directory
    and holds no such ``iter_N`` yet (:func:`~omnitron.core.checkpoint.io.refuse_overwrite`)."""
    from omnitron.core.checkpoint.io import read_metadata, refuse_overwrite

    refuse_overwrite(save, read_metadata(path)["iteration"], load=(load, path), flag=flag)
    check_output(flag, save)


def fail(what: str, err: Exception) -> int:
    print(f"omnitron checkpoint {what}: error: {err}", file=sys.stderr)
    return 2


def run_export(args: argparse.Namespace, *, what: str = "export", write=None, note: str = "",
               out_dir: bool = False) -> int:
    """``export`` (``write`` = export_safetensors, ``--out`` a file); ``export-hf`` passes its own writer and
    wording (``out_dir``: ``--out`` is a directory)."""
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.reshard import export_safetensors
    from omnitron.core.config.parallel import ConfigError

    try:
        check_output("--out", args.out, file=not out_dir)
        path = resolve(args.load)
        n = (write or export_safetensors)(path, args.out)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        return fail(what, err)
    print(f"exported {n:,} parameters of {path} to {args.out}{note}")
    return 0
