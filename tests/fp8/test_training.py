"""FP8 training of the small GPT on the bundled corpus (bytes of Moby Dick) against bf16 (torch autocast)
from the same seed, and FP8 with tp=2 against FP8 with tp=1.

CI runs 40 iterations: every recipe's final loss (mean of the last 10) within 1% of bf16 (measured
0.01-0.1%). The 200-iteration run (slow) measured, final loss: fp32 2.671, bf16 2.725, FP8 delayed
2.674, tensorwise 2.685, blockwise 2.689 -- FP8 stays within 1% of fp32 while torch-autocast bf16
(bf16 weight gradients) drifts 2% above it, so there the check is: within 1% of fp32 and no worse
than bf16 + 1%.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed

RECIPES = ("delayed", "tensorwise", "blockwise")


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


def _train(recipe: str | None, steps: int, groups, *, autocast: bool, seed: int = 1234, layers: int = 2) -> list[float]:
    """Losses of ``steps`` AdamW iterations; ``recipe`` None trains without FP8."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, allreduce_sequence_parallel_grads
    from omnitron.core.precision.fp8 import FP8Config, enable_fp8

    torch.manual_seed(seed)
    cfg = _gpt_config(layers)
    model = GPTModel(cfg, groups, seed=seed)
    if recipe is not None:
        enable_fp8(model, FP8Config(fp8_recipe=recipe, fp8_format="hybrid", fp8_amax_history_len=16), groups)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    be = get_backend()
    losses = []
    for tokens, labels in _batches(steps, 8, cfg.seq_length):
        opt.zero_grad()
        with be.autocast(torch.bfloat16, enabled=autocast):
            loss = model(tokens, labels=labels).mean()
        loss.backward()
        allreduce_sequence_parallel_grads(model, groups)
        opt.step()
        losses.append(loss.item())
    return losses


def _final(losses: list[float], last: int = 10) -> float:
    return sum(losses[-last:]) / last


def _compare_to_bf16(steps: int, with_fp32: bool = False) -> dict:
    from omnitron.core.parallel.groups import ParallelGroups

    single = ParallelGroups.single()
    out = {"bf16": _train(None, steps, single, autocast=True)}
    if with_fp32:
        out["fp32"] = _train(None, steps, single, autocast=False)
    for recipe in RECIPES:
        out[recipe] = _train(recipe, steps, single, autocast=True)
    return out


def _check_against_bf16(out: dict, tol: float) -> None:
    ref = _final(out["bf16"])
    assert out["bf16"][0] > ref + 1.0, "the model must actually learn"  # starts near ln(256) = 5.5
    for recipe in RECIPES:
        rel = abs(_final(out[recipe]) - ref) / ref
        assert rel < tol, f"{recipe}: final loss {_final(out[recipe]):.4f} vs bf16 {ref:.4f} ({rel:.2%})"


@pytest.mark.slow
def test_fp8_recipes_after_200_iterations():
    out = _compare_to_bf16(200, with_fp32=True)
    ref, bf16 = _final(out["fp32"]), _final(out["bf16"])
    for recipe in RECIPES:
        fin = _final(out[recipe])
        assert abs(fin - ref) / ref < 0.01, f"{recipe}: final loss {fin:.4f} vs fp32 {ref:.4f}"
        assert fin < bf16 * 1.01, f"{recipe}: final loss {fin:.4f} worse than bf16 {bf16:.4f} by over 1%"


def test_fp8_recipes_match_bf16_short():
    _check_against_bf16(_compare_to_bf16(40), tol=0.01)


def _tp_bundle(tp: int, steps: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    groups = {"tp1": ParallelGroups.single(),
              "tp2": ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), get_backend().collectives),
              "tp2_sp": ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=True),
                                             get_backend().collectives)}
    return {(recipe, k): _train(recipe, steps, g, autocast=False) for recipe in RECIPES for k, g in groups.items()}


def test_fp8_tp2_matches_tp1():
    """Same FP8 training (fp32 elsewhere) at tp=2, with and without sequence parallelism, and at tp=1:
    per-step losses of 12 AdamW steps agree (the shared amaxes give identical per-tensor scales)."""
    res = run_distributed(_tp_bundle, 2, 2, 12)[0]
    for recipe in RECIPES:
        ref = res[(recipe, "tp1")]
        assert ref[0] - ref[-1] > 0.5, (recipe, ref)
        for k in ("tp2", "tp2_sp"):
            worst = max(abs(a - b) / b for a, b in zip(res[(recipe, k)], ref))
            # per-tensor recipes share whole-tensor scales over tp (measured ~3e-5); block-wise tiles of a
            # 64-wide shard differ from the full tensor's 128-wide tiles (measured ~4e-4): bf16 tolerance
            tol = 4e-3 if recipe == "blockwise" else 2e-4
            assert worst < tol, f"{recipe} {k}: per-step loss differs from tp=1 by {worst:.2e}"
