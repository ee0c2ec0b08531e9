"""Benchmark workloads for ``omnitron bench kernels``: one realistic size per op, and the
torch-native fused baseline where stock PyTorch has one (``F.rms_norm``, ``F.layer_norm``,
``F.cross_entropy``, ``torch.optim.AdamW(fused=True)``, ``torch._foreach_norm``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    """One op at one size: ``make(device, dtype, size) -> (args, kwargs)``; ``native`` mirrors the op's call."""

    op: str
    make: Callable
    differentiable: bool = True
    native: Callable | None = None
    float_only: bool = False
    """The op takes float32 state whatever the benchmark dtype (AdamW)."""
    grad_args: tuple[int, ...] | None = None
    """Positions of the arguments differentiated in ``fwd+bwd`` (None: every float tensor)."""


def _pick(size: str, tiny, small, large):
    """The value for problem size ``tiny`` (tests), ``small`` (CPU) or ``large`` (GPU)."""
    return {"tiny": tiny, "small": small, "large": large}[size]


def _rows(size):
    return _pick(size, (256, 256), (4096, 1024), (16384, 4096))


def _norm(device, dtype, size):
    n, d = _rows(size)
    x = torch.randn(n, d, device=device, dtype=dtype)
    w = torch.randn(d, device=device, dtype=dtype)
    return (x, w), {"eps": 1e-5}


def _ln(device, dtype, size):
    (x, w), kw = _norm(device, dtype, size)
    return (x, w, torch.randn_like(w)), kw


def _add_norm(device, dtype, size):
    (x, w), kw = _norm(device, dtype, size)
    return (x, torch.randn_like(x), w), kw


def _native_add_rms(x, r, w, eps):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, eps), h


def _glu(device, dtype, size):
    n, d = _rows(size)
    return (torch.randn(n, 2 * d, device=device, dtype=dtype),), {}


def _gelu(device, dtype, size):
    n, d = _rows(size)
    return (torch.randn(n, d, device=device, dtype=dtype), torch.randn(d, device=device, dtype=dtype)), {}


def _rope(device, dtype, size):
    s, b, h, d = _pick(size, (64, 2, 4, 64), (512, 4, 16, 128), (4096, 2, 32, 128))
    t = torch.randn(s, b, h, d, device=device, dtype=dtype)
    return (t, torch.rand(s, 1, 1, d // 2, device=device) * 6), {"interleaved": False}


def _ce(device, dtype, size):
    n, v = _pick(size, (64, 1000), (512, 32000), (8192, 128256))
    logits = torch.randn(n, v, device=device, dtype=dtype)
    return (logits, torch.randint(0, v, (n,), device=device)), {"label_smoothing": 0.0}


def _ce_shard(device, dtype, size):
    """The second of two tensor-parallel vocabulary shards; its last 10% of columns are padding."""
    n, v = _pick(size, (64, 1000), (512, 32000), (8192, 128256))
    width = v // 2
    valid = width - width // 10
    logits = torch.randn(n, width, device=device, dtype=dtype)
    return (logits, torch.randint(0, width + valid, (n,), device=device), width, valid, width + valid), {}


def _ce_shard_grad(device, dtype, size):
    (logits, target, start, valid, vocab), _ = _ce_shard(device, dtype, size)
    lse = torch.logsumexp(logits.float(), -1) + 1.0  # stands in for the global log-sum-exp
    return (torch.randn(logits.shape[0], device=device), logits, target, lse, start, valid, vocab, 0.1), {}


def _softmax(device, dtype, size):
    b, h, s = _pick(size, (1, 2, 64), (2, 8, 512), (4, 32, 1024))
    return (torch.randn(b, h, s, s, device=device, dtype=dtype),), {"scale": 0.125, "causal": True}


def _params(device, size):
    sizes = _pick(size, [4096] * 4 + [33], [1024 * 1024] * 8 + [1024] * 16, [4096 * 4096] * 8)
    return [torch.randn(n, device=device) for n in sizes]


def _adamw(device, dtype, size):
    ps = _params(device, size)
    args = (ps, [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps])
    return args, {"step": 10, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}


def _norm_sq(device, dtype, size):
    return ([p.to(dtype) for p in _params(device, size)],), {}


def _fp8(device, dtype, size):
    n, d = _rows(size)
    return (torch.randn(n, d, device=device, dtype=dtype), torch.tensor(4.0, device=device)), {"fmt": "e4m3"}


def _native_adamw(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    """``torch.optim.AdamW(fused=True)`` on the same tensors (state built once, then reused)."""
    key = id(params[0])
    opt = _native_adamw.cache.get(key)
    if opt is None:
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, fused=True)
        _native_adamw.cache = {key: opt}
    opt.step()


_native_adamw.cache = {}

CASES = [
    Case("rms_norm", _norm, native=lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps)),
    Case("layer_norm", _ln, native=lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps)),
    Case("add_rms_norm", _add_norm, native=_native_add_rms),
    Case("swiglu", _glu),
    Case("geglu", _glu),
    Case("bias_gelu", _gelu),
    Case("rope", _rope, grad_args=(0,)),
    Case("softmax_cross_entropy", _ce,
         native=lambda x, t, label_smoothing: F.cross_entropy(x.float(), t, reduction="none",
                                                              label_smoothing=label_smoothing)),
    Case("cross_entropy_shard_stats", _ce_shard, differentiable=False),
    Case("cross_entropy_shard_grad", _ce_shard_grad, differentiable=False),
    Case("scaled_softmax", _softmax),
    Case("adamw_step", _adamw, differentiable=False, native=_native_adamw, float_only=True),
    Case("grad_norm_sq", _norm_sq, differentiable=False,
         native=lambda ts: torch.stack(torch._foreach_norm(ts)).float().pow(2).sum()),
    Case("fp8_cast_transpose_amax", _fp8, differentiable=False),
]
