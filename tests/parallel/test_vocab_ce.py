"""Vocab-parallel cross-entropy on 2 and 4 gloo ranks against float64 ``F.cross_entropy``.

One 4-rank spawn covers tp=4 (the last rank's shard is all padding) and tp=2 (x dp=2, ragged
padding), fp32 / bf16 / fp64 logits, label smoothing, strongly negative logits (a padding
shard must not raise the global max and underflow the exp-sums), transposed (non-contiguous)
targets and upstream gradients as GPTModel passes them, and both the backend's resolved shard
kernels (C++ on CPU) and the reference kernels.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.testing.distributed import run_distributed

# (tp, vocab, local width, logits dtype, label smoothing, logits offset)
CASES = [
    (4, 10, 4, torch.float32, 0.0, 0.0),      # ranks: 4, 4, 2 real columns, then an all-padding shard
    (4, 10, 4, torch.float32, 0.1, -200.0),   # exp(-200) underflows fp32 if padding reported max 0
    (4, 13, 4, torch.bfloat16, 0.1, 0.0),
    (2, 37, 19, torch.float32, 0.1, 5.0),
    (2, 37, 19, torch.bfloat16, 0.0, 0.0),
    (2, 37, 19, torch.float64, 0.1, 0.0),
]
# (loss, grad) absolute, the loss's scaled by max(1, |offset|). float64 (u = 1.1e-16): logits |x| <= ~12 (3 sigma x 4),
# the loss is a logsumexp over V <= 37 columns split in <= 4 shards (max and sum-of-exp all-reduced), minus the
# label's logit and the smoothing mean: reordering <= 37 + 4 terms of magnitude <= ~15 moves it by <= 41 u x 15 =
# 7e-14 (1e-12: factor 15); a gradient entry dloss x (softmax - target), |dloss| <= ~4, errs by <= 41 u x 4 = 2e-14
# (1e-13: factor 5). The float32 bounds cover roundings of random sign (sqrt(41) u32 x 15 = 6e-6 on the loss).
TOL = {torch.float32: (2e-5, 1e-5), torch.float64: (1e-12, 1e-13), torch.bfloat16: (3e-2, 1e-2)}


def _one(groups, tp, vocab, width, dtype, ls, offset):
    """Max |loss - float64| and |grad - float64 grad| of this rank's shard (padding grad must be 0)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(vocab * 31 + int(ls * 10))
    s, b = 6, 3
    full = (torch.randn(s, b, tp * width, generator=gen, dtype=torch.float64) * 3 + offset).to(dtype)
    full[..., vocab:] = 1e4 if dtype != torch.float64 else 1e30  # padding values must never matter
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    labels[0, 0], labels[0, 1] = 0, vocab - 1
    dloss = torch.randn(b, s, generator=gen)
    r = groups.tp.rank
    dev = get_backend().device()  # the shard on the backend under test's device; the float64 reference on the host
    mine = full[..., r * width:(r + 1) * width].to(dev).requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, labels.t().to(dev), groups.tp, vocab_size=vocab, label_smoothing=ls,
                                        kernels=get_backend().kernels)  # [s, b]; the table _bundle() chose
    loss.t().backward(dloss.to(dev))  # the model returns loss.t(): a transposed upstream gradient
    loss, grad = loss.cpu(), mine.grad.cpu()
    x64 = full[..., :vocab].double().requires_grad_()
    want = F.cross_entropy(x64.reshape(-1, vocab), labels.t().reshape(-1), reduction="none",
                           label_smoothing=ls).view(s, b)
    want.backward(dloss.t().double())
    g_want = F.pad(x64.grad, (0, tp * width - vocab))[..., r * width:(r + 1) * width]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and grad.dtype == dtype
    real = max(0, min(width, vocab - r * width))
    pad_grad = float(grad[..., real:].abs().max()) if real < width else 0.0
    return (float((loss.double() - want).abs().max()), float((grad.double() - g_want).abs().max()), pad_grad)


def _bundle() -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.kernels.registry import KernelTable

    torch.set_num_threads(1)
    be = get_backend()
    grids = {tp: ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), be.collectives) for tp in (2, 4)}
    resolved = be.kernels
    out = {"resolved": resolved.resolved("cross_entropy_shard_stats")}
    for impl in ("table", "reference"):
        be._kernel_table = resolved if impl == "table" else KernelTable(be.name, ("reference",))
        for i, (tp, vocab, width, dtype, ls, offset) in enumerate(CASES):
            out[(impl, i)] = _one(grids[tp], tp, vocab, width, dtype, ls, offset)
    be._kernel_table = resolved
    return out


