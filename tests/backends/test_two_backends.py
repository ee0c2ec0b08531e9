"""The backend is a value: two backends (cpu and the MUSA double, whose tensors are on ``musa``) serve two
models in one process, each model reaching only the backend it was built with, and no code looking one up by name."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import registry
from omnitron.backends.cpu import CPUBackend
from omnitron.core.models.gpt import GPTModel, llama_tiny
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor.sharding import to_device
from omnitron.testing.musa_double import requires_double


class Counting:
    """A backend seen through a counter: each attribute it serves (kernels, RNG, device, collectives)
    and each kernel call it makes is counted."""

    def __init__(self, inner) -> None:
        self.inner, self.uses = inner, 0

    def __getattr__(self, name):
        self.uses += 1
        value = getattr(self.inner, name)
        return _CountingTable(value, self) if name == "kernels" else value


class _CountingTable:
    def __init__(self, table, owner: Counting) -> None:
        self.table, self.owner = table, owner

    def __getattr__(self, name):
        fn = getattr(self.table, name)
        if not callable(fn):
            return fn

        def counted(*a, **kw):
            self.owner.uses += 1
            return fn(*a, **kw)

        return counted


def _loss(backend, tokens, labels) -> torch.Tensor:
    """Build a Llama stage (RoPE, SwiGLU, RMSNorm kernels) on ``backend``; forward and backward."""
    cfg = llama_tiny(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=61,
                     seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    device = backend.device()  # cpu, or torch.device("musa", 0): the double's tensors live on its device
    model = to_device(GPTModel(cfg, ParallelGroups.single(backend=backend), seed=3), device)
    tokens, labels = tokens.to(device), labels.to(device)
    pos = torch.arange(tokens.shape[1], device=device)[None].expand_as(tokens)
    loss = model(tokens=tokens, position_ids=pos, labels=labels).mean()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    assert loss.device.type == grads.device.type == device.type
    return loss.detach().cpu(), grads.cpu()


@requires_double()
def test_cpu_and_musa_double_side_by_side(monkeypatch):
    from omnitron.testing import musa_double

    tokens, labels = torch.randint(0, 61, (2, 16)), torch.randint(0, 61, (2, 16))
    with musa_double.installed():
        cpu, musa = Counting(CPUBackend()), Counting(musa_double.MUSADoubleBackend())
        monkeypatch.setenv("OMNITRON_BACKEND", "no-such-backend")  # an implicit look-up would raise
        registry.reset_cache()
        with pytest.raises(registry.BackendUnavailableError):
            registry.get_backend()
        loss_cpu, grads_cpu = _loss(cpu, tokens, labels)
        assert cpu.uses > 0 and musa.uses == 0
        before = cpu.uses
        loss_musa, grads_musa = _loss(musa, tokens, labels)
        assert musa.uses > 0 and cpu.uses == before
        assert musa.device().type == "musa" and cpu.device().type == "cpu"
    registry.reset_cache()
    # Same maths through two kernel tables (the double's torch.rope / torch.swish_glu are written
    # independently of omnitron's references): fp32, 2 layers, reductions of <= 64 terms, so the
    # rounding differences are <= ~(2 layers x 64 terms) x u32 = 128 x 6e-8 = 7.7e-6 relative.
    assert torch.allclose(loss_cpu, loss_musa, rtol=1e-5, atol=0)
    # a gradient element sums <= b*s*ffn = 2*16*64 = 2048 products, each side in fp32: the two differ by
    # <= 2 * 2048 * u32 = 2.5e-4 of the largest gradient (cancellation makes a relative bound meaningless)
    assert (grads_cpu - grads_musa).abs().max() <= 2.5e-4 * grads_cpu.abs().max()
