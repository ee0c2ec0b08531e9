"""The FP8 seam reaches every GEMM, and bf16 parameters / autocast run close to fp32."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from omnitron.core.models.gpt import GPTModel, gpt2_tiny, llama_tiny
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class _RecordingGemm:
    """Stands in for an FP8 executor: F.linear's contract, counts calls per module."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x, weight, bias):
        self.calls += 1
        return F.linear(x, weight, bias) * 1.0


def test_fp8_seam_used_by_every_linear_including_output():
    for cfg in (gpt2_tiny(vocab_size=100, num_layers=2), llama_tiny(vocab_size=100, num_layers=2)):
        model = GPTModel(cfg, ParallelGroups.single()).eval()  # no dropout: outputs comparable
        tokens = torch.randint(0, 100, (2, 8))
        ref = model(tokens, labels=tokens)
        linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        assert len(linears) == 4 * cfg.num_layers + 1 and all(m.fp8 is None for m in linears)
        for m in linears:
            m.fp8 = _RecordingGemm()
        out = model(tokens, labels=tokens)
        assert all(m.fp8.calls == 1 for m in linears)
        torch.testing.assert_close(out, ref)


def test_bf16_params_and_autocast_close_to_fp32():
    base = llama_tiny(vocab_size=300, num_layers=2)
    tokens = torch.randint(0, 300, (2, 32))
    ref_model = GPTModel(base, ParallelGroups.single(), seed=1)
    ref = ref_model(tokens, labels=tokens)
    bf = GPTModel(dataclasses.replace(base, params_dtype=torch.bfloat16), ParallelGroups.single(), seed=1)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())
    loss = bf(tokens, labels=tokens)
    assert loss.dtype == torch.float32
    loss.mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in bf.parameters())
    assert abs(loss.mean().item() - ref.mean().item()) / ref.mean().item() < 2e-2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = ref_model(tokens, labels=tokens)
    assert auto.dtype == torch.float32
    assert abs(auto.mean().item() - ref.mean().item()) / ref.mean().item() < 2e-2


def test_bias_placement_does_not_change_results(monkeypatch):
    """Biases go into the GEMM when the consuming kernel is the reference, and to the kernel when
    a fused one is resolved: both placements compute the same model."""
    from omnitron.kernels.registry import KernelTable

    cfg = gpt2_tiny(vocab_size=100, num_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    tokens = torch.randint(0, 100, (2, 8))
    runs = []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(KernelTable, "resolved", lambda self, op: "fused")
        model = GPTModel(cfg, ParallelGroups.single(), seed=4)
        layer = model.decoder.layers["0"]
        assert layer.mlp.linear_fc1.skip_bias_add == fused and layer.self_attention.linear_proj.skip_bias_add == fused
        loss = model(tokens, labels=tokens)
        loss.mean().backward()
        runs.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
