"""Fresh random inputs for every kernel op, for comparing implementations with the reference.

``CASES[op](device, dtype)`` returns a list of :class:`Case`. A new op registered with a
non-reference implementation needs an entry here (the suite fails until it has one).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class Case:
    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    grad: tuple[int, ...] = ()
    """Indices of ``args`` (floating tensors) to differentiate; empty for ops without autograd."""
    inplace: tuple[int, ...] = ()
    """Indices of ``args`` (tensor lists) the op updates in place; compared after the call."""


def _r(*shape, device, dtype, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


def _norms(device, dtype):
    x = _r(4, 3, 64, device=device, dtype=dtype)
    w = 1 + _r(64, device=device, dtype=dtype, scale=0.1)
    return [Case("rms", (x, w, 1e-5), grad=(0, 1)),
            Case("rms-fp32-weight", (x, w.float(), 1e-6), grad=(0, 1))]


def _add_norms(device, dtype, with_bias: bool):
    x, res = _r(4, 3, 64, device=device, dtype=dtype), _r(4, 3, 64, device=device, dtype=dtype)
    w = 1 + _r(64, device=device, dtype=dtype, scale=0.1)
    if not with_bias:
        return [Case("add-rms", (x, res, w, 1e-5), grad=(0, 1, 2))]
    b = _r(64, device=device, dtype=dtype, scale=0.1)
    return [Case("add-ln", (x, res, w, b, 1e-5), grad=(0, 1, 2, 3)), Case("add-ln-no-bias", (x, res, w, None, 1e-5),
                                                                         grad=(0, 1, 2))]


def _layer_norm(device, dtype):
    x = _r(4, 3, 48, device=device, dtype=dtype)
    w, b = 1 + _r(48, device=device, dtype=dtype, scale=0.1), _r(48, device=device, dtype=dtype, scale=0.1)
    return [Case("affine", (x, w, b, 1e-5), grad=(0, 1, 2)), Case("no-bias", (x, w, None, 1e-5), grad=(0, 1))]


def _glu(device, dtype):
    x, b = _r(5, 2, 96, device=device, dtype=dtype), _r(96, device=device, dtype=dtype, scale=0.1)
    return [Case("no-bias", (x,), grad=(0,)), Case("bias", (x, b), grad=(0, 1))]


def _geglu(device, dtype):
    return _glu(device, dtype) + [Case("erf", (_r(5, 2, 96, device=device, dtype=dtype), None),
                                       {"approximate": "none"}, grad=(0,))]


def _bias_gelu(device, dtype):
    x, b = _r(5, 2, 48, device=device, dtype=dtype), _r(48, device=device, dtype=dtype, scale=0.1)
    return [Case("tanh", (x, b), grad=(0, 1)), Case("erf", (x, b), {"approximate": "none"}, grad=(0, 1))]


def _bias_dropout_add(device, dtype):
    x, b, res = (_r(4, 2, 32, device=device, dtype=dtype), _r(32, device=device, dtype=dtype),
                 _r(4, 2, 32, device=device, dtype=dtype))
    return [Case("p0-train", (x, b, res, 0.0, True), grad=(0, 1, 2)),
            Case("eval", (x, b, res, 0.3, False), grad=(0, 1, 2)),
            Case("no-bias-eval", (x, None, res, 0.1, False), grad=(0, 2))]


def _rope(device, dtype):
    def angles(*shape):
        return torch.rand(*shape) .mul(6.0).to(device)

    t_s, t_b = _r(8, 2, 4, 32, device=device, dtype=dtype), _r(2, 8, 4, 32, device=device, dtype=dtype)
    return [Case("sbhd", (t_s, angles(8, 1, 1, 16)), {"interleaved": False}, grad=(0,)),
            Case("sbhd-interleaved", (t_s, angles(8, 1, 1, 16)), {"interleaved": True}, grad=(0,)),
            Case("bshd", (t_b, angles(1, 8, 1, 16)), {"interleaved": False}, grad=(0,)),
            Case("bshd-interleaved", (t_b, angles(1, 8, 1, 16)), {"interleaved": True}, grad=(0,)),
            Case("partial", (t_s, angles(8, 1, 1, 8)), {"interleaved": False}, grad=(0,))]


def _cross_entropy(device, dtype):
    logits = _r(6, 3, 50, device=device, dtype=dtype, scale=2.0)
    target = torch.randint(0, 50, (6, 3), device=device)
    return [Case("plain", (logits, target, 0.0), grad=(0,)), Case("smoothing", (logits, target, 0.1), grad=(0,))]


def _scaled_softmax(device, dtype):
    x = _r(2, 4, 8, 8, device=device, dtype=dtype, scale=2.0)
    mask = torch.rand(2, 1, 8, 8, device=device) < 0.3
    mask[..., 0] = False  # keep one position per row
    return [Case("causal", (x, 0.5, None, True), grad=(0,)), Case("mask", (x, 0.7, mask, False), grad=(0,))]


def _attention(device, dtype):
    def qkv(hq, hkv, d, s=16):
        return (_r(2, hq, s, d, device=device, dtype=dtype), _r(2, hkv, s, d, device=device, dtype=dtype),
                _r(2, hkv, s, d, device=device, dtype=dtype))

    return [Case("mha-causal-d64", qkv(4, 4, 64), {"causal": True}, grad=(0, 1, 2)),
            Case("gqa-d128", qkv(4, 2, 128), {"causal": False, "scale": 0.05}, grad=(0, 1, 2)),
            Case("gqa-causal-d32", qkv(4, 1, 32), {"causal": True}, grad=(0, 1, 2))]


def _attention_block(device, dtype, backward=False):
    """Ring-attention blocks, in float32 whatever ``dtype`` (the ring computes its blocks in fp32);
    the backward cases carry the reference forward's output and log-sum-exp."""
    from omnitron.kernels.reference.attention_block import block_forward

    cases = []
    for label, hq, hkv, sq, sk, causal in (("mha-causal", 4, 4, 16, 16, True), ("gqa-rect", 4, 2, 16, 24, False),
                                           ("mqa-causal", 4, 1, 16, 16, True)):
        q = _r(2, hq, sq, 32, device=device, dtype=torch.float32)
        k, v = (_r(2, hkv, sk, 32, device=device, dtype=torch.float32) for _ in range(2))
        kw = {"causal": causal, "scale": 0.2}
        if backward:
            out, lse = block_forward(q, k, v, **kw)
            cases.append(Case(label, (_r(*out.shape, device=device, dtype=torch.float32), q, k, v, out, lse), kw))
        else:
            cases.append(Case(label, (q, k, v), kw))
    return cases


