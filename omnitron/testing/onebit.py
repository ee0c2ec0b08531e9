"""float64 one-process references of 1-bit Adam's maths, written from the definition (for the tests).

:func:`compressed_mean` is one compressed all-reduce over ``len(xs)`` ranks; :func:`adam_reference`
runs the whole optimizer (AdamW warm-up, then frozen variance and compressed momentum) on known per-rank
gradients. Neither uses omnitron.core.parallel.data.compressed or omnitron.core.optim.onebit.
"""
from __future__ import annotations

import math

import torch


def padded(numel: int, dp: int, block: int | None = None) -> int:
    """``numel`` rounded up to a multiple of ``dp x block`` (``dp x 8`` without blocks)."""
    m = dp * (block or 8)
    return -(-numel // m) * m


def _one_bit(z: torch.Tensor, block: int | None) -> torch.Tensor:
    """Each block of ``z``: mean|block| x sgn(block), with sgn(0) = +1 (one block: all of ``z``)."""
    block = block or z.numel()
    return torch.cat([b.abs().mean() * torch.where(b >= 0, 1.0, -1.0).to(z.dtype) for b in z.split(block)])


def compressed_mean(xs: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor],
                    block: int | None = None) -> torch.Tensor:
    """One compressed all-reduce of the flat ``xs`` (one per rank), float64, one scale per ``block`` elements
    (None: per chunk); updates the error lists in place (``worker[r]``: rank r's padded error, ``server[k]``:
    the owner of chunk k's error)."""
    dp, numel = len(xs), xs[0].numel()
    n = padded(numel, dp, block) // dp
    sent = []
    for r in range(dp):
        z = torch.nn.functional.pad(xs[r].double(), (0, dp * n - numel)) + worker[r]
        c = torch.cat([_one_bit(z[k * n:(k + 1) * n], block) for k in range(dp)])
        worker[r] = z - c
        sent.append(c)
    out = []
    for k in range(dp):
        u = sum(s[k * n:(k + 1) * n] for s in sent) / dp + server[k]
        c = _one_bit(u, block)
        server[k] = u - c
        out.append(c)
    return torch.cat(out)[:numel]


def adam_reference(params: list[torch.Tensor], decay: list[bool], grads_fn, steps: int, *, freeze: int, dp: int,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, clip: float,
                   block: int | None = None):
    """1-bit Adam in float64 on ``params`` (one buffer: all of them, flattened in order).

    ``grads_fn(step, params) -> [rank][param]`` gives each rank's local gradients at the current params.
    Warm-up steps use the mean gradient, clipped, and AdamW; later ones each rank's own, unclipped (their
    norm: the RMS of the local norms), the momentum compressed as m / (sqrt(v / (1 - b2^F)) + eps), clamped
    to the bound of exact Adam's m / sqrt(v); elements whose frozen variance is zero keep a zero momentum. Returns
    (params after each step, the norm of each step)."""
    p = [t.double().clone() for t in params]
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    numel = sum(t.numel() for t in p)
    worker = [torch.zeros(padded(numel, dp, block), dtype=torch.float64) for _ in range(dp)]
    server = [torch.zeros(padded(numel, dp, block) // dp, dtype=torch.float64) for _ in range(dp)]
    history, norms = [], []
    for t in range(1, steps + 1):
        local = [[g.double() for g in gs] for gs in grads_fn(t, p)]
        if t <= freeze:
            g = [sum(gs[i] for gs in local) / dp for i in range(len(p))]
            norm = math.sqrt(sum(float(x.square().sum()) for x in g))
        else:
            norm = math.sqrt(sum(sum(float(x.square().sum()) for x in gs) for gs in local) / dp)
        coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 and t <= freeze else 1.0  # clipping: warm-up only
        norms.append(norm)
        if t <= freeze:
            for i, gi in enumerate(g):
                m[i] = beta1 * m[i] + (1 - beta1) * coef * gi
                v[i] = beta2 * v[i] + (1 - beta2) * (coef * gi) ** 2
            bc2 = 1 - beta2 ** t
        else:
            bc2 = 1 - beta2 ** freeze
            d = [(vi / bc2).sqrt() + eps for vi in v]  # the frozen preconditioner; u = m / d travels
            live = [vi != 0 for vi in v]
            bound = (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))  # exact Adam's |m / sqrt(v)|
            flats = [torch.cat([((beta1 * m[i] + (1 - beta1) * coef * gs[i]) / d[i] * live[i]).clamp(-bound, bound)
                                .reshape(-1) for i in range(len(p))]) for gs in local]
            mean = compressed_mean(flats, worker, server, block)
            u = [x.view_as(t_) for x, t_ in zip(torch.split(mean, [t_.numel() for t_ in p]), p)]
            m = [ui * li * di for ui, li, di in zip(u, live, d)]  # no momentum where the warm-up saw no gradient
        bc1 = 1 - beta1 ** t
        for i in range(len(p)):
            if decay[i]:
                p[i] = p[i] * (1 - lr * weight_decay)
            p[i] = p[i] - lr / bc1 * m[i] / ((v[i] / bc2).sqrt() + eps)
        history.append([x.clone() for x in p])
    return history, norms
