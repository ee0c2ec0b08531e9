"""Training runs inside a spawned test worker (``omnitron.testing.distributed.run_distributed``)."""
from __future__ import annotations

import os
from typing import Callable


def worker_runner(make_args: Callable, root: str) -> Callable:
    """``run(layout, save, *extra)``: train with ``make_args(layout, root/save, extra)`` on this
    worker's world (one thread per process); returns ``train``'s result (losses, components)."""
    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be, world = get_backend(), dist.get_world_size()

    def run(layout, save, *extra):
        if "--load" in extra:  # a run that loads to compare states takes the checkpoint's schedule whatever its
            extra = (*extra, "--use-checkpoint-opt_param-scheduler")  # --train-iters
        return train(parse_settings(make_args(layout, os.path.join(root, save), extra), world), be)

    return run


def settings_in(argv: list[str], world: int, dtype=None):
    """``parse_settings(argv, world)`` with the model's parameters in ``dtype`` when given (float64 for a
    layout-parity test: no flag asks for a float64 model, and float64 end to end lets such a test bound the
    layouts' difference by float64 reordering instead of float32's)."""
    import dataclasses

    import torch

    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(argv, world)
    if dtype is None:
        return s
    if s.model.params_dtype != torch.float32:  # --bf16 / --fp16: its masters, scaler and casts assume that dtype
        raise ValueError(f"settings_in: {dtype} parameters replace float32 ones only, not the "
                         f"{s.model.params_dtype} of a precision flag; drop --bf16 / --fp16 or the dtype")
    return dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=dtype))