def _adamw(device, dtype):
    shapes = [(10,), (3, 4), (5, 1, 2)]
    params = [_r(*s, device=device, dtype=torch.float32) for s in shapes]
    grads = [_r(*s, device=device, dtype=dtype) for s in shapes]
    m = [_r(*s, device=device, dtype=torch.float32, scale=0.1) for s in shapes]
    v = [_r(*s, device=device, dtype=torch.float32, scale=0.1).abs() for s in shapes]
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return [Case("lists", (params, grads, m, v), kw, inplace=(0, 2, 3))]


def _grad_norm(device, dtype):
    return [Case("lists", ([_r(7, device=device, dtype=dtype), _r(3, 5, device=device, dtype=dtype)],))]


def _fp8_cast(device, dtype):
    x = _r(64, 96, device=device, dtype=dtype, scale=3.0)
    fit = 448.0 / x.float().abs().amax()
    return [Case(f"{fmt}-x{k}", (x, (fit * k).float().reshape(()), fmt))
            for fmt in ("e4m3", "e5m2") for k in (0.5, 4.0)]  # k=4: values past the format's max saturate


CASES: dict[str, Callable[[torch.device, torch.dtype], list[Case]]] = {
    "rms_norm": _norms, "layer_norm": _layer_norm, "swiglu": _glu, "geglu": _geglu, "bias_gelu": _bias_gelu,
    "bias_dropout_add": _bias_dropout_add, "rope": _rope, "softmax_cross_entropy": _cross_entropy,
    "scaled_softmax": _scaled_softmax, "attention": _attention, "adamw_step": _adamw, "grad_norm_sq": _grad_norm,
    "fp8_cast_transpose_amax": _fp8_cast,
    "attention_block_forward": _attention_block,
    "attention_block_backward": lambda device, dtype: _attention_block(device, dtype, backward=True),
    "add_rms_norm": lambda device, dtype: _add_norms(device, dtype, False),
    "add_layer_norm": lambda device, dtype: _add_norms(device, dtype, True),
}


def cases_for(op: str, device, dtype) -> list[Case] | None:
    """This file's cases for ``op``; else the kernel benchmark's smallest workload
    (``omnitron.kernels.bench_cases``), so a new op with a benchmark case is covered at once."""
    if op in CASES:
        return CASES[op](device, dtype)
    try:
        from omnitron.kernels.bench_cases import CASES as BENCH
    except ImportError:
        return None
    for bench in BENCH:
        if bench.op == op:
            args, kwargs = bench.make(device, torch.float32 if bench.float_only else dtype, "tiny")
            grad = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
                         and bench.differentiable)
            inplace = () if bench.differentiable else tuple(i for i, a in enumerate(args) if isinstance(a, list))
            return [Case("bench-tiny", tuple(args), dict(kwargs), grad=grad, inplace=inplace)]
    return None
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}
GRAD_TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=8e-2, rtol=8e-2)}


def clone_args(args: tuple, grad: tuple[int, ...]) -> tuple:
    """Deep copies of ``args`` (tensors and tensor lists), with ``requires_grad`` on ``grad`` indices."""
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            a = a.detach().clone().requires_grad_(i in grad)
        elif isinstance(a, list):
            a = [t.detach().clone() for t in a]
        out.append(a)
    return tuple(out)
