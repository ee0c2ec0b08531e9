"""FP8 training: delayed, tensorwise (current) and block-wise scaling for linear-layer GEMMs.

Use: ``enable_fp8(model, FP8Config(fp8_format="hybrid", fp8_recipe="delayed"), groups)`` once after
building the model; save ``fp8_state_dict(model)`` with the checkpoint and restore it with
``load_fp8_state_dict``. The GEMMs run through the backend's FP8 provider (``backend.fp8``), whose
path (scaled_mm / emulated) is logged when FP8 is enabled.
"""
from omnitron.core.precision.fp8.args import add_fp8_args, fp8_config_from_args
from omnitron.core.precision.fp8.config import FP8Config, check_backend
from omnitron.core.precision.fp8.enable import (
    amax_groups_for, disable_fp8, enable_fp8, fp8_state_dict, linear_modules, load_fp8_state_dict,
)
from omnitron.core.precision.fp8.linear import FP8Linear
from omnitron.core.precision.fp8.scaling import DelayedScaling, reduce_amax

__all__ = ["add_fp8_args", "fp8_config_from_args", "FP8Config", "FP8Linear", "DelayedScaling", "amax_groups_for",
           "check_backend", "disable_fp8",
           "enable_fp8", "fp8_state_dict", "linear_modules", "load_fp8_state_dict", "reduce_amax"]
