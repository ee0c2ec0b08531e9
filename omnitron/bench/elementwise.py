"""``omnitron bench elementwise``: the element-wise ops of a Transformer layer (the work between its GEMMs), forward
and backward, by element count: what ``omnitron plan``'s speed model prices them with.

Ops (plain torch, autograd; the CPU runs them unfused): ``dropout`` (the random mask and its multiply),
``gelu``, ``silu_mul`` (SwiGLU's gate), ``layer_norm`` and ``rms_norm`` (rows of ``width``), ``softmax`` (rows of
``width``), ``add`` (the residual), ``cross_entropy`` (rows of ``width`` classes), and ``adamw`` (one
``torch.optim.AdamW`` step per element, mode ``step``); ring attention's own: ``block_dropout`` (the ring's
seeded mask of one block, :func:`omnitron.core.parallel.context.ring.block_dropout`, and its multiply) and
``ring_merge`` (the merge of one block's partial result into the running output, head dim 64; forward only:
the ring's backward recomputes instead). A row's ``ms`` is the median of the forward alone
(mode ``fwd``) or of the backward alone (mode ``bwd``: forward + backward minus forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.bench.timing import median_ms

OPS = ("dropout", "gelu", "silu_mul", "layer_norm", "rms_norm", "softmax", "add", "cross_entropy", "adamw",
       "block_dropout", "ring_merge")
_FORWARD_ONLY = ("ring_merge",)


def _fn(op: str, n: int, width: int, dtype, dev):
    """(forward closure returning a tensor to backpropagate, its inputs needing gradients)."""
    rows = max(1, n // width)
    x = torch.randn(rows, width, device=dev, dtype=dtype, requires_grad=True)
    if op == "dropout":
        return (lambda: F.dropout(x, 0.1, training=True)), x
    if op == "gelu":
        return (lambda: F.gelu(x)), x
    if op == "silu_mul":
        y = torch.randn_like(x, requires_grad=True)
        return (lambda: F.silu(x) * y), x
    if op in ("layer_norm", "rms_norm"):
        w = torch.ones(width, device=dev, dtype=dtype, requires_grad=True)
        if op == "layer_norm":
            return (lambda: F.layer_norm(x, (width,), w, torch.zeros_like(w))), x
        return (lambda: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(dtype) * w), x
    if op == "softmax":
        return (lambda: x.float().softmax(-1).to(dtype)), x
    if op == "add":
        y = torch.randn_like(x, requires_grad=True)
        return (lambda: x + y), x
    if op == "block_dropout":
        from omnitron.core.parallel.context.ring import block_dropout

        return (lambda: x * block_dropout(1, 0, 1, x.shape, 0.1, dtype, dev)), x
    if op == "ring_merge":
        from omnitron.core.parallel.context.ring import _merge

        shape = (1, 1, max(1, n // 64), 64)
        out, o = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(2))
        lse, lo = (torch.randn(shape[:3], device=dev, dtype=dtype) for _ in range(2))
        return (lambda: _merge(out, lse, o, lo)), None
    if op == "cross_entropy":
        target = torch.randint(0, width, (rows,), device=dev)
        return (lambda: F.cross_entropy(x.float(), target)), x
    raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")


def _adamw_ms(n: int, dev, rounds: int, budget_s: float, backend) -> float:
    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return median_ms(opt.step, backend, rounds=rounds, budget_s=budget_s)


def run(backend, *, sizes: list[int], ops=OPS, width: int = 256, dtype=torch.float32, rounds: int = 5,
        budget_s: float = 0.5, log=print) -> list[dict]:
    """Rows ``{op, mode, elements, ms, width, dtype}`` for every op and size."""
    dev, name, rows = backend.current_device(), str(dtype).replace("torch.", ""), []
    for op in ops:
        for n in sizes:
            if op == "adamw":
                got = {"step": _adamw_ms(n, dev, rounds, budget_s, backend)}
            elif op in _FORWARD_ONLY:
                got = {"fwd": median_ms(_fn(op, n, width, dtype, dev)[0], backend, rounds=rounds, budget_s=budget_s)}
            else:
                fwd, x = _fn(op, n, width, dtype, dev)
                out = fwd()
                grad = torch.ones_like(out)

                def both():
                    x.grad = None
                    fwd().backward(grad)

                f_ms = median_ms(fwd, backend, rounds=rounds, budget_s=budget_s)
                got = {"fwd": f_ms, "bwd": max(0.0, median_ms(both, backend, rounds=rounds, budget_s=budget_s) - f_ms)}
            for mode, ms in got.items():
                rows.append({"op": op, "mode": mode, "elements": n, "ms": ms, "width": width, "dtype": name})
                log(f"elementwise {op:14s} {mode:4s} {n:>10d}: {ms:9.4f} ms")
    return rows
