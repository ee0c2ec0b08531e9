"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: for each MLP activation / fusion flag
combination below, whether Megatron's ``parse_args``, ``validate_args`` and ``core_transformer_config_from_args``
(whose ``TransformerConfig`` checks the fused bias-activation, the GLU offset and the SwiGLU clamp) accept it, and
the message where they refuse it. omnitron is not imported. From the omnitron root, on CPU and offline, with torch
and a Megatron-LM checkout (d98e8a64dd here):

    MEGATRON_LM=/path/to/Megatron-LM python tests/training/megatron_activation_fusion/make_fixtures.py
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import typing
import warnings

typing.override = getattr(typing, "override", lambda f: f)  # Megatron imports it; Python < 3.12 lacks it
HERE = os.path.dirname(os.path.abspath(__file__))
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3")
MOE = " --num-experts 2 --moe-router-topk 2"
CASES = [  # flags after BASE
    "--squared-relu",
    "--squared-relu --no-bias-gelu-fusion",
    "--squared-relu --disable-bias-linear",
    "--squared-relu --no-bias-swiglu-fusion",
    "--swiglu --glu-linear-offset 1.0",
    "--swiglu --glu-linear-offset 1.0 --no-bias-swiglu-fusion",
    "--swiglu --glu-linear-offset 0.5 --disable-bias-linear",
    "--quick-geglu --glu-linear-offset 1.0",
    "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0" + MOE,
    "--glu-linear-offset 1.0",
    "--swiglu --no-bias-swiglu-fusion --activation-func-clamp-value 7.0",
    "--swiglu --no-bias-swiglu-fusion --activation-func-clamp-value 7.0" + MOE,
    "--swiglu --no-bias-swiglu-fusion --activation-func-clamp-value -1.0" + MOE,
    "--swiglu --no-bias-swiglu-fusion --activation-func-clamp-value 7.0 --glu-linear-offset 1.0" + MOE,
    "--swiglu --disable-bias-linear",
    "--no-bias-swiglu-fusion",
    "--disable-bias-linear",
    "--no-bias-gelu-fusion",
]


def megatron_verdict(flags: str) -> str | None:
    """None where Megatron builds the model's TransformerConfig from ``flags``, else its error message."""
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    os.environ["WORLD_SIZE"] = "1"
    sys.argv = ["pretrain_gpt.py", *(BASE + " " + flags).split()]
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            core_transformer_config_from_args(validate_args(parse_args()))
    except (AssertionError, ValueError) as e:
        return str(e) or type(e).__name__
    return None


def main() -> None:
    root = os.environ.get("MEGATRON_LM")
    if not root:
        sys.exit("set MEGATRON_LM to a Megatron-LM checkout")
    sys.path.insert(0, root)
    out = {"_base": BASE, "cases": {flags: megatron_verdict(flags) for flags in CASES}}
    for flags, verdict in out["cases"].items():
        print(f"{flags!r}: {'accepted' if verdict is None else 'refused: ' + verdict}")
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
