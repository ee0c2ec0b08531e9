"""FP8 training of the small GPT on the bundled corpus against bf16 from the same seed, run the way a
Megatron user runs it: through the training loop's public entry points (``parse_settings`` + ``train``),
``--bf16`` (bf16 parameters and compute, fp32 master weights and optimizer state, fp32 gradient
accumulation) against ``--bf16 --fp8-format hybrid --fp8-recipe R``. Also FP8 with tp=2 against tp=1.

Setup: *Moby Dick* (the bundled corpus) as UTF-8 bytes through ``--tokenizer-type NullTokenizer
--vocab-size 256`` (eod = 256), 2 layers, hidden 128, 4 heads, seq 64, global batch 8 in 2 micro-batches,
AdamW lr 1e-3 (beta2 0.95), 10% warmup, cosine to 1e-4, clip 1.0, seed 1234. Final loss = mean of the last
10 iterations. Bytes, not GPT-2 BPE: in 200 iterations of 512 tokens a 50K vocabulary only reaches the
unigram stage (loss 10.8 -> 6.7) and its 50304 x 128 output GEMM dominates the CPU time; bytes learn
words and spelling (5.5 -> 2.4) at a fraction of the cost.

NOTE (why the recipe is lr 1e-3, beta2 0.95): at lr 3e-3 with beta2 0.999 this model spikes right after
warmup (loss 7.4 -> 11-12 at iteration 25 on GPT-2 BPE) and the end of training depends chaotically on the
tiny differences of the first steps: fp32 against fp32 with the learning rate 1% higher ends 2.7% apart,
and over 4 init seeds bf16-vs-fp32 final losses scatter from -7.5% to +6.5% while their means agree to
0.1%. A 1% criterion is not measurable there; the earlier "bf16 ends 2% above fp32" was that scatter, not
a bf16 defect.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.threads import torch_threads

RECIPES = ("delayed", "tensorwise", "blockwise")


@pytest.fixture(scope="module")
def byte_corpus(tmp_path_factory) -> str:
    """The bundled corpus's documents as byte tokens (eod 256): an indexed dataset prefix."""
    from omnitron.core.data.corpus import moby_dick_documents
    from omnitron.core.data.indexed import IndexedDatasetBuilder, data_file, index_file

    prefix = str(tmp_path_factory.mktemp("moby_bytes") / "moby_bytes")
    builder = IndexedDatasetBuilder(data_file(prefix), dtype=np.uint16)
    for doc in moby_dick_documents():
        builder.add_document(np.append(np.frombuffer(doc.encode("utf-8"), np.uint8).astype(np.uint16), 256))
    builder.finalize(index_file(prefix))
    return prefix


