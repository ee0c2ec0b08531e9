"""Megatron's ``--fp8-*`` command-line flags and their translation into :class:`FP8Config`."""
from __future__ import annotations

import argparse

from omnitron.core.precision.fp8.config import AMAX_ALGOS, FP8_FORMATS, FP8Config


def add_fp8_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the FP8 flags (Megatron spellings) to ``parser``; FP8 is off unless ``--fp8-format`` is given."""
    g = parser.add_argument_group("fp8")
    g.add_argument("--fp8-format", choices=FP8_FORMATS, default=None,
                   help="train linear-layer GEMMs in FP8: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)")
    g.add_argument("--fp8-recipe", choices=("delayed", "tensorwise", "blockwise", "mxfp8"), default="delayed",
                   help="scaling recipe (mxfp8 is recognised and refused with a reason)")
    g.add_argument("--fp8-margin", type=int, default=0, help="scale = fp8_max / 2**margin / amax (delayed only)")
    g.add_argument("--fp8-amax-history-len", type=int, default=FP8Config.fp8_amax_history_len,
                   help="amax history length (delayed)")
    g.add_argument("--fp8-amax-compute-algo", choices=AMAX_ALGOS, default=FP8Config.fp8_amax_compute_algo,
                   help="history summary (delayed)")
    g.add_argument("--first-last-layers-bf16", action="store_true", help="keep the first/last layers out of FP8")
    g.add_argument("--num-layers-at-start-in-bf16", type=int, default=1)
    g.add_argument("--num-layers-at-end-in-bf16", type=int, default=1)
    return parser


def fp8_config_from_args(args: argparse.Namespace) -> FP8Config | None:
    """The :class:`FP8Config` the flags describe, or None when ``--fp8-format`` is absent (validated here)."""
    if getattr(args, "fp8_format", None) is None:
        return None
    return FP8Config(fp8_format=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                     fp8_amax_history_len=args.fp8_amax_history_len,
                     fp8_amax_compute_algo=args.fp8_amax_compute_algo,
                     first_last_layers_bf16=args.first_last_layers_bf16,
                     num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                     num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16)
