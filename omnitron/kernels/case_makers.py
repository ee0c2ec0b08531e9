"""One input maker per kernel op (registered in cases.py): ``maker(device, dtype, size) -> [Case]``.

Each maker holds one table of variants per size: ``test`` (odd sizes, non-contiguous views, every
argument variant; these are the cases the conformance and backend suites check) and the benchmark
sizes ``tiny`` / ``small`` / ``large`` (one realistic workload). Random values are drawn on the
device at call time, so every call gives fresh tensors nobody else holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class Case:
    """One call of an op: ``op(*args, **kwargs)``."""

    label: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    grad: tuple[int | str, ...] = ()
    """The floating tensors to differentiate: positions in ``args`` or names in ``kwargs``; empty for
    ops without autograd."""
    inplace: tuple[int, ...] = ()
    """Positions in ``args`` of the tensor lists the op updates in place (compared after the call)."""
    long_sums: bool = False
    """A gradient sums hundreds of rows (the norms' weight grads at (300, 257)): in bf16, one ulp of an
    input moves it by more than a fixed tolerance allows, so only a bound scaled to the sum judges it
    (test_conformance.py's _check); tests/backends checks such cases in fp32 only."""
    sum_atol: float = 0.0
    """Absolute error the forward outputs may carry from long float32 sums (added to the suites' fixed
    atol): the maker computes it from the summed terms, e.g. ``_ce_shard_inputs``' row sums of 5000 logits."""
    may_decline: bool = False
    """A variant the fused kernels need not implement (exact-erf GeLU): an implementation the
    conformance suite requires (``OMNITRON_REQUIRE_IMPLS``) may decline it; the table falls back."""

    def mark_grad(self) -> Case:
        """Sets ``requires_grad`` on the ``grad`` tensors, in place (keeps their strides and views)."""
        for key in self.grad:
            (self.args[key] if isinstance(key, int) else self.kwargs[key]).requires_grad_()
        return self

    def copy(self, fn=None, grad: bool = True) -> tuple[tuple, dict]:
        """Deep copies ``(args, kwargs)`` of tensors and tensor lists, each passed through ``fn``
        (e.g. an upcast) first; ``grad``: the copies at ``grad`` positions require gradients."""
        def one(key, a):
            if isinstance(a, torch.Tensor):
                a = (fn(a) if fn is not None else a).detach().clone()
                return a.requires_grad_(grad and key in self.grad)
            if isinstance(a, list):
                return [(fn(t) if fn is not None else t).detach().clone() for t in a]
            return a
        return (tuple(one(i, a) for i, a in enumerate(self.args)),
                {k: one(k, v) for k, v in self.kwargs.items()})


def _pick(size: str, test, tiny, small, large):
    """The table for ``size``."""
    return {"test": test, "tiny": tiny, "small": small, "large": large}[size]


def _rows(size: str) -> tuple[int, int]:
    """(rows, width) of the benchmark's row-wise ops."""
    return _pick(size, None, (256, 256), (4096, 1024), (16384, 4096))


def _t(shape, dtype, device, scale=1.0, noncontig=False):
    """A random tensor; ``noncontig`` returns a strided view of a wider buffer with the same values' law."""
    if noncontig:
        base = torch.randn(*shape[:-1], shape[-1] * 2 + 1, device=device) * scale
        return base[..., 1::2][..., : shape[-1]].to(dtype)
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def _weight(d, dtype, device, spread=0.3):
    return (1 + spread * torch.randn(d, device=device)).to(dtype)


def _nc(nc: bool) -> str:
    return " nc" if nc else ""


# norms: (shape, non-contiguous, eps positional, weight in float32 whatever the input dtype)
# (300, 257): enough work that the CPU kernels split rows over threads (partial weight grads)
_RMS = ((3, 5, 33), False, False, False), ((7, 128), False, False, False), ((1, 1), False, False, False), \
       ((4, 2, 40), True, False, False), ((300, 257), False, False, False), ((4, 3, 64), False, True, False), \
       ((4, 3, 64), False, True, True)


def rms_norm(device, dtype, size):
    rows = _pick(size, _RMS, *[((_rows(s), False, False, False),) for s in ("tiny", "small", "large")])
    out = []
    for shape, nc, positional, fp32_w in rows:
        x = _t(shape, dtype, device, noncontig=nc)
        w = _weight(shape[-1], torch.float32 if fp32_w else dtype, device)
        eps = 1e-6 if fp32_w else 1e-5
        args, kw = ((x, w, eps), {}) if positional else ((x, w), {"eps": eps})
        label = f"{shape}{_nc(nc)}{' eps positional' if positional else ''}{' fp32 weight' if fp32_w else ''}"
        out.append(Case(label, args, kw, grad=(0, 1), long_sums=math.prod(shape[:-1]) >= 300))
    return out


# (shape, non-contiguous, bias, eps positional)
_LN = ((3, 5, 33), False, True, False), ((7, 128), False, False, False), ((2, 2, 40), True, True, False), \
      ((300, 257), False, True, False), ((4, 3, 48), False, True, True), ((4, 3, 48), False, False, True)


def layer_norm(device, dtype, size):
    rows = _pick(size, _LN, *[((_rows(s), False, True, False),) for s in ("tiny", "small", "large")])
    out = []
    for shape, nc, bias, positional in rows:
        x = _t(shape, dtype, device, noncontig=nc, scale=2.0)
        w = _weight(shape[-1], dtype, device)
        b = _t((shape[-1],), dtype, device) if bias else None
        args, kw = ((x, w, b, 1e-5), {}) if positional else ((x, w, b), {"eps": 1e-5})
        label = f"{shape}{_nc(nc)} bias={bias}{' eps positional' if positional else ''}"
        out.append(Case(label, args, kw, grad=(0, 1, 2) if bias else (0, 1), long_sums=math.prod(shape[:-1]) >= 300))
    return out


def add_rms_norm(device, dtype, size):
    """rms_norm's cases with a residual of the input's shape and dtype: ``(x, residual, w, [eps])``."""
    return [Case(c.label, (x, _t(x.shape, dtype, device), *rest), c.kwargs, grad=(0, 1, 2), long_sums=c.long_sums)
            for c in rms_norm(device, dtype, size) for x, *rest in [c.args]]


def add_layer_norm(device, dtype, size):
    return [Case(c.label, (x, _t(x.shape, dtype, device), *rest), c.kwargs,
                 grad=(0, 1, 2, 3) if rest[1] is not None else (0, 1, 2), long_sums=c.long_sums)
            for c in layer_norm(device, dtype, size) for x, *rest in [c.args]]


# (shape, non-contiguous, bias: None / "kw" / "positional")
_GLU = ((4, 3, 34), False, None), ((5, 128), False, "kw"), ((3, 2, 46), True, None), ((5, 2, 96), False, None), \
       ((5, 2, 96), False, "positional")


def swiglu(device, dtype, size):
    rows = _pick(size, _GLU, *[(((n, 2 * d), False, None),) for n, d in map(_rows, ("tiny", "small", "large"))])
    out = []
    for shape, nc, bias in rows:
        x = _t(shape, dtype, device, noncontig=nc, scale=2.0)
        b = _t((shape[-1],), dtype, device) if bias else None
        args, kw, grad = (x,), {}, (0,)
        if bias == "kw":
            kw, grad = {"bias": b}, (0, "bias")
        elif bias == "positional":
            args, grad = (x, b), (0, 1)
        out.append(Case(f"{shape}{_nc(nc)} bias={bias}", args, kw, grad=grad))
    return out


def geglu(device, dtype, size):
    """swiglu's cases with ``approximate="tanh"`` passed; for tests also the default and ``"none"`` (erf)."""
    out = [Case(c.label, c.args, {**c.kwargs, "approximate": "tanh"}, grad=c.grad) for c in swiglu(device, dtype, size)]
    if size == "test":
        out += [Case("(5, 2, 96) default approximate", (_t((5, 2, 96), dtype, device, scale=2.0),), grad=(0,)),
                Case("(5, 2, 96) erf", (_t((5, 2, 96), dtype, device, scale=2.0), None), {"approximate": "none"},
                     grad=(0,), may_decline=True)]
    return out


def bias_gelu(device, dtype, size):
    # (shape, non-contiguous, approximate: None (the default) or passed)
    rows = _pick(size, (((4, 3, 37), False, None), ((5, 2, 64), True, None), ((5, 2, 48), False, None),
                        ((5, 2, 48), False, "none")),
                 *[((_rows(s), False, None),) for s in ("tiny", "small", "large")])
    return [Case(f"{shape}{_nc(nc)} approximate={approx}",
                 (_t(shape, dtype, device, noncontig=nc, scale=2.0), _t((shape[-1],), dtype, device)),
                 {} if approx is None else {"approximate": approx}, grad=(0, 1), may_decline=approx == "none")
            for shape, nc, approx in rows]


def bias_dropout_add(device, dtype, size):
    x, b, res = _t((4, 2, 32), dtype, device), _t((32,), dtype, device), _t((4, 2, 32), dtype, device)
    return [Case("p0-train", (x, b, res, 0.0, True), grad=(0, 1, 2)),
            Case("eval", (x, b, res, 0.3, False), grad=(0, 1, 2)),
            Case("no-bias-eval", (x, None, res, 0.1, False), grad=(0, 2))]


# (s, b, h, d, rotary dims, layout, interleaved); "sbhd" is a permuted [b, s, h, d] buffer (the
# non-contiguous [s, b, h, d] view attention produces), "sbhd-contig" a contiguous one
_ROPE = ((6, 2, 3, 16, 16, "sbhd", False), (6, 2, 3, 16, 16, "sbhd", True), (6, 2, 3, 24, 8, "bshd", False),
         (6, 2, 3, 20, 12, "bshd", True), (8, 2, 4, 32, 32, "sbhd-contig", False),
         (8, 2, 4, 32, 32, "sbhd-contig", True), (8, 2, 4, 32, 16, "sbhd-contig", False),
         (8, 2, 4, 32, 32, "bshd", False), (8, 2, 4, 32, 32, "bshd", True))


def rope(device, dtype, size):
    rows = _pick(size, _ROPE, (64, 2, 4, 64, 64, "sbhd-contig", False), (512, 4, 16, 128, 128, "sbhd-contig", False),
                 (4096, 2, 32, 128, 128, "sbhd-contig", False))
    out = []
    for s, b, h, d, rot, layout, inter in (rows if size == "test" else (rows,)):
        freqs = torch.rand(s, rot // 2, device=device) * 6.0
        if layout == "sbhd":
            t, f = torch.randn(b, s, h, d, device=device).to(dtype).transpose(0, 1), freqs[:, None, None, :]
        elif layout == "sbhd-contig":
            t, f = torch.randn(s, b, h, d, device=device).to(dtype), freqs[:, None, None, :]
        else:
            t, f = torch.randn(b, s, h, d, device=device).to(dtype), freqs[None, :, None, :]
        out.append(Case(f"{layout} d={d} r={rot} interleaved={inter}", (t, f), {"interleaved": inter}, grad=(0,)))
    return out


def softmax_cross_entropy(device, dtype, size):
    # (shape, label smoothing, smoothing positional)
    rows = _pick(size, (((3, 5, 37), 0.0, False), ((6, 1000), 0.1, False), ((2, 3, 129), 0.0, False),
                        ((6, 3, 50), 0.0, True), ((6, 3, 50), 0.1, True)),
                 (((64, 1000), 0.0, False),), (((512, 32000), 0.0, False),), (((8192, 128256), 0.0, False),))
    out = []
    for shape, ls, positional in rows:
        logits = _t(shape, dtype, device, scale=3.0)
        target = torch.randint(0, shape[-1], shape[:-1], device=device)
        args, kw = ((logits, target, ls), {}) if positional else ((logits, target), {"label_smoothing": ls})
        out.append(Case(f"{shape} ls={ls}{' positional' if positional else ''}", args, kw, grad=(0,)))
    return out


def _ce_bench_shard(size):
    """The second of two tensor-parallel vocabulary shards; its last 10% of columns are padding."""
    n, v = _pick(size, None, (64, 1000), (512, 32000), (8192, 128256))
    width = v // 2
    return (n,), width, width, width - width // 10, width + width - width // 10, False


# (leading shape, shard width, start, valid, vocab, non-contiguous logits): whole vocabulary,
# a middle shard (most targets elsewhere), a last shard with padding, an all-padding shard,
# a strided view, rows long enough that the CPU kernels split them over threads, and the tiny
# benchmark workload
_CE_SHARDS = (((3, 5), 37, 0, 37, 37, False), ((7,), 40, 40, 40, 100, False), ((2, 3), 50, 100, 23, 123, False),
              ((4,), 16, 128, 0, 128, False), ((2, 3), 33, 33, 30, 63, True), ((9,), 5000, 5000, 4990, 9990, False),
              _ce_bench_shard("tiny"))


def _ce_shard_inputs(device, dtype, size):
    for lead, width, start, valid, vocab, nc in (_CE_SHARDS if size == "test" else (_ce_bench_shard(size),)):
        logits = _t((*lead, width), dtype, device, scale=3.0, noncontig=nc)
        logits[..., valid:] = 1e4 if dtype != torch.float16 else 6e4  # padding values must never matter
        target = torch.randint(0, vocab, lead[::-1], device=device).t()  # transposed, as GPTModel passes it
        if valid:
            target[(0,) * (len(lead) - 1)][:2] = torch.tensor([start, start + valid - 1], device=device)  # end ids
        label = f"{lead}x{width} start={start} valid={valid} vocab={vocab}{_nc(nc)}"
        yield label, logits, target, start, valid, vocab


def fp32_sum_atol(terms: torch.Tensor) -> float:
    """Six standard deviations of the difference between two float32 orderings of ``terms.sum(-1)``.

    Random-rounding model (Higham, Accuracy and Stability, sec. 4.2): adding the k-th of n terms of rms
    r to one sequential accumulator (the worst ordering: a SIMD lane or a plain loop) rounds a partial sum
    of size ~r sqrt(k) by at most u = 2^-24 of it, with independent signs, so the error's standard
    deviation is at most u r sqrt(sum_k k) = u r n / sqrt(2); two orderings (kernel, reference) differ by
    at most u r n in standard deviation. Six of those: a false failure is a 1e-9 event. For 4990 logits of
    rms 3 that is 5.4e-3, where a fixed 1e-4 fails once in a few runs."""
    n = terms.shape[-1]
    if n == 0:
        return 0.0
    r = float(terms.float().pow(2).mean().sqrt())
    return 6.0 * 2.0 ** -24 * r * n


def cross_entropy_shard_stats(device, dtype, size):
    # stats row 3 is each row's sum of its `valid` logits
    return [Case(label, (x, t, start, valid, vocab), sum_atol=fp32_sum_atol(x[..., :valid]))
            for label, x, t, start, valid, vocab in _ce_shard_inputs(device, dtype, size)]


def cross_entropy_shard_grad(device, dtype, size):
    out = []
    for k, (label, x, t, start, valid, vocab) in enumerate(_ce_shard_inputs(device, dtype, size)):
        # a global log-sum-exp: this shard's (rows are float32) plus what other shards would add
        lse = torch.logsumexp(x[..., :valid].float(), -1) if valid else torch.zeros(x.shape[:-1], device=device)
        lse = lse + torch.rand(x.shape[:-1], device=device)
        dloss = torch.randn(x.shape[:-1][::-1], device=device).t()
        ls = 0.1 if k % 2 or size != "test" else 0.0
        out.append(Case(f"{label} ls={ls}", (dloss, x, t, lse, start, valid, vocab, ls)))
    return out


def scaled_softmax(device, dtype, size):
    # (shape, causal, masked, scale, positional)
    rows = _pick(size, (((2, 3, 5, 7), False, True, 0.7, False), ((2, 2, 9, 9), True, False, 0.7, False),
                        ((1, 4, 6, 33), True, True, 0.7, False), ((2, 4, 8, 8), True, False, 0.5, True),
                        ((2, 4, 8, 8), False, True, 0.7, True)),
                 *[(((b, h, s, s), True, False, 0.125, False),)
                   for b, h, s in ((1, 2, 64), (2, 8, 512), (4, 32, 1024))])
    out = []
    for shape, causal, masked, scale, positional in rows:
        x = _t(shape, dtype, device, scale=2.0)
        mask = (torch.rand(shape[0], 1, shape[2], shape[3], device=device) < 0.2) if masked else None
        if mask is not None:
            mask[..., 0] = False  # keep one key per row so no row is fully masked
        args, kw = ((x, scale, mask, causal), {}) if positional else \
            ((x,), {"scale": scale, "mask": mask, "causal": causal})
        out.append(Case(f"{shape} causal={causal} mask={masked}{' positional' if positional else ''}", args, kw,
                        grad=(0,)))
    return out


def attention(device, dtype, size):
    def qkv(hq, hkv, d, s=16):
        return _t((2, hq, s, d), dtype, device), _t((2, hkv, s, d), dtype, device), _t((2, hkv, s, d), dtype, device)

    return [Case("mha-causal-d64", qkv(4, 4, 64), {"causal": True}, grad=(0, 1, 2)),
            Case("gqa-d128", qkv(4, 2, 128), {"causal": False, "scale": 0.05}, grad=(0, 1, 2)),
            Case("gqa-causal-d32", qkv(4, 1, 32), {"causal": True}, grad=(0, 1, 2))]


def _attention_blocks(device):
    """Ring-attention blocks, in float32 whatever the dtype asked for (the ring computes its blocks in fp32); the
    ``-dropout`` ones with context parallelism's hash dropout at scattered global positions (a fused kernel must
    draw the reference's mask: :mod:`omnitron.kernels.hash_dropout`)."""
    from omnitron.kernels.hash_dropout import block_positions

    for label, hq, hkv, sq, sk, causal, p in (("mha-causal", 4, 4, 16, 16, True, 0.0),
                                              ("gqa-rect", 4, 2, 16, 24, False, 0.0),
                                              ("mqa-causal", 4, 1, 16, 16, True, 0.0),
                                              ("gqa-rect-dropout", 4, 2, 16, 24, False, 0.2),
                                              ("mha-causal-dropout", 2, 2, 24, 24, True, 0.5)):
        q = _t((2, hq, sq, 32), torch.float32, device)
        kv = _t((2, hkv, sk, 64), torch.float32, device)  # views of one buffer, as the ring's circulating block
        k, v = kv[..., :32], kv[..., 32:]
        pos = torch.randperm(4 * (sq + sk), device=device)
        drop = block_positions(pos[:sq], pos[sq:sq + sk], int(torch.randint(0, 2 ** 62, ())), p, 1, device)
        yield label, q, k, v, {"causal": causal, "scale": 0.2, "drop": drop}


def attention_block_forward(device, dtype, size):
    return [Case(label, (q, k, v), kw) for label, q, k, v, kw in _attention_blocks(device)]


def attention_block_backward(device, dtype, size):
    """The backward cases carry the reference forward's output and log-sum-exp."""
    from omnitron.kernels.reference.attention_block import block_forward

    out = []
    for label, q, k, v, kw in _attention_blocks(device):
        o, lse = block_forward(q, k, v, **kw)
        out.append(Case(label, (_t(o.shape, torch.float32, device), q, k, v, o, lse), kw))
    return out


def _param_shapes(size):
    return _pick(size, [(10,), (3, 4), (5, 1, 2)], [(4096,)] * 4 + [(33,)],
                 [(1024 * 1024,)] * 8 + [(1024,)] * 16, [(4096 * 4096,)] * 8)


def adamw_step(device, dtype, size):
    """fp32 params and moments, grads in ``dtype``."""
    shapes = _param_shapes(size)
    params = [_t(s, torch.float32, device) for s in shapes]
    grads = [_t(s, dtype, device) for s in shapes]
    m = [_t(s, torch.float32, device, scale=0.1) for s in shapes]
    v = [_t(s, torch.float32, device, scale=0.1).abs() for s in shapes]
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    return [Case("lists", (params, grads, m, v), kw, inplace=(0, 2, 3))]


def grad_norm_sq(device, dtype, size):
    shapes = _pick(size, [(7,), (3, 5)], *[_param_shapes(s) for s in ("tiny", "small", "large")])
    return [Case("lists", ([_t(s, dtype, device) for s in shapes],))]


def fp8_cast_transpose_amax(device, dtype, size):
    """Scales that fit the tensor into the format's range with room (k=0.5) and that saturate (k=4)."""
    shape = (64, 96) if size == "test" else _rows(size)
    fmts = (("e4m3", 0.5), ("e4m3", 4.0), ("e5m2", 0.5), ("e5m2", 4.0)) if size == "test" else (("e4m3", 0.5),)
    x = _t(shape, dtype, device, scale=3.0)
    fit = 448.0 / x.float().abs().amax()
    return [Case(f"{fmt}-x{k}", (x, (fit * k).float().reshape(()), fmt)) for fmt, k in fmts]


def fp8_cast_transpose_from_amax(device, dtype, size):
    """Current scaling from a given amax: the tensor's own (fits), a quarter of it (saturates), with and
    without a margin, and the degenerate amax 0 (scale 1), in both formats."""
    x = _t((48, 80), dtype, device, scale=3.0)
    amax = x.float().abs().amax().reshape(())
    picks = (("e4m3", 1.0, 0), ("e4m3", 0.25, 0), ("e5m2", 1.0, 2), ("e5m2", 0.0, 0))
    return [Case(f"{fmt}-amax-x{k}-m{m}", (x, (amax * k).float(), fmt, m)) for fmt, k, m in picks]


def fp8_amax_history_push(device, dtype, size):
    """One delayed-scaling update on a float32 history of 16 (the dtype does not apply: FP8 state is float32):
    a new amax above and below the history's max, under both algorithms, and a zero amax that keeps the
    previous scale under "most_recent"."""
    hist = torch.rand(16, device=device) * 4
    scale = torch.tensor(100.0, device=device)
    picks = (("max", 7.5, "e4m3"), ("max", 0.5, "e5m2"), ("most_recent", 2.0, "e4m3"), ("most_recent", 0.0, "e4m3"))
    return [Case(f"{algo}-{a}-{fmt}", (hist, torch.tensor(a, device=device), scale, fmt, 0, algo))
            for algo, a, fmt in picks]


# torch-native fused baselines for the benchmark, called like the op
def native_rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def native_layer_norm(x, w, b, eps):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def native_add_rms_norm(x, r, w, eps):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, eps), h


def native_cross_entropy(x, t, label_smoothing):
    return F.cross_entropy(x.float(), t, reduction="none", label_smoothing=label_smoothing)


def native_grad_norm_sq(ts):
    return torch.stack(torch._foreach_norm(ts)).float().pow(2).sum()


def native_adamw(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay):
    """``torch.optim.AdamW(fused=True)`` on the same tensors (state built once, then reused)."""
    key = id(params[0])
    opt = native_adamw.cache.get(key)
    if opt is None:
        for p, g in zip(params, grads):
            p.grad = g
        opt = torch.optim.AdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, fused=True)
        native_adamw.cache = {key: opt}
    opt.step()


native_adamw.cache = {}
