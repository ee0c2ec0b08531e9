"""Which checkpoint a run with ``--load`` resumes: ``--load``'s latest (or ``--ckpt-step``'s) or the non-persistent
one. Its own module so that reading a checkpoint's arguments (``--use-checkpoint-args``, parsed before the training
modules exist) and loading it choose by one rule."""
from __future__ import annotations

import logging
import os

from omnitron.core.checkpoint import find_latest, read_metadata

log = logging.getLogger("omnitron.train")

NON_PERSISTENT_SUBDIR = "non_persistent"  # Megatron's _NON_PERSISTENT_CKPT_SUBDIR


def non_persistent_dir(ck, base: str | None) -> str | None:
    """--non-persistent-global-ckpt-dir, else ``base/non_persistent`` (``base``: --save when saving, --load when
    loading, as Megatron's save_checkpoint and _load_base_checkpoint); None without the ``global`` type."""
    if ck.non_persistent_ckpt_type != "global":
        return None
    return ck.non_persistent_global_ckpt_dir or (os.path.join(base, NON_PERSISTENT_SUBDIR) if base else None)


def resume_path(ck, quiet: bool) -> str | None:
    """The checkpoint a run with --load resumes: --load's latest (or --ckpt-step's), or, with
    --non-persistent-ckpt-type global, the non-persistent one when it is at least as new (Megatron's
    _load_base_checkpoint: ``non_persistent_iteration >= iteration``); None: neither exists."""
    path = find_latest(ck.load, quiet=quiet, step=ck.ckpt_step)
    other = non_persistent_dir(ck, ck.load)
    if other is None or ck.ckpt_step is not None or not os.path.isdir(other):  # --ckpt-step: the one asked for
        return path
    newest = find_latest(other, quiet=True)
    if newest is None:
        return path
    if path is not None and read_metadata(newest)["iteration"] < read_metadata(path)["iteration"]:
        if not quiet:
            log.info("--load %s: the non-persistent checkpoint %s is older than %s: resuming the latter", ck.load,
                     newest, os.path.basename(path))
        return path
    if not quiet:
        log.info("--load %s: resuming the non-persistent checkpoint %s (as new as or newer than --load's latest%s)",
                 ck.load, newest, f", {os.path.basename(path)}" if path else ": none")
    return newest