def test_vocab_parallel_cross_entropy_tp2_tp4():
    per_rank = run_distributed(_bundle, 4)
    for rank, res in enumerate(per_rank):
        for key, errs in res.items():
            if key == "resolved":
                continue
            impl, i = key
            tp, vocab, width, dtype, ls, offset = CASES[i]
            loss_tol, grad_tol = TOL[dtype]
            where = f"rank {rank} {impl} ({res['resolved']} first) tp={tp} V={vocab} {dtype} ls={ls} offset={offset}"
            loss_err, grad_err, pad_grad = errs
            assert loss_err <= loss_tol * max(1.0, abs(offset)), f"{where}: loss error {loss_err:.3g}"
            assert grad_err <= grad_tol, f"{where}: grad error {grad_err:.3g}"
            assert pad_grad == 0.0, f"{where}: padding columns got gradient {pad_grad}"


def test_nan_row_and_bad_input():
    """One process: a NaN logit poisons only its row; bad targets and shapes fail with a message."""
    import pytest

    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor import vocab_parallel_cross_entropy

    g1 = ParallelGroups.single().tp
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 3, 50).to(dtype)
        x[2, 1, 7] = float("nan")
        loss = vocab_parallel_cross_entropy(x, torch.randint(0, 45, (4, 3)), g1, vocab_size=45)
        assert torch.isnan(loss[2, 1]) and torch.isfinite(loss).sum() == 11, loss
    x = torch.randn(4, 50)
    with pytest.raises((IndexError, RuntimeError), match="45"):  # target id past the real vocabulary
        vocab_parallel_cross_entropy(x, torch.tensor([0, 1, 45, 2]), g1, vocab_size=45)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_cross_entropy(x, torch.zeros(5, dtype=torch.long), g1)
    with pytest.raises(ValueError, match="vocab_size 51"):
        vocab_parallel_cross_entropy(x, torch.zeros(4, dtype=torch.long), g1, vocab_size=51)


def test_gradient_written_over_the_logits():
    """``inplace_backward``: the shard gradient lands in the logits' own storage and equals float64's; every
    implementation here allows that alias (the target column read before its row is written); a second backward
    over the graph fails instead of reading a gradient as logits. Tolerances: ``TOL`` (fp32: the kernels' fp32
    exp to ~2 ulp of terms of order 1; bf16: one bf16 rounding of a value below 1 is 2^-9, plus the logits'
    own bf16 inputs being exact in float64 both sides)."""
    import pytest

    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor import vocab_parallel_cross_entropy
    from omnitron.kernels.registry import KernelTable

    g1 = ParallelGroups.single().tp
    tables = {"table": get_backend().kernels, "reference": KernelTable(get_backend().name, ("reference",))}
    vocab, width = 45, 50  # 5 padding columns
    for name, kernels in tables.items():
        for dtype, ls in ((torch.float32, 0.0), (torch.bfloat16, 0.1)):
            x = (torch.randn(7, 3, width, dtype=torch.float64) * 3).to(dtype).requires_grad_()
            target = torch.randint(0, vocab, (7, 3))
            dloss = torch.randn(7, 3)
            logits = x * 1  # a non-leaf, as the output layer's
            storage = logits.data_ptr()
            loss = vocab_parallel_cross_entropy(logits, target, g1, vocab_size=vocab, label_smoothing=ls,
                                                kernels=kernels, inplace_backward=True)
            loss.backward(dloss, retain_graph=True)
            x64 = x.detach()[..., :vocab].double().requires_grad_()
            want = F.cross_entropy(x64.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=ls)
            want.view(7, 3).backward(dloss.double())
            g_want = F.pad(x64.grad, (0, width - vocab))
            tol = TOL[dtype][1]
            assert float((x.grad.double() - g_want).abs().max()) < tol, (name, dtype)
            assert float((logits.detach().double() - g_want).abs().max()) < tol, (name, dtype, "not in place")
            assert logits.data_ptr() == storage
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward(dloss)
