"""Tensor-parallel pieces in one process: vocab-parallel cross-entropy, sharding layout, RNG tracker,
recomputation with dropout."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from omnitron.backends import get_backend
from omnitron.core.models.gpt import GPTModel, gpt2_tiny, llama_tiny
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor import RNGTracker, checkpoint, init_full, shard_param, vocab_parallel_cross_entropy
from omnitron.core.parallel.tensor.sharding import set_attributes

G1 = ParallelGroups.single().tp


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_cross_entropy_matches_torch_with_padding(ls):
    V, pad = 37, 3
    logits = torch.randn(5, 2, V + pad, dtype=torch.float64)
    logits[..., V:] = 100.0  # padding columns must not matter, whatever their value
    target = torch.randint(0, V, (5, 2))
    a = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(a, target, G1, vocab_size=V, label_smoothing=ls)
    b = logits[..., :V].clone().requires_grad_()
    ref = F.cross_entropy(b.reshape(-1, V), target.reshape(-1), reduction="none", label_smoothing=ls).view(5, 2)
    assert loss.dtype == torch.float64  # float64 logits: float64 statistics (16/32-bit logits: float32)
    # float64 (u = 1.1e-16), a 37-term log-sum-exp of O(1) logits: error ~ a few u x log(37); 1e-12 is loose
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    w = torch.rand(5, 2, dtype=torch.float64)
    (loss * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad[..., :V], b.grad, rtol=1e-12, atol=1e-12)
    assert a.grad[..., V:].abs().max() == 0


def test_shard_strided_layout():
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # [gate rows 0-3; up rows 4-7]
    p = set_attributes(torch.nn.Parameter(torch.empty(4, 3)), parallel=True, dim=0, stride=2)
    r0, r1 = shard_param(full, p, 2, 0), shard_param(full, p, 2, 1)
    assert torch.equal(r0, full[[0, 1, 4, 5]]) and torch.equal(r1, full[[2, 3, 6, 7]])
    q = set_attributes(torch.nn.Parameter(torch.empty(3, 2)), parallel=True, dim=1)
    assert torch.equal(shard_param(full[:3, :].repeat(1, 2)[:, :4], q, 2, 1), full[:3, :].repeat(1, 2)[:, 2:4])
    with pytest.raises(ValueError, match="does not match"):
        shard_param(torch.zeros(7, 3), p, 2, 0)


def test_init_full_is_deterministic_and_padded():
    a = init_full("x.weight", (10, 4), ("normal", 0.5), seed=1, valid_rows=7)
    assert torch.equal(a, init_full("x.weight", (10, 4), ("normal", 0.5), seed=1, valid_rows=7))
    assert a[7:].abs().sum() == 0 and not torch.equal(a, init_full("y.weight", (10, 4), ("normal", 0.5), 1, 7))
    assert torch.equal(a[:7], init_full("x.weight", (7, 4), ("normal", 0.5), seed=1))  # padding-independent


def test_tracker_fork_is_separate_stream():
    be = get_backend()
    dev = be.device()  # the tracker swaps the backend device's generator: draw there (the host on cpu)
    tr = RNGTracker(be)
    tr.add("model-parallel", 123)
    be.manual_seed(0)
    expected_default = torch.rand(3, device=dev)
    be.manual_seed(0)
    with tr.fork():
        a = torch.rand(3, device=dev)
    assert torch.equal(torch.rand(3, device=dev), expected_default)  # default stream untouched by the fork
    with tr.fork():
        b = torch.rand(3, device=dev)
    be.manual_seed(123)
    ref = torch.rand(6, device=dev)
    assert torch.equal(torch.cat([a, b]), ref)  # the fork continues its own stream
    with pytest.raises(ValueError):
        tr.add("model-parallel", 1)
    with pytest.raises(KeyError):
        with tr.fork("nope"):
            pass


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
])
def test_recompute_with_dropout_is_identical(recompute):
    base = gpt2_tiny(vocab_size=97, num_layers=3, hidden_size=32, ffn_hidden_size=64, seq_length=16,
                     hidden_dropout=0.2, attention_dropout=0.2)
    tokens = torch.randint(0, 97, (2, 16))
    results = []
    for cfg in (base, dataclasses.replace(base, **recompute)):
        model = GPTModel(cfg, ParallelGroups.single(), seed=9)
        model.train()
        torch.manual_seed(4)
        loss = model(tokens, labels=tokens)
        loss.mean().backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # and dropout really is on: a different default seed gives a different loss
    model = GPTModel(base, ParallelGroups.single(), seed=9)
    torch.manual_seed(5)
    assert not torch.equal(model(tokens, labels=tokens).detach(), l0)


def test_checkpoint_replays_tracker_stream():
    be = get_backend()
    dev = be.device()  # dropout on the backend's device, whose generator the tracker and checkpoint swap
    tr = RNGTracker(be)
    tr.add("model-parallel", 7)
    x = torch.randn(64, device=dev, requires_grad=True)

    def fn(t):
        with tr.fork():
            t = F.dropout(t, 0.5)
        return F.dropout(t, 0.5) * 2

    be.manual_seed(1)
    y = checkpoint(fn, tr, x)
    y.sum().backward()
    tr2 = RNGTracker(be)
    tr2.add("model-parallel", 7)
    be.manual_seed(1)
    x2 = x.detach().clone().requires_grad_()
    with tr2.fork():
        z = F.dropout(x2, 0.5)
    y2 = F.dropout(z, 0.5) * 2
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


def test_missing_inputs_are_explained():
    c = llama_tiny(vocab_size=64, num_layers=2)
    g = ParallelGroups.single()
    with pytest.raises(ValueError, match="tokens"):
        GPTModel(c, g)(hidden=torch.zeros(4, 1, 128))
    with pytest.raises(ValueError, match="hidden"):
        GPTModel(c, g, pre_process=False, layer_offset=0, num_layers=1)(tokens=torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("skip", [False, True])
def test_linears_skip_bias_add_hand_back_the_bias_unadded(skip):
    """``skip_bias_add``: the column and row linears return ``(X W^T, bias)`` for a fused op to add the bias (bias
    GeLU / SwiGLU, bias-dropout-add), else ``X W^T + b``. Against float64 sums on fresh inputs; the GEMM only
    reorders h = 16 products of O(1) terms: <= 16 u x 16 ~ 3e-14, so 1e-12; a bias added twice or lost errs by O(1)."""
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    x = torch.randn(3, 2, 16, dtype=torch.float64)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        layer = cls(16, 8, group=G1, skip_bias_add=skip, dtype=torch.float64)
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()
        w, b = layer.weight.detach(), layer.bias.detach()
        want = (x.unsqueeze(-2) * w).sum(-1)  # [3, 2, 8], float64 sums of the products
        out = layer(x)
        if skip:
            assert isinstance(out, tuple) and out[1] is layer.bias, cls.__name__
            torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12, msg=cls.__name__)
        else:
            torch.testing.assert_close(out, want + b, rtol=1e-12, atol=1e-12, msg=cls.__name__)


def test_swiglu_mlp_with_biases_adds_each_bias_once():
    """A SwiGLU MLP with biases whose activation resolves to a fused kernel (the table's swiglu is not the reference:
    fc1 hands its bias to the kernel) against the float64 formula ``(silu(x Wg^T + bg) * (x Wu^T + bu)) W2^T + b2``
    on fresh inputs. Float64 (u = 1.1e-16): the output sums f = 32 products of magnitude <= ~50 after h = 16 in each
    pre-activation, so reordering errs by <= ~48 u x 32 x 50 ~ 1e-11 in the worst case, ~1e-13 typically; rtol and
    atol 1e-10. A bias added twice or lost errs by O(1)."""
    from omnitron.core.transformer.mlp import MLP, fused_activation

    be = get_backend()
    c = llama_tiny(hidden_size=16, ffn_hidden_size=32, add_bias_linear=True, params_dtype=torch.float64)
    if not fused_activation(c, be.kernels):
        pytest.skip("this backend's swiglu is the reference: fc1 adds its own bias")
    mlp = MLP(c, group=G1, sequence_parallel=False, backend=be, out_std=0.02, skip_out_bias=False)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(3, 2, 16, dtype=torch.float64)
    w1, b1 = mlp.linear_fc1.weight.detach(), mlp.linear_fc1.bias.detach()
    w2, b2 = mlp.linear_fc2.weight.detach(), mlp.linear_fc2.bias.detach()
    h = (x.unsqueeze(-2) * w1).sum(-1) + b1  # [3, 2, 64]: gate rows, then up rows
    act = F.silu(h[..., :32]) * h[..., 32:]
    want = (act.unsqueeze(-2) * w2).sum(-1) + b2
    y, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-10)
