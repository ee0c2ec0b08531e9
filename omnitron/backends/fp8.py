"""FP8 provider: quantize (cast + scale + amax), per-tensor / row-wise / block-wise scaled GEMMs.

Paths, best first, as the backend's capabilities allow: ``scaled_mm`` (``torch._scaled_mm`` /
``F.scaled_mm``, claimed only where a tiny one ran on the device: :func:`scaled_mm_runs`),
``emulated`` (real float8 rounding by casting, float32 accumulation). The path taken is
logged once per kind of GEMM, and again whenever a call has to leave it; there is no fall-back to
a wider dtype: every path multiplies the same float8 values.

Conventions. A quantization ``scale`` multiplies the high-precision tensor before the cast
(``q = fp8(x * scale)``); GEMMs take the reciprocal, ``scale_inv`` (``x ~= q * scale_inv``).
``cast_to_fp8`` and ``quantize_blocks``: e4m3 saturates at +-448 (inf included); e5m2 keeps IEEE overflow
(|x*scale| > 57344 -> inf) unless ``saturate``. NOTE: the FP8 linear's per-tensor casts (the
``fp8_cast_transpose_*`` kernels) saturate both formats, as Transformer Engine's satfinite casts do: there a
stale delayed scale clips a growing gradient at +-57344 rather than turning it into inf (a NaN stays NaN).
"""
from __future__ import annotations

import logging
import math
import os

import torch

from omnitron.kernels.function_output import cast_output
from omnitron.kernels.reference.fp8 import (  # noqa: F401 (the provider's names)
    FORMATS, FP8_MAX, cast_to_fp8, fp8_dtype, scale_from_amax)

log = logging.getLogger("omnitron.fp8")

PATHS = ("scaled_mm", "emulated")
"""NOTE: no Transformer Engine path: omnitron has no binding to TE's GEMM and none is tested."""
PATH_ENV = "OMNITRON_FP8_PATH"
"""Set to ``scaled_mm`` or ``emulated`` to force a path (benchmarks, path-parity tests)."""


