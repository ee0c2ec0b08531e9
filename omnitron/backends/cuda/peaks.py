"""Dense (no sparsity) peak FLOP/s of common NVIDIA data-centre GPUs, from the vendor datasheets.

Keys are regular expressions matched against ``torch.cuda.get_device_name()``; the first match
wins, so specific names (``H100 PCIe``) come before general ones (``H100``). A GPU not listed
gets None for every dtype: MFU is then not reported rather than reported against a guess.
"""
from __future__ import annotations

import re

_T = 1e12
# (pattern, {dtype: dense FLOP/s}); fp32 is the non-tensor-core figure, tf32 the tensor cores' on float32
# (given where omnitron/plan/devices holds the datasheet's figure: Hopper, Blackwell B200, A100).
PEAKS: tuple[tuple[str, dict[str, float | None]], ...] = (
    (r"\bH200\b", {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989 * _T, "fp16": 989 * _T, "fp8": 1979 * _T}),
    (r"\bH100\b.*\bPCIe\b", {"fp32": 51 * _T, "bf16": 756 * _T, "fp16": 756 * _T, "fp8": 1513 * _T}),
    (r"\bH100\b.*\bNVL\b", {"fp32": 60 * _T, "bf16": 835 * _T, "fp16": 835 * _T, "fp8": 1671 * _T}),
    (r"\bH100\b|\bH800\b", {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989 * _T, "fp16": 989 * _T, "fp8": 1979 * _T}),
    (r"\bGH200\b", {"fp32": 67 * _T, "tf32": 494.7 * _T, "bf16": 989 * _T, "fp16": 989 * _T, "fp8": 1979 * _T}),
    (r"\bB200\b", {"fp32": None, "tf32": 1125 * _T, "bf16": 2250 * _T, "fp16": 2250 * _T, "fp8": 4500 * _T}),
    (r"\bA100\b|\bA800\b", {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T, "fp8": None}),
    (r"\bL40S\b", {"fp32": 91.6 * _T, "bf16": 362 * _T, "fp16": 362 * _T, "fp8": 733 * _T}),
    (r"\bL4\b", {"fp32": 30.3 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "fp8": 242 * _T}),
    (r"\bV100\b", {"fp32": 15.7 * _T, "bf16": None, "fp16": 125 * _T, "fp8": None}),
)
UNKNOWN = {"fp32": None, "tf32": None, "bf16": None, "fp16": None, "fp8": None}


def peak_flops(device_name: str) -> dict[str, float | None]:
    """Dense peak FLOP/s per dtype for ``device_name``; every value None when the GPU is not listed."""
    for pattern, table in PEAKS:
        if re.search(pattern, device_name):
            return dict(table)
    return dict(UNKNOWN)
