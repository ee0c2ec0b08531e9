"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: how megatron-core cuts a gradient buffer
into buckets (``_compute_default_per_buffer_param_layout`` of megatron/core/distributed/param_and_grad_buffer.py,
the layout without the distributed optimizer's padding), for random parameter sizes and bucket sizes.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU, offline. Run from the
omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/optim/megatron_buckets/make_fixtures.py

omnitron is not imported. Each case stores the parameter sizes in registration (forward) order, the bucket size,
and Megatron's bucket ranges ``[start, end)`` and each parameter's ``(start, end, bucket)``. Half of the bucket
sizes are a running sum of the backward-ordered sizes, so a bucket reaches its size exactly (Megatron closes a
bucket at ``>=``).
"""
from __future__ import annotations

import json
import os
import sys
import typing

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
CASES, SEED = 24, 20261207


def main() -> None:
    sys.path.insert(0, os.environ.get("MEGATRON_LM", "/tmp/megatron"))
    import torch
    from megatron.core.distributed.param_and_grad_buffer import _compute_default_per_buffer_param_layout

    rng = np.random.RandomState(SEED)
    cases = []
    for k in range(CASES):
        sizes = [int(n) for n in rng.randint(1, 60, rng.randint(1, 13))]
        running = np.cumsum(sizes[::-1])
        bucket = int(running[rng.randint(len(running))]) if k % 2 == 0 else int(rng.randint(1, sum(sizes) + 20))
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        layout = _compute_default_per_buffer_param_layout(params, bucket)
        cases.append({"sizes": sizes, "bucket_size": bucket,
                      "buckets": [list(b) for b in layout.bucket_indices],
                      "params": [list(layout.param_index_map[p]) for p in params]})
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump({"megatron": "d98e8a64dd", "cases": cases}, f, indent=None)
        f.write("\n")


if __name__ == "__main__":
    main()
