"""Input cases for the kernel conformance suite: fresh random inputs per call, odd sizes,
non-contiguous views, every argument the op takes. Each maker returns ``[(label, args, kwargs)]``;
float tensors with ``requires_grad`` are the ones whose gradients are checked."""
from __future__ import annotations

import torch


def _t(shape, dtype, device, grad=True, scale=1.0, noncontig=False):
    """A random tensor; ``noncontig`` returns a strided view of a wider buffer with the same values' law."""
    if noncontig:
        base = torch.randn(*shape[:-1], shape[-1] * 2 + 1, device=device) * scale
        x = base[..., 1::2][..., : shape[-1]].to(dtype)
        x = x.detach() if x.is_contiguous() else x
    else:
        x = (torch.randn(*shape, device=device) * scale).to(dtype)
    return x.requires_grad_(grad)


def rms_norm(dtype, device):
    out = []
    # (300, 257): enough work that the CPU kernels split rows over threads (partial weight grads)
    for shape, nc in (((3, 5, 33), False), ((7, 128), False), ((1, 1), False), ((4, 2, 40), True), ((300, 257), False)):
        x = _t(shape, dtype, device, noncontig=nc)
        w = (1 + 0.3 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
        out.append((f"{shape}{' nc' if nc else ''}", (x, w), {"eps": 1e-5}))
    return out


def layer_norm(dtype, device):
    out = []
    for shape, nc, bias in (((3, 5, 33), False, True), ((7, 128), False, False), ((2, 2, 40), True, True),
                            ((300, 257), False, True)):
        x = _t(shape, dtype, device, noncontig=nc, scale=2.0)
        w = (1 + 0.3 * torch.randn(shape[-1], device=device)).to(dtype).requires_grad_()
        b = _t((shape[-1],), dtype, device) if bias else None
        out.append((f"{shape}{' nc' if nc else ''} bias={bias}", (x, w, b), {"eps": 1e-5}))
    return out


def add_rms_norm(dtype, device):
    return [(label, (x, _t(x.shape, dtype, device), w), kw) for label, (x, w), kw in rms_norm(dtype, device)]


def add_layer_norm(dtype, device):
    return [(label, (x, _t(x.shape, dtype, device), w, b), kw) for label, (x, w, b), kw in layer_norm(dtype, device)]


def swiglu(dtype, device):
    out = []
    for shape, nc, bias in (((4, 3, 34), False, False), ((5, 128), False, True), ((3, 2, 46), True, False)):
        x = _t(shape, dtype, device, noncontig=nc, scale=2.0)
        b = _t((shape[-1],), dtype, device) if bias else None
        out.append((f"{shape}{' nc' if nc else ''} bias={bias}", (x,), {"bias": b}))
    return out


def geglu(dtype, device):
    return [(label, args, {**kw, "approximate": "tanh"}) for label, args, kw in swiglu(dtype, device)]


def bias_gelu(dtype, device):
    out = []
    for shape, nc in (((4, 3, 37), False), ((5, 2, 64), True)):
        out.append((f"{shape}{' nc' if nc else ''}", (_t(shape, dtype, device, noncontig=nc, scale=2.0),
                                                   _t((shape[-1],), dtype, device)), {}))
    return out


def rope(dtype, device):
    out = []
    s, b, h = 6, 2, 3
    for d, rot, layout, inter in ((16, 16, "sbhd", False), (16, 16, "sbhd", True), (24, 8, "bshd", False),
                                  (20, 12, "bshd", True)):
        freqs = torch.rand(s, rot // 2, device=device) * 6.0
        if layout == "sbhd":
            # a permuted [b, s, h, d] buffer: the non-contiguous [s, b, h, d] view attention produces
            t = torch.randn(b, s, h, d, device=device).to(dtype).transpose(0, 1).requires_grad_()
            f = freqs[:, None, None, :]
        else:
            t = torch.randn(b, s, h, d, device=device).to(dtype).requires_grad_()
            f = freqs[None, :, None, :]
        out.append((f"{layout} d={d} r={rot} interleaved={inter}", (t, f), {"interleaved": inter}))
    return out


def softmax_cross_entropy(dtype, device):
    out = []
    for shape, ls in (((3, 5, 37), 0.0), ((6, 1000), 0.1), ((2, 3, 129), 0.0)):
        logits = _t(shape, dtype, device, scale=3.0)
        target = torch.randint(0, shape[-1], shape[:-1], device=device)
        out.append((f"{shape} ls={ls}", (logits, target), {"label_smoothing": ls}))
    return out


# (leading shape, shard width, start, valid, vocab, non-contiguous logits): whole vocabulary,
# a middle shard (most targets elsewhere), a last shard with padding, an all-padding shard,
# a strided view, and rows long enough that the CPU kernels split them over threads
_CE_SHARDS = (((3, 5), 37, 0, 37, 37, False), ((7,), 40, 40, 40, 100, False), ((2, 3), 50, 100, 23, 123, False),
              ((4,), 16, 128, 0, 128, False), ((2, 3), 33, 33, 30, 63, True), ((9,), 5000, 5000, 4990, 9990, False))


def _ce_shard_inputs(dtype, device):
    for lead, width, start, valid, vocab, nc in _CE_SHARDS:
        logits = _t((*lead, width), dtype, device, grad=False, scale=3.0, noncontig=nc)
        logits[..., valid:] = 1e4 if dtype != torch.float16 else 6e4  # padding values must never matter
        target = torch.randint(0, vocab, lead[::-1], device=device).t()  # transposed, as GPTModel passes it
        if valid:
            target[(0,) * (len(lead) - 1)][:2] = torch.tensor([start, start + valid - 1], device=device)  # end ids
        label = f"{lead}x{width} start={start} valid={valid} vocab={vocab}{' nc' if nc else ''}"
        yield label, logits, target, start, valid, vocab


def cross_entropy_shard_stats(dtype, device):
    return [(label, (x, t, start, valid, vocab), {}) for label, x, t, start, valid, vocab in _ce_shard_inputs(dtype, device)]


def cross_entropy_shard_grad(dtype, device):
    out = []
    for k, (label, x, t, start, valid, vocab) in enumerate(_ce_shard_inputs(dtype, device)):
        # a global log-sum-exp: this shard's (rows are float32) plus what other shards would add
        lse = torch.logsumexp(x[..., :valid].float(), -1) if valid else torch.zeros(x.shape[:-1], device=device)
        lse = lse + torch.rand(x.shape[:-1], device=device)
        dloss = torch.randn(x.shape[:-1][::-1], device=device).t()
        ls = 0.1 if k % 2 else 0.0
        out.append((f"{label} ls={ls}", (dloss, x, t, lse, start, valid, vocab, ls), {}))
    return out


def scaled_softmax(dtype, device):
    out = []
    for shape, causal, masked in (((2, 3, 5, 7), False, True), ((2, 2, 9, 9), True, False), ((1, 4, 6, 33), True, True)):
        x = _t(shape, dtype, device, scale=2.0)
        mask = (torch.rand(shape[0], 1, shape[2], shape[3], device=device) < 0.2) if masked else None
        if mask is not None:
            mask[..., 0] = False  # keep one key per row so no row is fully masked
        out.append((f"{shape} causal={causal} mask={masked}", (x,), {"scale": 0.7, "mask": mask, "causal": causal}))
    return out


MAKERS = {f.__name__: f for f in (rms_norm, layer_norm, add_rms_norm, add_layer_norm, swiglu, geglu, bias_gelu, rope, softmax_cross_entropy,
                                   cross_entropy_shard_stats, cross_entropy_shard_grad, scaled_softmax)}

# (atol, rtol) against the float64 reference on the same (dtype-valued) inputs, per input dtype; the
# reference itself is held to exactly this bound (test_conformance.py), a fast version to this plus twice
# the reference's own error. Derivation, u = unit roundoff (fp32 2^-24 = 6.0e-8, fp16 2^-11 = 4.9e-4,
# bf16 2^-8 = 3.9e-3):
# * bf16/fp16: on its way from inputs to output a reference rounds to the storage dtype at most ~4 times
#   (bias add, activation, product, output cast; statistics and sums are accumulated in fp32, whose error
#   is negligible here), each <= u relative, and these ops are well conditioned away from the output's
#   zeros (relative condition <= ~1): rtol = 4u (bf16 1.6e-2, fp16 2e-3). Near a zero the relative bound
#   means nothing; atol = 4-5u covers the absolute error of inputs of order 1 (scale <= 3). Sums over rows
#   (weight gradients) cancel: _check adds rtol x the largest entry for them.
# * fp32: the error is the fp32 sums' (n <= 5000 terms: vocabulary rows, 1000-wide softmax, 300-row weight
#   gradients), which under the random-rounding model (Higham, Accuracy and Stability, sec. 4.2) grows as
#   sqrt(n) u relative to the partial sums: <= 70 u = 4.2e-6; plus ~2 ulp of a vectorised exp/tanh and a
#   condition factor of at most ~4 where signed terms cancel: 2e-5 (= 335 u) in rtol and atol.
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}
