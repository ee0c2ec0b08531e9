"""Atomic per-rank checkpoints with a ``latest`` pointer, compatibility checks and RNG capture.

Layout of ``--save DIR``::

    DIR/latest                    "iter_0000100" (written last, by rename)
    DIR/iter_0000100/metadata.json iteration, consumed samples, config, layout, shard list
    DIR/iter_0000100/rank_00003.pt this rank's model chunks, optimizer, scheduler, RNG, sampler

See :mod:`omnitron.core.checkpoint.io`.
"""
from omnitron.core.checkpoint.io import (CheckpointError, check_compatible, find_latest, load_checkpoint,
                                         read_metadata, save_checkpoint)
from omnitron.core.checkpoint.rng import get_rng_state, set_rng_state

__all__ = ["CheckpointError", "check_compatible", "find_latest", "get_rng_state", "load_checkpoint", "read_metadata",
           "save_checkpoint", "set_rng_state"]
