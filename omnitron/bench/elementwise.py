"""``omnitron bench elementwise``: the element-wise ops of a Transformer layer (the work between its GEMMs), forward
and backward, by element count: what ``omnitron plan``'s speed model prices them with.

Ops (autograd; the engine's kernel where the layer calls one, through the backend's kernel table, else plain
torch): ``dropout`` (the random mask and its multiply), ``gelu`` (the ``bias_gelu`` kernel: tanh GeLU),
``silu_mul`` (the ``swiglu`` kernel, ``n`` outputs from ``2n`` inputs), ``layer_norm`` and ``rms_norm`` (the
kernels, rows of ``width``), ``softmax`` (rows of ``width``), ``add`` (the residual), ``cross_entropy`` (the
engine's vocab-parallel loss at one rank, rows of ``width`` classes), and ``adamw`` (one ``torch.optim.AdamW``
step per element, mode ``step``); ``host_layer``: one engine Transformer layer (GPT-2 style, dropout on) at 8
tokens and hidden 32, forward and backward, where the arithmetic is nothing and what remains is the host's
fixed cost of a layer (Python, dispatch, autograd; measured once, whatever the sizes); ``moe_dispatch`` (the
engine's MoE token dispatch and weighted combine at one ep rank,
:func:`omnitron.core.transformer.moe.dispatch.dispatch` / ``combine``: the pair mask's ``nonzero``, the
``index_select`` of the rows, the counts, the gate weighting and the ``index_add`` back; ``n`` = assignments x
``width``, top-2 of 8 experts); ring attention's own: ``block_dropout`` (the
hash dropout multiplier of one block's rows x ``width`` keys, :class:`omnitron.kernels.hash_dropout.HashDropout`,
and its multiply) and
``ring_merge`` (the merge of one block's partial result into the running output, head dim 64; forward only:
the ring's backward recomputes instead). A row's ``ms`` is the median of the forward alone
(mode ``fwd``) or of the backward alone (mode ``bwd``: forward + backward minus forward).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.bench.timing import median_ms

OPS = ("dropout", "gelu", "silu_mul", "layer_norm", "rms_norm", "softmax", "add", "cross_entropy", "adamw",
       "block_dropout", "ring_merge", "moe_dispatch", "host_layer")
HOST_LAYER = dict(tokens=8, hidden=32)
"""The ``host_layer`` op's shapes: small enough that a layer's time is its fixed per-call cost."""
_FORWARD_ONLY = ("ring_merge",)


def host_layer_config(dtype=torch.float32):
    """The one-layer GPT-2-style config the ``host_layer`` op runs (and ``omnitron plan`` prices) at
    :data:`HOST_LAYER`'s shapes."""
    from omnitron.core.models.gpt.presets import gpt2_tiny

    t, h = HOST_LAYER["tokens"], HOST_LAYER["hidden"]
    return gpt2_tiny(num_layers=1, hidden_size=h, num_attention_heads=2, ffn_hidden_size=4 * h, seq_length=t,
                     max_position_embeddings=t, vocab_size=64, params_dtype=dtype)


