"""``--fp8-impl torchao``: the linears' FP8 GEMMs run by torchao's ``Float8Linear`` math instead of omnitron's own.

:class:`TorchaoLinear` is an executor with :class:`~omnitron.core.precision.fp8.linear.FP8Linear`'s interface,
``executor(x, weight, bias) -> y``, installed on the same seam, so omnitron's column/row-parallel linears keep
their weights, names and tensor-parallel communication; inside, it runs what ``Float8Linear.forward`` runs:
torchao's autograd function over the high-precision input and transposed weight, dynamic (current) per-tensor
scaling, then the bias. Its recipe is torchao's ``tensorwise``: e4m3 input and weight, e5m2 gradients
(omnitron's ``hybrid``; ``e4m3`` casts the gradients to e4m3 too). Where the device has no FP8 GEMM, torchao's
``emulate`` mode upcasts the FP8 operands (as omnitron's emulation does).

Refused in one line (:func:`check`): torchao not installed; a recipe other than ``tensorwise`` (torchao's
row-wise recipes scale differently from omnitron's block-wise); tensor or context parallelism (torchao takes
each shard's own amax, so shards would be scaled apart, where omnitron MAX-reduces them to the whole tensor's).
"""
from __future__ import annotations

import importlib.util

import torch

from omnitron.core.config.parallel import ConfigError

IMPLS = ("omnitron", "torchao")


def check(fp8_impl: str, fp8_recipe: str) -> None:
    """Refuse an implementation that cannot run here (module docstring), one line each."""
    if fp8_impl in ("te", "transformer_engine"):
        raise ConfigError("--fp8-impl te: Transformer Engine is not bound by omnitron; use --fp8-impl omnitron or "
                          "torchao")
    if fp8_impl not in IMPLS:
        raise ConfigError(f"--fp8-impl {fp8_impl!r} is unknown: use one of {', '.join(IMPLS)}")
    if fp8_impl != "torchao":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("--fp8-impl torchao: torchao is not installed; pip install torchao, or use --fp8-impl "
                          "omnitron")
    if fp8_recipe != "tensorwise":
        raise ConfigError(f"--fp8-impl torchao runs torchao's tensorwise recipe, not {fp8_recipe!r}; use "
                          f"--fp8-recipe tensorwise (or --fp8-impl omnitron)")


def check_layout(groups) -> None:
    """Refuse tensor / context parallelism (per-shard scales; module docstring)."""
    if groups is not None and groups.tp_cp.size > 1:
        raise ConfigError("--fp8-impl torchao scales each tensor-/context-parallel shard by its own amax; use "
                          "--fp8-impl omnitron, which reduces the amax over the shards")


class TorchaoLinear:
    """``executor(x, weight, bias)`` computing torchao ``Float8Linear``'s forward and backward (module docstring).
    Stateless: no checkpoint state, nothing cached between calls, no amax reducer (``fp8_step`` skips it)."""

    reducer = None

    def __init__(self, fp8_format: str, emulate: bool, name: str = "") -> None:
        from torchao.float8.config import CastConfig, Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

        go = CastConfig(target_dtype=torch.float8_e4m3fn) if fp8_format == "e4m3" else CastConfig()
        self.config = Float8LinearConfig(cast_config_grad_output=go, emulate=emulate)
        mm = [ScaledMMConfig(emulate, g.use_fast_accum, False, self.config.pad_inner_dim)
              for g in (self.config.gemm_config_output, self.config.gemm_config_grad_input,
                        self.config.gemm_config_grad_weight)]
        self.mm_config, self.name = LinearMMConfig(*mm), name

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # the output dtype F.linear would give under autocast
            x = x.to(torch.get_autocast_dtype(dev))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)

    def __repr__(self) -> str:
        return f"TorchaoLinear({self.name or '?'}, emulate={self.mm_config.output.emulate})"
