"""Newton-Schulz orthogonalisation of one matrix, and Muon's update scale (pure functions, no groups).

``orthogonalize(x)`` returns approximately ``U V^T`` of ``x = U S V^T``: ``x`` is divided by its Frobenius
norm (so every singular value is <= 1), then each step maps ``X -> a X + (b A + c A^2) X`` with ``A = X X^T``,
an odd polynomial in the singular values that pushes them towards 1 (not all the way: the tuned coefficients
trade exactness for speed, leaving them in roughly [0.7, 1.2]). A tall matrix is transposed first so that
``A`` is the smaller Gram matrix. Coefficient sets and defaults are Megatron's (``--muon-coefficient-type``,
``--muon-num-ns-steps``): "simple" repeats one triple, "quintic" cycles five, "polar_express" takes its eight in
order and repeats its last.
"""
from __future__ import annotations

import torch

COEFFICIENTS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    # Keller Jordan's modded-nanogpt quintic schedule, as Megatron's default
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
    # Amsel et al., "The Polar Express" (arXiv:2505.16932)
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                      (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
}

NORM_EPS = 1e-7
"""Floor of the Frobenius norm the input is divided by (a zero matrix stays zero)."""


def coefficient_schedule(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations, as Megatron's Muon picks them: "simple" and "quintic"
    cycle through their sets (4 quintic steps take the first four), "polar_express" runs its sets in order and
    repeats the last (fewer steps take the first ones). ValueError naming the flag for an unknown kind or
    ``steps < 1``."""
    if kind not in COEFFICIENTS:
        raise ValueError(f"--muon-coefficient-type {kind!r} is not supported; use {', '.join(COEFFICIENTS)}")
    if steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {steps}")
    sets = COEFFICIENTS[kind]
    if kind == "polar_express":
        return [sets[min(i, len(sets) - 1)] for i in range(steps)]
    return [sets[i % len(sets)] for i in range(steps)]


def orthogonalize(x: torch.Tensor, coefficients: list[tuple[float, float, float]], *, bf16: bool) -> torch.Tensor:
    """``x`` ``[m, n]`` (fp32 or fp64) -> its approximate orthogonal factor, same shape and dtype. ``bf16``: run
    the iterations in bf16 (``--muon-fp32-matmul-prec medium``), normalising and returning in ``x``'s dtype."""
    if x.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalises matrices; got shape {tuple(x.shape)}")
    tall = x.shape[0] > x.shape[1]
    X = x.mT if tall else x
    X = X / X.norm().clamp_min(NORM_EPS)
    if bf16:
        X = X.bfloat16()
    for a, b, c in coefficients:
        A = X @ X.mT  # [k, k], k = min(m, n)
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a, alpha=1.0)  # a X + B X
    X = X.to(x.dtype)
    return X.mT if tall else X


def update_scale(rows: int, cols: int, mode: str) -> float:
    """The factor on the orthogonalised update of a ``rows x cols`` matrix (``--muon-scale-mode``): "spectral"
    sqrt(max(rows, cols)) gives the update an RMS near 1, like Adam's (Kimi's Moonlight, arXiv:2502.16982);
    "unit_rms_norm" sqrt(rows / cols) (Scion); "shape_scaling" sqrt(max(1, rows / cols)) (Keller Jordan)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    raise ValueError(f"--muon-scale-mode {mode!r} is not supported; use spectral, unit_rms_norm or shape_scaling")
