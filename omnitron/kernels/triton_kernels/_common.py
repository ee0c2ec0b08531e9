"""Helpers shared by the Triton kernels: availability, per-call device checks, block sizes."""
from __future__ import annotations

import os

import torch
import triton

NAME = "triton"
GPU_BACKENDS = ("cuda", "musa")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``). Read once, at import:
    Triton itself decides it when the kernels are defined, and :func:`check` runs on every kernel call."""
    return _INTERPRETING


def _fix_interpreter_loop_bounds() -> None:
    """Under ``TRITON_INTERPRET=1``, let a loop bound computed from ``tl.program_id`` index a ``range``.

    The interpreters of Triton 3.5.1 and 3.6.0 (pinned by torch 2.9 and 2.10/2.11) convert such a bound with
    ``int(ndarray)`` over a 1-element 1-D array, which NumPy 2.4 rejects ("only 0-dimensional arrays can be
    converted to Python scalars"); Triton 3.9's interpreter squeezes the array first. This applies the same
    conversion on every Triton (3.5's ``_patch_lang_tensor(tensor)``; 3.6+ pass a scope that restores the
    patched attributes afterwards); compiled kernels (a GPU) never pass through here."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def index(self):
        return int(self.handle.data.squeeze())

    def patch_lang_tensor(tensor, *scope):
        patch(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def available() -> tuple[bool, str]:
    """Usable when interpreting, or when Triton has an active GPU driver in this process."""
    if interpreting():
        return True, ""
    try:
        triton.runtime.driver.active.get_current_target()
    except Exception as err:  # no GPU driver Triton can use
        return False, (f"Triton has no usable GPU here ({str(err).splitlines()[0][:120]}); set TRITON_INTERPRET=1 to "
                       "run on CPU")
    return True, ""


def check(*tensors, dtypes=DTYPES) -> str | None:
    """None when every tensor is on a device the kernels can run on with a supported dtype."""
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"expected a tensor, got {type(t).__name__}"
        on_cpu = t.device.type == "cpu"
        if on_cpu and not interpreting():
            return "CPU tensor: Triton kernels run on a GPU (or on CPU under TRITON_INTERPRET=1)"
        if not on_cpu and interpreting():
            return f"{t.device.type} tensor while TRITON_INTERPRET=1 (interpreter runs on CPU tensors)"
        if dtypes is not None and t.dtype not in dtypes:
            return f"dtype {t.dtype} not in {[str(d) for d in dtypes]}"
    return None


def block_rows(block_cols: int) -> int:
    """Rows per program: a 2-D tile of about 4K elements on a GPU; 64-256 rows under the interpreter
    (one row per program is ~20x slower there)."""
    budget = 1 << 16 if interpreting() else 4096
    return max(1, min(256 if interpreting() else 64, budget // block_cols))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous ``[N, last]`` matrix."""
    return x.reshape(-1, x.shape[-1]).contiguous()


if interpreting():
    _fix_interpreter_loop_bounds()
