"""``omnitron bench attention``: the engine's attention (the backend's kernel table: SDPA, flash) against the
unfused math (scores materialised), forward + backward, by sequence length.

``tflops`` counts the two GEMMs of attention, ``4 b h s^2 d`` forward (halved when causal) and 2x that
backward: ``3 x`` in all, the model's FLOPs (Megatron's count, what MFU and ``omnitron plan`` use: no
recomputation). ``tflops_fa`` is the same time under FlashAttention's benchmark count (its
``benchmarks/benchmark_flash_attention.py``: the backward 2.5x the forward, its five GEMMs with the scores
recomputed, so ``3.5 x`` in all), the figure to set beside FlashAttention's published ones.

The engine's op is measured without and with attention dropout (``dropout`` 0.0 and 0.1: what
``--attention-dropout`` makes the layer call; on a CPU SDPA then leaves its fused path), the math version
without.

Ring attention's per-block kernel (impl ``ring_block``: the backend's ``attention_block_forward`` and
``attention_block_backward``, what each step of context parallelism runs) is measured beside them on one
block of ``s`` query and key rows, causal (a ring's first step) and not (every later step), with the ring's
seeded dropout mask at ``p = 0.1`` drawn before the forward and again before the backward, as the ring does
(``dropout`` 0.0: no mask), so ``omnitron plan`` prices context parallelism's attention from its own kernel.
"""
from __future__ import annotations

import torch

from omnitron.bench.timing import median_ms

FA_PER_MODEL = 3.5 / 3
"""FlashAttention's fwd + bwd FLOPs (3.5 x forward) over the model's (3 x forward)."""


def _figures(flops: float, ms: float) -> dict:
    """``tflops`` (the model's FLOPs, ``flops``) and ``tflops_fa`` (FlashAttention's count) of one call."""
    tflops = flops / (ms * 1e-3) / 1e12
    return {"tflops": tflops, "tflops_fa": tflops * FA_PER_MODEL}


def _math(q, k, v, causal: bool = True):
    """Unfused attention: the score matrix materialised, softmax in fp32 (what a fused kernel saves)."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    if causal:
        s = q.shape[-2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores.softmax(-1).to(q.dtype) @ v


def _impls(backend):
    """(name, fn(q, k, v, causal)): the backend's resolution of the ``attention`` op (SDPA as the reference,
    or a fused kernel of the backend), and the unfused ``math`` version."""
    table = backend.kernels
    return [(f"op:{table.resolved('attention')}", table.get("attention")), ("math", _math)]


def run(backend, *, seqs: list[int], heads: int = 8, head_dim: int = 64, batch: int = 1, dtype=torch.bfloat16,
        causal: bool = True, rounds: int = 5, budget_s: float = 2.0, log=print) -> list[dict]:
    dev, rows = backend.current_device(), []
    name = str(dtype).replace("torch.", "")
    for s in seqs:
        gen = torch.Generator(device="cpu").manual_seed(s)
        q, k, v = (torch.randn(batch, heads, s, head_dim, generator=gen).to(dev, dtype).requires_grad_()
                   for _ in range(3))
        grad = torch.randn(batch, heads, s, head_dim, generator=gen).to(dev, dtype)
        flops = 3 * 4 * batch * heads * s * s * head_dim * (0.5 if causal else 1.0)
        for impl, fn in _impls(backend):
            for p in (0.0, 0.1) if impl.startswith("op:") else (0.0,):
                def step(fn=fn, p=p):
                    q.grad = k.grad = v.grad = None
                    (fn(q, k, v, causal=causal, dropout_p=p) if p else fn(q, k, v, causal=causal)).backward(grad)

                ms = median_ms(step, backend, rounds=rounds, budget_s=budget_s)
                rows.append({"impl": impl, "dtype": name, "seq": s, "heads": heads, "head_dim": head_dim,
                             "causal": causal, "batch": batch, "dropout": p, "ms": ms, **_figures(flops, ms)})
                log(f"attention {impl:10s} seq {s:6d} dropout {p}: {ms:9.3f} ms {rows[-1]['tflops']:8.3f} TFLOP/s")
        rows += _ring_rows(backend, q.detach(), k.detach(), v.detach(), grad, rounds, budget_s, log)
    return rows


def _ring_rows(backend, q, k, v, grad, rounds: int, budget_s: float, log) -> list[dict]:
    """``ring_block`` rows at this sequence length: causal and full blocks, with and without dropout."""
    from omnitron.kernels.hash_dropout import block_positions

    kern, (b, h, s, d) = backend.kernels, q.shape
    out = []
    for causal in (True, False):
        for p in (0.0, 0.1):
            def step(causal=causal, p=p):
                pos = torch.arange(s, device=q.device)
                drop = block_positions(pos, pos, 1, p, device=q.device)  # the ring's hash dropout (None at p 0)
                o, lse = kern.attention_block_forward(q, k, v, causal=causal, scale=d ** -0.5, drop=drop)
                kern.attention_block_backward(grad, q, k, v, o, lse, causal=causal, scale=d ** -0.5, drop=drop)

            ms = median_ms(step, backend, rounds=rounds, budget_s=budget_s)
            flops = 3 * 4 * b * h * s * s * d * (0.5 if causal else 1.0)
            out.append({"impl": "ring_block", "dtype": str(q.dtype).replace("torch.", ""), "seq": s, "heads": h,
                        "head_dim": d, "causal": causal, "batch": b, "dropout": p, "ms": ms, **_figures(flops, ms)})
            log(f"attention ring_block seq {s:6d} causal {causal!s:5} dropout {p}: {ms:9.3f} ms "
                f"{out[-1]['tflops']:8.3f} TFLOP/s")
    return out
