"""Refuse a model that cannot fit before anything is allocated: a rank's parameters, gradients and optimizer state
against its device's whole memory.

An absurd size (``--hidden-size 1000000``) used to die in the allocator during the model build, a raw traceback
from every rank. The bytes come from the planner's exact count on a meta-device skeleton
(:func:`omnitron.plan.state.state_bytes`: the run's own chunks, gradient buffers and optimizer state, no storage).
They are a lower bound of what the rank holds (activations, communication buffers and the allocator's slack come
on top), and the device's total memory an upper bound of what it can hold, so only a run that cannot fit is
refused; a run near the limit is left to train (and to the memory planner, ``omnitron plan``).
"""
from __future__ import annotations

import logging

from omnitron.core.config.parallel import ConfigError

log = logging.getLogger(__name__)


def state_peak(settings) -> tuple[int, int]:
    """``(bytes, pipeline stage)``: the largest parameter + gradient + optimizer-state bytes of one rank, over the
    stages (tp / dp / cp ranks of a stage hold the same up to the distributed optimizer's slices; the largest
    slice is counted)."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.state import state_bytes

    cfg = model_config(settings)
    best = (0, 0)
    for r in range(settings.parallel.pipeline_model_parallel_size):
        st = state_bytes(settings, cfg, r)
        best = max(best, (st.params + st.grads + st.optimizer, r))
    return best


def check_fits(settings, backend) -> None:
    """ConfigError when one rank's parameters, gradients and optimizer state alone exceed the total memory of the
    backend's device (``capabilities().memory_total``, the fact the launcher already asked for: no device memory is
    touched; no check where the device cannot say, nor for a model family the count cannot build on the meta
    device: the run then meets its limits as before, and the reason is logged as a warning).

    Every rank counts (under torchrun too: a rank that skipped it would wait in the process group's start for
    a refused local rank 0, and ignore torchrun's first SIGTERM there: 30 s, then SIGKILL); the count takes well
    under a second for a 70B model (the meta build skips weight initialisation)."""
    total = backend.capabilities().memory_total
    if not total:
        return
    try:
        need, stage = state_peak(settings)
    except Exception as err:  # noqa: BLE001  a family's own build, off the meta device: no count, no refusal
        log.warning("the model's state bytes could not be counted before the build (%s: %s); not checked against "
                    "the device's memory", type(err).__name__, err)
        return
    if need <= total:
        return
    where = f"pipeline stage {stage}'s ranks hold" if settings.parallel.pipeline_model_parallel_size > 1 else \
        "each rank holds"
    raise ConfigError(f"the model does not fit: {where} {_size(need)} of parameters, gradients and optimizer "
                      f"state before any activation, more than the {backend.name} device's {_size(total)}; "
                      f"shrink the model (--hidden-size, --num-layers, --ffn-hidden-size) or spread it over more "
                      f"ranks (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
                      f"--use-distributed-optimizer); omnitron plan prices layouts")


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.3f} MiB"