def _loop_losses(prefix: str, iters: int, *precision: str) -> list[float]:
    """Per-iteration losses of ``omnitron train`` (in this process) with the given precision flags."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    argv = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
            "--seq-length", "64", "--max-position-embeddings", "64", "--hidden-dropout", "0",
            "--attention-dropout", "0",
            "--data-path", prefix, "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--make-vocab-size-divisible-by", "128", "--data-cache-path", os.path.dirname(prefix) + "/cache",
            "--num-workers", "0", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-3", "--min-lr", "1e-4", "--adam-beta2", "0.95", "--lr-warmup-iters", str(iters // 10),
            "--lr-decay-style", "cosine", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
            "--log-interval", str(iters), "--no-tensorboard", "--no-progress-bar", "--log-dir",
            os.path.dirname(prefix) + "/logs", *precision]
    # one thread, whatever the session's count (2 here serially, 1 a worker under -n 2): the count splits the CPU
    # sums, and a change of their fp32 rounding moved the 40-iteration FP8 finals by up to 0.2% (sim, tensorwise
    # +0.93% of bf16 at 2 threads, +0.77% at 1)
    with torch_threads(1):
        res = train(parse_settings(argv, 1), get_backend())  # the backend under test (conftest: cpu)
    return [res["losses"][i] for i in sorted(res["losses"])]


# --bf16 as Megatron runs it: fp32 masters (always) and fp32 gradient accumulation (Megatron forces
# --accumulate-allreduce-grads-in-fp32 with --bf16; omnitron leaves it to the flag)
BF16 = ("--bf16", "--accumulate-allreduce-grads-in-fp32")


def _final(losses: list[float], last: int = 10) -> float:
    return sum(losses[-last:]) / last


def _runs(prefix: str, iters: int, with_fp32: bool = False) -> dict[str, list[float]]:
    out = {"bf16": _loop_losses(prefix, iters, *BF16)}
    if with_fp32:
        out["fp32"] = _loop_losses(prefix, iters)
    for recipe in RECIPES:
        out[recipe] = _loop_losses(prefix, iters, *BF16, "--fp8-format", "hybrid", "--fp8-recipe", recipe)
    return out


def _check_against_bf16(out: dict, tol: float) -> None:
    ref = _final(out["bf16"])
    print("final loss (mean of last 10):", ", ".join(f"{k} {_final(v):.4f}" for k, v in out.items()))
    assert out["bf16"][0] > ref + 1.0, "the model must actually learn"  # starts near ln(256) = 5.5
    for recipe in RECIPES:
        fin = _final(out[recipe])
        assert out[recipe] != out["bf16"], f"{recipe}: identical to bf16, FP8 did not take effect"
        assert abs(fin - ref) / ref < tol, f"{recipe}: final loss {fin:.4f} vs bf16 {ref:.4f} ({fin / ref - 1:+.2%})"


@pytest.mark.slow
def test_fp8_recipes_within_1pct_of_bf16_after_200_iterations(byte_corpus):
    """The issue's criterion. Measured (final loss): fp32 2.5049, bf16 2.5046, FP8 delayed 2.5062 (+0.06%),
    tensorwise 2.5054 (+0.03%), blockwise 2.5076 (+0.12%); fp32 with lr +1% 2.5052. ~45 s on a quiet machine."""
    out = _runs(byte_corpus, 200, with_fp32=True)
    _check_against_bf16(out, tol=0.01)
    ref, bf16 = _final(out["fp32"]), _final(out["bf16"])
    assert abs(bf16 - ref) / ref < 0.01, f"bf16 final loss {bf16:.4f} vs fp32 {ref:.4f}"


def test_fp8_recipes_within_1pct_of_bf16_short(byte_corpus):
    """CI variant: 40 iterations (whole warmup + cosine schedule), same criterion. Measured at eab41a3 (one
    thread): cpu bf16 2.9501, delayed 2.9713 (+0.72%), tensorwise 2.9484 (-0.06%), blockwise 2.9469 (-0.11%); sim
    bf16 2.9496, delayed 2.9711 (+0.73%), tensorwise 2.9722 (+0.77%), blockwise 2.9390 (-0.36%); ~15 s quiet.

    The 1% is the issue's acceptance criterion (FP8 final loss within 1% of bf16's), not a bound derived from FP8's
    rounding: 40 iterations of training amplify the per-GEMM e4m3 / e5m2 rounding (2^-4 / 2^-3 relative per
    element) by a gain no closed form bounds, so the test holds the requirement itself. Spread over seeds (--seed
    1234, 1, 2, 3, 4; 2026-12-07 at e0cc1e3, one thread): cpu delayed -0.22% .. +0.72%, tensorwise -0.27% ..
    +0.06%, blockwise -0.28% .. +0.43%; sim delayed +0.04% .. +0.73%, tensorwise -0.18% .. +0.76%, blockwise -0.36%
    .. +0.42%. The default seed (1234) is the worst of the five on both backends: 0.24 (sim) and 0.28 (cpu) points
    of margin."""
    _check_against_bf16(_runs(byte_corpus, 40), tol=0.01)  # the 1% (the docstring), not derived


def test_torchao_impl_trains_through_the_loop(byte_corpus):
    """``--fp8-impl torchao`` through ``omnitron train`` (its optimizer step ends in ``fp8_step``, which once read
    an amax reducer torchao's executor lacks). Against omnitron's tensorwise recipe, which casts the same operands
    with the same scales: the first loss differs only by fp32 accumulation order in the GEMMs (~sqrt(K) u with K
    <= 512: 1.4e-6 relative; 1e-5 leaves room), later ones by the rare e5m2 rounding flip that order causes (the
    layer test's analysis: ~1e-3 on a gradient), far inside the 1% that separates the recipes from bf16."""
    pytest.importorskip("torchao")
    fp8 = (*BF16, "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
    ours = _loop_losses(byte_corpus, 6, *fp8)
    theirs = _loop_losses(byte_corpus, 6, *fp8, "--fp8-impl", "torchao")
    assert abs(theirs[0] - ours[0]) / ours[0] < 1e-5
    assert max(abs(t - o) / o for t, o in zip(theirs, ours)) < 1e-2


# ---- FP8 at tp=2 against tp=1: a plain AdamW harness on the model (fp32 outside the FP8 GEMMs) ----------

def _gpt_config(layers: int = 2):
    from omnitron.core.models.gpt import GPTConfig

    # byte-level vocabulary; widths are multiples of 128 so block-wise tiles are whole
    return GPTConfig(num_layers=layers, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512, seq_length=64,
                     vocab_size=256, make_vocab_size_divisible_by=128, hidden_dropout=0.0, attention_dropout=0.0)


def _batches(steps: int, batch: int, seq: int, seed: int = 0):
    from omnitron.core.data.corpus import moby_dick_text

    data = torch.frombuffer(bytearray(moby_dick_text()[:400_000].encode("utf-8")), dtype=torch.uint8).long()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        rows = torch.stack([data[s:s + seq + 1] for s in start.tolist()])
        yield rows[:, :-1], rows[:, 1:]


def _train(recipe: str | None, steps: int, groups, *, seed: int = 1234, layers: int = 2) -> list[float]:
    """Losses of ``steps`` AdamW iterations; ``recipe`` None trains without FP8."""
    from omnitron.core.models.gpt import GPTModel, allreduce_sequence_parallel_grads
    from omnitron.core.precision.fp8 import FP8Config, enable_fp8

    torch.manual_seed(seed)
    cfg = _gpt_config(layers)
    from omnitron.core.parallel.groups import resolve_backend
    from omnitron.core.parallel.tensor.sharding import to_device

    dev = resolve_backend(None, groups).device()  # the groups' device (sim under --backend sim); tp1: the host
    model = to_device(GPTModel(cfg, groups, seed=seed), dev)
    if recipe is not None:
        enable_fp8(model, FP8Config(fp8_recipe=recipe, fp8_format="hybrid", fp8_amax_history_len=16), groups)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    losses = []
    for tokens, labels in _batches(steps, 8, cfg.seq_length):
        opt.zero_grad()
        loss = model(tokens.to(dev), labels=labels.to(dev)).mean()
        loss.backward()
        allreduce_sequence_parallel_grads(model, groups)
        opt.step()
        losses.append(loss.item())
    return losses


def _tp_bundle(tp: int, steps: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    import torch.distributed as dist

    torch.set_num_threads(1)
    groups = {"tp1": ParallelGroups.single(),
              "tp2": ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), backend=get_backend()),
              "tp2_sp": ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True),
                                             backend=get_backend())}
    if dist.get_rank() != 0:
        del groups["tp1"]  # the one-process run has no collectives: rank 0's copy is the one compared
    return {(recipe, k): _train(recipe, steps, g) for recipe in RECIPES for k, g in groups.items()}


