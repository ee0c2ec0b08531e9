"""FP8 provider: quantize (cast + scale + amax) and scaled GEMM, with the execution path stated.

Paths, best first, as the backend's capabilities allow: ``transformer_engine`` (where the
package imports), ``scaled_mm`` (``torch._scaled_mm`` on the device), ``emulated`` (real float8
rounding by casting, float32 accumulation). The chosen path is logged once; there is no silent
fall-back to a wider dtype.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("omnitron.fp8")

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_dtype(fmt: str) -> torch.dtype:
    """torch dtype for ``"e4m3"`` / ``"e5m2"``; a clear error otherwise."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}") from None


class FP8Provider:
    """Per-backend FP8 operations. ``path`` names how scaled GEMMs execute here."""

    def __init__(self, backend) -> None:
        self.backend = backend
        caps = backend.capabilities()
        self.path = caps.fp8_gemm or "emulated"
        self.recipes = caps.fp8_recipes
        self._logged = False

    def quantize(self, x: torch.Tensor, fmt: str, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``x * scale`` cast to ``fmt`` with saturation, amax of ``x``) — amax is a float32 scalar."""
        amax = x.detach().abs().amax().float()
        limit = FP8_MAX[fmt]
        q = (x.float() * scale).clamp_(-limit, limit).to(fp8_dtype(fmt))
        return q, amax

    def scaled_mm(self, a: torch.Tensor, b: torch.Tensor, scale_a_inv: torch.Tensor, scale_b_inv: torch.Tensor,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(a * scale_a_inv) @ (b * scale_b_inv)`` for FP8 ``a [m,k]``, ``b [k,n]``; fp32 accumulation.

        Scales are dequantization factors (the reciprocal of the quantization scale): per-tensor
        scalars, or row-wise (``[m,1]`` for ``a``, ``[1,n]`` for ``b``).
        """
        if not self._logged:
            log.info("FP8 GEMM path on backend %s: %s", self.backend.name, self.path)
            self._logged = True
        if self.path == "scaled_mm":
            try:
                return torch._scaled_mm(a, b, scale_a=scale_a_inv.float(), scale_b=scale_b_inv.float(),
                                        out_dtype=out_dtype)
            except (RuntimeError, NotImplementedError) as err:  # shape/layout precondition unmet
                log.warning("torch._scaled_mm refused (%s); this call runs the exact emulation", err)
        return ((a.float() * scale_a_inv.float()) @ (b.float() * scale_b_inv.float())).to(out_dtype)