def _host_layer(backend, dtype):
    """(forward closure, input) of one engine layer at :data:`HOST_LAYER`'s shapes."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import to_device

    t, h = HOST_LAYER["tokens"], HOST_LAYER["hidden"]
    cfg = host_layer_config(dtype)
    model = to_device(GPTModel(cfg, ParallelGroups.single(), backend=backend), backend.current_device()).train()
    layer = next(iter(model.decoder.layers.values()))
    x = torch.randn(t, 1, h, device=backend.current_device(), dtype=dtype, requires_grad=True)
    return (lambda: layer(x)), x


def _moe_dispatch(n: int, width: int, dtype, dev):
    """(forward closure, input): dispatch + combine of ``n / width`` top-2 assignments over 8 experts (ep 1)."""
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe.dispatch import combine, dispatch

    experts, tokens = 8, max(1, n // (2 * width))
    x = torch.randn(tokens, width, device=dev, dtype=dtype, requires_grad=True)
    picks = torch.rand(tokens, experts, device=dev).topk(2, dim=-1).indices
    mask = torch.zeros(tokens, experts, dtype=torch.bool, device=dev).scatter_(1, picks, True)
    gates = torch.rand(tokens, experts, device=dev, dtype=dtype).masked_fill(~mask, 0.0).requires_grad_()
    ep = ParallelGroups.single().ep

    def fwd():
        rows, plan = dispatch(x, mask, ep)
        return combine(rows, gates, plan, ep)
    return fwd, x


def _fn(op: str, n: int, width: int, dtype, dev, kernels=None):
    """(forward closure returning a tensor to backpropagate, its inputs needing gradients); ``kernels``: the
    backend's kernel table (the engine's own kernels), default the host CPU backend's."""
    if kernels is None:
        from omnitron.core.parallel.groups import host_backend

        kernels = host_backend().kernels
    rows = max(1, n // width)
    x = torch.randn(rows, width, device=dev, dtype=dtype, requires_grad=True)
    if op == "dropout":
        return (lambda: F.dropout(x, 0.1, training=True)), x
    if op == "gelu":
        return (lambda: kernels.bias_gelu(x, None)), x
    if op == "silu_mul":
        x2 = torch.randn(rows, 2 * width, device=dev, dtype=dtype, requires_grad=True)
        return (lambda: kernels.swiglu(x2, None)), x2
    if op in ("layer_norm", "rms_norm"):
        w = torch.ones(width, device=dev, dtype=dtype, requires_grad=True)
        if op == "layer_norm":
            b = torch.zeros(width, device=dev, dtype=dtype, requires_grad=True)
            return (lambda: kernels.layer_norm(x, w, b, 1e-5)), x
        return (lambda: kernels.rms_norm(x, w, 1e-5)), x
    if op == "softmax":
        return (lambda: x.float().softmax(-1).to(dtype)), x
    if op == "add":
        y = torch.randn_like(x, requires_grad=True)
        return (lambda: x + y), x
    if op == "block_dropout":
        from omnitron.kernels.hash_dropout import HashDropout

        drop = HashDropout(1, 0.1, torch.arange(rows, device=dev), torch.arange(width, device=dev))
        return (lambda: x * drop.multiplier(1, 1, slice(None), dtype)[0, 0]), x
    if op == "ring_merge":
        from omnitron.core.parallel.context.blocks import merge as _merge

        shape = (1, 1, max(1, n // 64), 64)
        out, o = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(2))
        lse, lo = (torch.randn(shape[:3], device=dev, dtype=dtype) for _ in range(2))
        return (lambda: _merge(out, lse, o, lo)), None
    if op == "moe_dispatch":
        return _moe_dispatch(n, width, dtype, dev)
    if op == "cross_entropy":
        from omnitron.core.parallel.groups import ParallelGroups
        from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

        target, tp = torch.randint(0, width, (rows,), device=dev), ParallelGroups.single().tp
        return (lambda: vocab_parallel_cross_entropy(x, target, tp, kernels=kernels)), x
    raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")


def _adamw_ms(n: int, dev, rounds: int, budget_s: float, backend) -> float:
    p = torch.nn.Parameter(torch.randn(n, device=dev))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    return median_ms(opt.step, backend, rounds=rounds, budget_s=budget_s)


def _fwd_bwd_ms(fwd, x, backend, rounds: int, budget_s: float) -> dict[str, float]:
    """Median ms of the forward alone and of the backward alone (forward + backward minus forward)."""
    grad = torch.ones_like(fwd())

    def both():
        x.grad = None
        fwd().backward(grad)

    f_ms = median_ms(fwd, backend, rounds=rounds, budget_s=budget_s)
    return {"fwd": f_ms, "bwd": max(0.0, median_ms(both, backend, rounds=rounds, budget_s=budget_s) - f_ms)}


def run(backend, *, sizes: list[int], ops=OPS, width: int = 256, dtype=torch.float32, rounds: int = 5,
        budget_s: float = 0.5, log=print) -> list[dict]:
    """Rows ``{op, mode, elements, ms, width, dtype}`` for every op and size (``host_layer``: one size)."""
    dev, name, rows = backend.current_device(), str(dtype).replace("torch.", ""), []
    for op in ops:
        for n in sizes if op != "host_layer" else [HOST_LAYER["tokens"] * HOST_LAYER["hidden"]]:
            if op == "adamw":
                got = {"step": _adamw_ms(n, dev, rounds, budget_s, backend)}
            elif op == "host_layer":
                got = _fwd_bwd_ms(*_host_layer(backend, dtype), backend, rounds, budget_s)
            elif op in _FORWARD_ONLY:
                got = {"fwd": median_ms(_fn(op, n, width, dtype, dev, backend.kernels)[0], backend, rounds=rounds,
                                        budget_s=budget_s)}
            else:
                got = _fwd_bwd_ms(*_fn(op, n, width, dtype, dev, backend.kernels), backend, rounds, budget_s)
            for mode, ms in got.items():
                rows.append({"op": op, "mode": mode, "elements": n, "ms": ms, "width": width, "dtype": name})
                log(f"elementwise {op:14s} {mode:4s} {n:>10d}: {ms:9.4f} ms")
    return rows
