"""FP8 training configuration (Megatron's ``--fp8-*`` flags) and its validation against a backend."""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8.torchao_impl import check

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")
AMAX_ALGOS = ("max", "most_recent")
BLOCK_ACT = (1, 128)
"""Tile of activations and gradients under the block-wise recipe (one row, 128 along the contraction)."""
BLOCK_WEIGHT = (128, 128)
"""Block of weights under the block-wise recipe."""


@dataclass(kw_only=True)
class FP8Config:
    """How linear-layer GEMMs run in FP8. Master weights, norms, softmax and the optimizer stay wide."""

    fp8_format: str = "hybrid"
    """--fp8-format: ``e4m3`` for every GEMM operand, or ``hybrid`` (e4m3 forward, e5m2 gradients)."""
    fp8_recipe: str = "delayed"
    """--fp8-recipe: ``delayed`` (per-tensor scale from an amax history), ``tensorwise`` (per-tensor scale
    from the current amax) or ``blockwise`` (1x128 activation/gradient tiles, 128x128 weight blocks, each scale
    rounded down to a power of two as Transformer Engine's ``Float8BlockScaling`` does by default)."""
    fp8_margin: int = 0
    """--fp8-margin: the ``delayed`` scale is ``fp8_max / 2**margin / amax`` (headroom in powers of two). Megatron
    hands it to Transformer Engine's ``DelayedScaling`` only; ``tensorwise`` and ``blockwise`` take none (their
    recipes have no margin), so it has no effect there either (:attr:`scale_margin`)."""
    fp8_amax_history_len: int = 1
    """--fp8-amax-history-len: amax values kept per tensor by the ``delayed`` recipe (Megatron's default, 1;
    Transformer Engine's own ``DelayedScaling`` default is 1024, but Megatron passes its value)."""
    fp8_amax_compute_algo: str = "most_recent"
    """--fp8-amax-compute-algo: ``max`` of the history, or its ``most_recent`` value (``delayed`` only; Megatron's
    default)."""
    fp8_impl: str = "omnitron"
    """--fp8-impl: whose FP8 linear runs: ``omnitron`` (its own recipes, every backend) or ``torchao`` (torchao's
    Float8Linear math, tensorwise recipe only; needs torchao installed). fp8/torchao_impl.py."""
    first_last_layers_bf16: bool = False
    """--first-last-layers-bf16: keep the first and last transformer layers out of FP8 (not with the ``delayed``
    recipe, which Megatron refuses: ``TransformerConfig.__post_init__``)."""
    num_layers_at_start_in_bf16: int = 1
    """--num-layers-at-start-in-bf16: layers kept wide at the start when ``first_last_layers_bf16``."""
    num_layers_at_end_in_bf16: int = 1
    """--num-layers-at-end-in-bf16: layers kept wide at the end when ``first_last_layers_bf16``."""

    def __post_init__(self) -> None:
        if self.fp8_recipe == "mxfp8":
            raise ConfigError("--fp8-recipe mxfp8 is not supported by omnitron (it needs MX block-scaled GEMMs "
                              "with 1x32 e8m0 scales); use --fp8-recipe blockwise for fine-grained scaling")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"--fp8-recipe {self.fp8_recipe!r} is unknown: use one of {', '.join(FP8_RECIPES)}")
        check(self.fp8_impl, self.fp8_recipe)
        if self.first_last_layers_bf16 and self.fp8_recipe == "delayed":
            raise ConfigError("--first-last-layers-bf16 with --fp8-recipe delayed (the default recipe): Megatron "
                              "refuses it (delayed scaling's amax reduction spans every FP8 layer); use --fp8-recipe "
                              "tensorwise or blockwise, or drop --first-last-layers-bf16")
        if self.fp8_format not in FP8_FORMATS:
            raise ConfigError(f"--fp8-format {self.fp8_format!r} is unknown: use one of {', '.join(FP8_FORMATS)}")
        if self.fp8_amax_compute_algo not in AMAX_ALGOS:
            raise ConfigError(f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo!r} is unknown: "
                              f"use one of {', '.join(AMAX_ALGOS)}")
        if not isinstance(self.fp8_amax_history_len, int) or self.fp8_amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-history-len must be a positive integer, got {self.fp8_amax_history_len!r}")
        if not isinstance(self.fp8_margin, int) or self.fp8_margin < 0:
            raise ConfigError(f"--fp8-margin must be a non-negative integer, got {self.fp8_margin!r}")
        for flag, n in (("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16)):
            if not isinstance(n, int) or n < 0:
                raise ConfigError(f"{flag} must be a non-negative integer, got {n!r}")

    def check_layers(self, num_layers: int, pipeline_stages: int) -> None:
        """Megatron's bound under ``--first-last-layers-bf16``: each of ``--num-layers-at-start-in-bf16`` and
        ``--num-layers-at-end-in-bf16`` at most one pipeline stage's layers (``num_layers // pp``); refused before
        any work, as there (a larger count would leave no layer in FP8)."""
        if not self.first_last_layers_bf16:
            return
        most = num_layers // pipeline_stages
        for flag, n in (("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
                        ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16)):
            if n > most:
                raise ConfigError(f"{flag} {n} is more than the {most} layers of a pipeline stage (--num-layers "
                                  f"{num_layers} over {pipeline_stages} stages); give at most {most}")

    @property
    def forward_format(self) -> str:
        """Storage format of inputs and weights."""
        return "e4m3"

    @property
    def backward_format(self) -> str:
        """Storage format of output gradients (e5m2 under ``hybrid``: wider range, less precision)."""
        return "e5m2" if self.fp8_format == "hybrid" else "e4m3"

    @property
    def scale_margin(self) -> int:
        """The margin scales are computed with: ``--fp8-margin`` under ``delayed``, 0 under the other recipes."""
        return self.fp8_margin if self.fp8_recipe == "delayed" else 0

    @property
    def per_tensor(self) -> bool:
        """True for the recipes with one scale per tensor."""
        return self.fp8_recipe in ("delayed", "tensorwise")


def check_backend(config: FP8Config, backend) -> None:
    """Raise :class:`ConfigError` when ``backend`` cannot run ``config`` (formats, recipe), naming the gap."""
    caps = backend.capabilities()
    needed = {"e4m3"} | ({"e5m2"} if config.fp8_format == "hybrid" else set())
    missing = sorted(needed - set(caps.fp8_formats))
    if missing:
        have = ", ".join(caps.fp8_formats) or "none"
        raise ConfigError(f"--fp8-format {config.fp8_format} needs FP8 format(s) {', '.join(missing)}, but backend "
                          f"{backend.name!r} ({caps.device_name}) has: {have}; drop --fp8-format or train in --bf16")
    if config.fp8_recipe not in caps.fp8_recipes:
        have = ", ".join(caps.fp8_recipes) or "none"
        raise ConfigError(f"--fp8-recipe {config.fp8_recipe} is not run by backend {backend.name!r} "
                          f"(its recipes: {have}); choose one of those")