def zero_pad(x: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    """``F.pad(x, pad)`` with zeros, also for an empty ``x`` (an MoE expert that received no tokens):
    torch 2.9 rejects a size-0 dimension padded by (0, 0) beside another padded one ("The input size 0,
    plus negative padding 0 and 0 resulted in a negative output size"; 2.11 accepts it); the result is all zeros."""
    if x.numel():
        return torch.nn.functional.pad(x, pad)
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return x.new_zeros(shape)


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    m, k = x.shape
    if (m, k) == (rows, cols):
        return x
    return zero_pad(x, (0, cols - k, 0, rows - m))


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax of each ``block`` tile of 2-D ``x`` -> ``[ceil(m/bm), ceil(k/bk)]`` float32 (edge tiles padded with 0).
    One reduction (``vector_norm(inf)``: no ``|x|`` temporary; NaN propagates)."""
    (m, k), (bm, bk) = x.shape, block
    gm, gk = math.ceil(m / bm), math.ceil(k / bk)
    xp = _pad_to(x.detach(), gm * bm, gk * bk)
    return torch.linalg.vector_norm(xp.reshape(gm, bm, gk, bk), math.inf, dim=(1, 3), dtype=torch.float32)


def expand_blocks(s: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-block values ``s`` repeated over their tiles and cropped to ``shape`` (dequantization factors)."""
    bm, bk = block
    return s.repeat_interleave(bm, 0).repeat_interleave(bk, 1)[: shape[0], : shape[1]]


def mul_blocks_(y: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``y *= s`` expanded over its ``block`` tiles, in place on float32 2-D ``y``; returns ``y``.
    Whole tiles broadcast through a 4-D view (no expanded copy of ``s``); ragged shapes expand."""
    (m, k), (bm, bk) = y.shape, block
    if m % bm == 0 and k % bk == 0 and y.is_contiguous():
        y.view(m // bm, bm, k // bk, bk).mul_(s.float()[:, None, :, None])
        return y
    return y.mul_(expand_blocks(s.float(), block, (m, k)))


def _gemm_scale(s: torch.Tensor, rowwise_shape: tuple[int, int]) -> torch.Tensor:
    """A dequantization factor as ``_scaled_mm`` takes it: float32, 0-d per-tensor or ``rowwise_shape``.
    Already-right tensors pass through without a dispatch (this runs three times per FP8 linear)."""
    if s.dtype != torch.float32:
        s = s.float()
    if s.numel() > 1:
        return s.reshape(rowwise_shape)
    return s if s.dim() == 0 else s.reshape(())


GEMM_ALIGN = 16
"""``torch._scaled_mm`` on GPUs wants the inner and output dimensions in multiples of 16."""


def _native_scaled_mm(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm`` with ``b`` column-major, the inner dimension ``k`` and the columns ``n``
    zero-padded to multiples of :data:`GEMM_ALIGN` (exact: zero codes add nothing; padded columns are
    cut off). Unaligned ``k`` is the weight-gradient GEMM over a token count such as an MoE expert's."""
    (m, k), n = a.shape, b.shape[1]
    pk, pn = -k % GEMM_ALIGN, -n % GEMM_ALIGN if sb.numel() == 1 else 0  # row-wise scales fix n
    if pk or pn:
        byte = torch.uint8
        a = zero_pad(a.contiguous().view(byte), (0, pk)).view(a.dtype)
        b = zero_pad(b.t().contiguous().view(byte), (0, pk, 0, pn)).view(b.dtype).t()
    elif b.stride(0) != 1:
        b = b.t().contiguous().t()  # column-major right operand
    y = torch._scaled_mm(a.contiguous(), b, scale_a=sa.contiguous(), scale_b=sb.contiguous(), out_dtype=out_dtype)
    return y[:, :n] if pn else y


def scaled_mm_runs(device) -> bool:
    """True when a tiny ``torch._scaled_mm`` (16x16 e4m3, unit scales) runs on ``device``: the FP8 GEMM
    capability is this fact, not ``hasattr(torch, "_scaled_mm")`` (true on every recent torch)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.tensor(1.0, device=device)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False


class FP8Provider:
    """Per-backend FP8 operations.

    ``path`` names how per-tensor / row-wise scaled GEMMs execute; ``block_path`` how block-wise
    (1x128 tiles x 128x128 blocks) GEMMs execute. Both are facts of this process, logged once.
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        caps = backend.capabilities()
        self.formats = tuple(caps.fp8_formats)
        self.recipes = tuple(caps.fp8_recipes)
        self.path, self.path_reason = self._select_path(caps)
        self.block_path = "emulated" if self.path == "emulated" else "untried"
        self._said: set[str] = set()
        self._native_ok: set = set()
        self._native_bad: set = set()  # layouts (or (layout, shapes)) the native kernel refused

    # ---- path selection ---------------------------------------------------------------------
    def _select_path(self, caps) -> tuple[str, str]:
        forced = os.environ.get(PATH_ENV, "").strip()
        if forced:
            if forced not in PATHS:
                raise ValueError(f"{PATH_ENV}={forced!r}: use 'scaled_mm' or 'emulated'")
            return forced, f"forced by {PATH_ENV}"
        claimed = caps.fp8_gemm or "emulated"
        if claimed == "scaled_mm":
            return "scaled_mm", "torch._scaled_mm runs on this device"
        return "emulated", "no scaled FP8 GEMM on this device: float8 rounding by casting, fp32 accumulation"

    def _say(self, key: str, msg: str, *args, level=logging.INFO) -> None:
        if torch.compiler.is_compiling():
            return  # logging would split a compiled graph; eager calls say it
        if key not in self._said:
            self._said.add(key)
            log.log(level, msg, *args)

    def describe(self) -> str:
        """One line for logs: the GEMM paths in use and why; or that FP8 training is refused here (a backend without
        FP8 formats or recipes), so ``omnitron info`` names no path that could never run."""
        if not (self.formats and self.recipes):
            return (f"FP8 on backend {self.backend.name}: none (formats: {', '.join(self.formats) or 'none'}; "
                    f"recipes: {', '.join(self.recipes) or 'none'}): --fp8-format is refused")
        return (f"FP8 on backend {self.backend.name}: per-tensor GEMM path {self.path} ({self.path_reason}); "
                f"block-wise GEMM path {self.block_path}")

    # ---- quantization -----------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, fmt: str, scale: torch.Tensor,
                 saturate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(``fp8(x * scale)``, amax of ``x`` as a float32 scalar). See :func:`cast_to_fp8` for saturation."""
        amax = x.detach().abs().amax().float()
        return cast_to_fp8(x, fmt, scale, saturate), amax

    def quantize_blocks(self, x: torch.Tensor, fmt: str, block: tuple[int, int], margin: int = 0,
                        saturate: bool = False, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Block-scaled quantization of 2-D ``x``: each ``block`` tile gets its own scale from its amax
        (rounded down to a power of two with ``pow2``, the default: the block-wise recipe's, Transformer Engine's
        ``Float8BlockScaling``; :func:`scale_from_amax`).

        Returns (``q`` float8 with ``x``'s shape, ``scale_inv`` float32 ``[ceil(m/bm), ceil(k/bk)]``).
        """
        if x.dim() != 2:
            raise ValueError(f"quantize_blocks takes a 2-D tensor, got shape {tuple(x.shape)}")
        scale = scale_from_amax(block_amax(x, block), fmt, margin, pow2=pow2)
        y = mul_blocks_(x.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True), scale, block)
        if fmt == "e4m3" or saturate:
            y.clamp_(-FP8_MAX[fmt], FP8_MAX[fmt])  # as cast_to_fp8: nan stays nan, +-inf -> +-max
        return y.to(fp8_dtype(fmt)), scale.reciprocal()

    # ---- GEMMs ------------------------------------------------------------------------------
    def scaled_mm(self, a: torch.Tensor, b: torch.Tensor, scale_a_inv: torch.Tensor, scale_b_inv: torch.Tensor,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(a * scale_a_inv) @ (b * scale_b_inv)`` for FP8 ``a [m,k]``, ``b [k,n]``; fp32 accumulation.

        Scales are dequantization factors: per-tensor scalars, or row-wise (``[m,1]`` for ``a``,
        ``[1,n]`` for ``b``).
        """
        if "path" not in self._said:
            self._say("path", "FP8 GEMM path on backend %s: %s (%s)", self.backend.name, self.path, self.path_reason)
        sa, sb = _gemm_scale(scale_a_inv, (-1, 1)), _gemm_scale(scale_b_inv, (1, -1))
        if self.path == "scaled_mm":
            try:
                return _native_scaled_mm(a, b, sa, sb, out_dtype)
            except (RuntimeError, NotImplementedError, ValueError) as err:  # shape/layout precondition unmet
                reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                self._say(f"refused:{reason}", "torch._scaled_mm refused a %sx%s GEMM (%s); such GEMMs run the "
                          "exact emulation", tuple(a.shape), tuple(b.shape), reason, level=logging.WARNING)
        return cast_output((a.float() * sa) @ (b.float() * sb), out_dtype)

    def blockwise_mm(self, a: torch.Tensor, scale_a_inv: torch.Tensor, a_block: tuple[int, int],
                     b: torch.Tensor, scale_b_inv: torch.Tensor, b_block: tuple[int, int],
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block-scaled GEMM ``deq(a) @ deq(b)`` with per-tile dequantization factors; fp32 accumulation.

        ``a [m,k]`` has tiles ``a_block`` and ``scale_a_inv [ceil(m/am), ceil(k/ak)]``; likewise ``b [k,n]``.
        DeepSeek-V3 layouts: ``(1,128) x (128,128)`` (forward, data-grad), ``(1,128) x (128,1)`` (weight-grad).
        The native kernel is tried once per layout and checked against the emulation before use. Inside a compiled
        graph (``--torch-compile``) the emulation runs, which the compiler fuses: the probe, the refusal caught
        and the first-use check are host-side work that a traced graph cannot hold (a refusal raised while tracing
        ends the compilation instead of falling back). The native block-wise kernel refused every layout on the
        torch of 2026-12-04 (2.11, H200) anyway.
        """
        if torch.compiler.is_compiling():
            return self._emulated_blockwise(a, scale_a_inv, a_block, b, scale_b_inv, b_block, out_dtype)
        key = f"{a_block}x{b_block}"
        if self.block_path == "untried":
            self._probe_blockwise(a.device)
        if self.block_path != "emulated" and key not in self._native_bad and \
                (key, a.shape, b.shape) not in self._native_bad:
            native = self._native_blockwise(a, scale_a_inv, a_block, b, scale_b_inv, b_block, out_dtype)
            if native is not None:
                return native
        self._say(f"blockpath:{key}", "FP8 block-wise GEMM %s on backend %s: emulated (per-tile dequantization, "
                  "fp32 accumulation)", key, self.backend.name)
        return self._emulated_blockwise(a, scale_a_inv, a_block, b, scale_b_inv, b_block, out_dtype)

    @staticmethod
    def _emulated_blockwise(a, scale_a_inv, a_block, b, scale_b_inv, b_block, out_dtype):
        da = mul_blocks_(a.to(torch.float32, memory_format=torch.contiguous_format), scale_a_inv, a_block)
        db = mul_blocks_(b.to(torch.float32, memory_format=torch.contiguous_format), scale_b_inv, b_block)
        return cast_output(da @ db, out_dtype)

    def _probe_blockwise(self, device: torch.device) -> None:
        """Try one 128x256 @ 256x128 block-scaled GEMM on ``device``; settle ``block_path`` to emulated on refusal."""
        a = torch.ones(128, 256, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(128, 256, device=device).to(torch.float8_e4m3fn).t()
        self.block_path = "probing"
        got = self._native_blockwise(a, torch.ones(128, 2, device=device), (1, 128),
                                     b, torch.ones(2, 1, device=device), (128, 128), torch.float32)
        self.block_path = "scaled_mm" if got is not None else "emulated"
        self._native_ok.clear()  # the real layouts are still verified on first use

    def _native_blockwise(self, a, sa, a_block, b, sb, b_block, out_dtype):
        """``F.scaled_mm`` with block-wise scaling where the device has it; None when it does not."""
        import torch.nn.functional as F

        key = f"{a_block}x{b_block}"
        kinds = {(1, 128): "BlockWise1x128", (128, 128): "BlockWise128x128", (128, 1): "BlockWise1x128"}
        st = getattr(F, "ScalingType", None)
        if st is None or a_block not in kinds or b_block not in kinds or not hasattr(F, "scaled_mm"):
            self._native_bad.add(key)
            return None
        outer = lambda t: t.float().t().contiguous().t()  # noqa: E731 - outer-dim-major scale layout
        try:
            y = F.scaled_mm(a.contiguous(), b.t().contiguous().t(), outer(sa), getattr(st, kinds[a_block]),
                            outer(sb) if b_block == (128, 1) else sb.float().contiguous(),
                            getattr(st, kinds[b_block]), output_dtype=out_dtype)
        except Exception as err:  # noqa: BLE001 - any refusal means "emulate this shape"
            self._native_bad.add((key, a.shape, b.shape))
            self._say(f"nativefail:{key}", "block-wise scaled_mm %s unavailable here (%s)", key,
                      str(err).splitlines()[0] if str(err) else type(err).__name__)
            return None
        if key not in self._native_ok:  # first use of this layout: verify against the emulation
            da = a.float() * expand_blocks(sa.float(), a_block, tuple(a.shape))
            db = b.float() * expand_blocks(sb.float(), b_block, tuple(b.shape))
            ref = da @ db
            err = (y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
            if not bool(err < 2e-2):
                self._native_bad.add(key)
                self._say(f"nativebad:{key}", "block-wise scaled_mm %s disagrees with the emulation (rel. error "
                          "%.3g); using the emulation", key, float(err), level=logging.WARNING)
                return None
            self._native_ok.add(key)
            self.block_path = "scaled_mm"
            self._say(f"blockpath:{key}", "FP8 block-wise GEMM %s on backend %s: scaled_mm (native)", key,
                      self.backend.name)
        return y