# Bounds for FP8 at tp=2 against tp=1 (12 steps; 2 layers x 4 FP8 GEMMs = 8 forward, 24 with both backward
# GEMMs; contraction length k <= 512; 8 x 64 = 512 tokens a step). FP8 steps: e4m3 (forward) 2^-3 relative,
# e5m2 (gradients, hybrid) 2^-2; u32 = 2^-24.
# * Per-tensor recipes (delayed, tensorwise): the amaxes are reduced over tp, so both layouts quantize with
#   the same scales; they differ only where fp32 reassociation (a tp split of a k-term sum, ~sqrt(k) u32 =
#   d = 1.4e-6 relative) moves a value across an FP8 rounding midpoint. That happens to a fraction <= 2d/s of
#   the elements, each moving by one step s: a relative change <= (2d/s) x s = 2d per GEMM whatever the
#   format. Summed over the 24 GEMMs of a step and compounded linearly over 12 steps: 24 x 12 x 2d = 8e-4.
# * Block-wise: the tp shard's 64-wide tiles are not the full tensor's 128-wide ones, so the two layouts
#   quantize with different scales and their FP8 rounding errors are independent: rms s/sqrt(12) = 3.6% per
#   element (e4m3). A GEMM output's relative error is the same (signed terms add as sqrt(k) in signal and
#   error alike); the mean loss averages 512 independent tokens and 8 forward GEMMs add in quadrature:
#   sqrt(2) x 0.036 x sqrt(8 / 512) = 6.4e-3 per step, compounded as a random walk over 12 steps: 2.2e-2.
# (That the amaxes are shared at all is tests/fp8/test_distributed.py's direct check.)
FP8_TP_TOL = {"delayed": 8e-4, "tensorwise": 8e-4, "blockwise": 2.2e-2}


def test_fp8_tp2_matches_tp1():
    """Same FP8 training (fp32 elsewhere) at tp=2, with and without sequence parallelism, and at tp=1:
    per-step losses of 12 AdamW steps agree within the bounds derived above (FP8_TP_TOL)."""
    # the emulated GEMM path (same float8 codes, fp32 accumulation; the analysis above is unchanged): torch
    # 2.13's CPU torch._scaled_mm takes ~1.3 s for one 512x128x512 GEMM, which made this test run > 300 s
    res = run_distributed(_tp_bundle, 2, 2, 12, env={"OMNITRON_FP8_PATH": "emulated"})[0]
    for recipe in RECIPES:
        ref = res[(recipe, "tp1")]
        assert ref[0] - ref[-1] > 0.5, (recipe, ref)
        for k in ("tp2", "tp2_sp"):
            worst = max(abs(a - b) / b for a, b in zip(res[(recipe, k)], ref))
            assert worst < FP8_TP_TOL[recipe], f"{recipe} {k}: per-step loss differs from tp=1 by {worst:.2e}"
