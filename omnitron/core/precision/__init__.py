"""Mixed precision: dtypes for --bf16/--fp16 and loss scaling (FP8 recipes live in ``precision.fp8``)."""
from omnitron.core.precision.loss_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler, params_dtype

__all__ = ["ConstantLossScaler", "DynamicLossScaler", "build_loss_scaler", "params_dtype"]
