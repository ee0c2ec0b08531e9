"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: what Megatron's ``validate_args`` makes of
the mixed-precision flags (gradient accumulation dtype, the non-finite check, the loss scaler's settings) and the
warnings it raises on the way, for omnitron's parser to reproduce.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU, offline. Run from the
omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_precision/make_fixtures.py

(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.) omnitron is not imported.
"""
from __future__ import annotations

import json
import os
import sys
import typing
import warnings

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256", "--train-iters", "4"]
"""The model flags Megatron's parser needs (the settings read here do not depend on them)."""
CASES = [
    "--bf16", "--bf16 --grad-reduce-in-bf16", "--bf16 --accumulate-allreduce-grads-in-fp32",
    "--bf16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32",
    "--fp16", "--fp16 --accumulate-allreduce-grads-in-fp32",
    "--fp16 --grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16",
    "--grad-reduce-in-bf16 --accumulate-allreduce-grads-in-fp32", "",
    "--fp16 --loss-scale 1024", "--fp16 --no-check-for-nan-in-loss-and-grad",
    "--bf16 --no-check-for-nan-in-loss-and-grad",
    "--fp16 --initial-loss-scale 65536 --min-loss-scale 0.5 --loss-scale-window 50 --hysteresis 4",
    "--fp16 --clip-grad 0", "--bf16 --loss-scale 8",
]
KEYS = ("accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "check_for_nan_in_loss_and_grad", "loss_scale",
        "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "clip_grad")


def _validated(flags: str) -> dict:
    """The settings (KEYS, and the parameter dtype's name) and the warnings of ``validate_args(parse_args())``."""
    from megatron.training.arguments import parse_args, validate_args

    sys.argv = ["pretrain_gpt.py", *MODEL, *flags.split()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = validate_args(parse_args(), {})
    out = {k: getattr(args, k) for k in KEYS}
    out["params_dtype"] = str(args.params_dtype).replace("torch.", "")
    out["warnings"] = sorted({str(w.message) for w in caught if "loss" in str(w.message) or "grad" in str(w.message)})
    return out


SCALERS = [  # (initial, min, window, hysteresis, steps, overflow probability, seed)
    (2.0 ** 32, 1.0, 1000, 2, 40, 0.9, 1), (65536.0, 0.5, 3, 2, 60, 0.4, 2), (1024.0, 0.3, 2, 1, 60, 0.5, 3),
    (4096.0, 1.0, 5, 4, 80, 0.3, 4), (8.0, 2.0, 1, 3, 50, 0.6, 5),
]


def _scales(initial, min_scale, window, hysteresis, steps, p, seed) -> dict:
    """Megatron's DynamicGradScaler (as get_megatron_optimizer builds it: growth 2, backoff 0.5) over a random
    overflow sequence: the scale after each update. Its tensors are made on the CPU (it names 'cuda')."""
    import random

    import torch
    from megatron.core.optimizer import grad_scaler

    rng = random.Random(seed)
    found = [rng.random() < p for _ in range(steps)]
    real = torch.tensor
    grad_scaler.torch.tensor = lambda *a, **k: real(*a, **{**k, "device": "cpu"})
    try:
        s = grad_scaler.DynamicGradScaler(initial_scale=initial, min_scale=min_scale, growth_factor=2.0,
                                          backoff_factor=0.5, growth_interval=window, hysteresis=hysteresis)
        after = []
        for inf in found:
            s.update(inf)
            after.append(float(s.scale.item()))
    finally:
        grad_scaler.torch.tensor = real
    return {"initial": initial, "min": min_scale, "window": window, "hysteresis": hysteresis, "found_inf": found,
            "scales": after}


def main() -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    import logging

    logging.disable(logging.WARNING)
    fixtures = {"model": MODEL, "cases": {flags: _validated(flags) for flags in CASES},
                "scalers": [_scales(*args) for args in SCALERS]}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(fixtures, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
