"""DeepSeek-V3's sequence-wise auxiliary loss (``--moe-router-load-balancing-type seq_aux_loss``) against a plain
float64 re-implementation written from the paper's equations (17)-(20), sequence by sequence and token by token:
the value, its gradient, and the MoE layer's plumbing of the batch size."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.transformer.moe.router import aux_loss_scores, sequence_load_balancing_loss, sigmoid_routing
from omnitron.core.transformer.moe.router import top_k_routing

# The float64 MoE layers below route in float64 (the router takes the model's dtype): the losses are sums of <= T x E
# = 144 terms of one sign (scores x counts), their router-weight gradients sums of O(T E) one-signed terms per
# entry: <= 144 u = 1.6e-14 relative (u = 1.1e-16); ROUTER64 leaves a factor ~60. A float32 router: ~1e-8.
ROUTER64 = 1e-12


def _ref_seq_aux(logits: torch.Tensor, experts: torch.Tensor, s: int, b: int, k: int, coeff: float,
                 score_function: str) -> torch.Tensor:
    """``coeff * mean_j sum_e f_je P_je``: ``f_je = E / (k s) * #{t in seq j: e picked}``, ``P_je = mean_t
    s'_te`` with ``s'`` the softmax, or the sigmoid normalised over the experts (any k). Token ``i * b + j``."""
    E = logits.shape[1]
    total = 0.0
    for j in range(b):
        rows = [i * b + j for i in range(s)]
        for e in range(E):
            f = E / (k * s) * sum(1.0 for t in rows if e in experts[t].tolist())
            p = 0.0
            for t in rows:
                if score_function == "softmax":
                    z = sum(torch.exp(logits[t, x]) for x in range(E))
                    p = p + torch.exp(logits[t, e]) / z
                else:
                    sig = [torch.sigmoid(logits[t, x]) for x in range(E)]
                    p = p + sig[e] / sum(sig)
            total = total + f * p / s
    return coeff * total / b


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_seq_aux_loss_matches_its_definition(score_function):
    g = torch.Generator().manual_seed(38 + len(score_function))
    for s, b, E, k in ((5, 3, 6, 2), (7, 1, 4, 1), (4, 2, 8, 3)):
        logits = torch.randn(s * b, E, generator=g, dtype=torch.float64)
        ref_in, ours_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
        if score_function == "softmax":
            experts = top_k_routing(logits, k, False)[1]
        else:
            experts = sigmoid_routing(logits, k)[1]
        ref = _ref_seq_aux(ref_in, experts, s, b, k, 0.03, score_function)
        ours = sequence_load_balancing_loss(aux_loss_scores(ours_in, score_function), experts, b, E, 0.03)
        # float64 sums of O(s E) terms of size O(1): rounding ~1e-15 relative
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
        ref.backward()
        ours.backward()
        torch.testing.assert_close(ours_in.grad, ref_in.grad, rtol=1e-10, atol=1e-14)
        if b > 1:  # not the micro-batch's loss: that one pools the sequences' counts and scores
            from omnitron.core.transformer.moe import load_balancing_loss

            pooled = load_balancing_loss(aux_loss_scores(logits, score_function), experts, E, 0.03)
            assert abs(pooled.item() - ref.item()) > 1e-9


def _initialised(layer):
    """``layer`` with every parameter drawn (seeded): a MoELayer built alone holds ``torch.empty`` memory until a
    model initialises it, and garbage there (a NaN or inf expert weight now and then) made ``0 * y`` NaN and the
    router's gradient with it: test_listed_balancing_types_add_their_losses failed about one run in three."""
    from omnitron.core.parallel.tensor.sharding import init_full

    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(init_full(name, tuple(p.shape), ("normal", 0.1), seed=7))
    return layer


def test_moe_layer_passes_the_batch_to_the_seq_aux_loss():
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe import MoELayer

    c = gpt2_tiny(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, seq_length=8,
                  max_position_embeddings=8, vocab_size=64, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=20,
                  moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss",
                  moe_router_score_function="sigmoid", params_dtype=torch.float64)
    layer = _initialised(MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(),
                                  out_std=0.02))
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
        layer.router.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(6))  # --add-bias-linear's
    x = torch.randn(8, 3, c.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    layer(x)
    logits = x.reshape(-1, c.hidden_size) @ layer.router.weight.t() + layer.router.bias
    experts = sigmoid_routing(logits, 2)[1]  # the router picks on the model's (float64) logits
    ref = _ref_seq_aux(logits, experts, 8, 3, 2, 0.1, "sigmoid")
    torch.testing.assert_close(layer.aux_loss_total, ref.detach(), rtol=ROUTER64, atol=0.0)


def _ref_aux(logits: torch.Tensor, experts: torch.Tensor, k: int, coeff: float) -> torch.Tensor:
    """Switch/GShard's ``coeff * E * sum_e f_e P_e`` over the micro-batch, token by token: ``f_e`` = share of the
    ``T k`` assignments at e, ``P_e`` = mean softmax score of e."""
    T, E = logits.shape
    total = 0.0
    for e in range(E):
        f = sum(1.0 for t in range(T) if e in experts[t].tolist()) / (T * k)
        p = sum(torch.exp(logits[t, e]) / torch.exp(logits[t]).sum() for t in range(T)) / T
        total = total + f * p
    return coeff * E * total


def test_listed_balancing_types_add_their_losses():
    """Megatron's list form ``--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff A B``
    adds A x the micro-batch's loss and B x the sequence-wise one: the logged value and the router weight's
    gradient against the two float64 references above (with 'none' listed too, which adds nothing)."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe import MoELayer

    c = gpt2_tiny(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, seq_length=8,
                  max_position_embeddings=8, vocab_size=64, num_experts=6, moe_router_topk=2, moe_ffn_hidden_size=20,
                  moe_aux_loss_coeff=["0.1", 0.3, 0.7],
                  moe_router_load_balancing_type=["aux_loss", "none", "seq_aux_loss"],
                  add_bias_linear=False, params_dtype=torch.float64)
    assert c.moe_aux_loss_coeff == [0.1, 0.3, 0.7]  # the command line's strings made numbers
    layer = _initialised(MoELayer(c, groups=ParallelGroups.single(), sequence_parallel=False, backend=get_backend(),
                                  out_std=0.02))
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5, generator=g)
    x = torch.randn(8, 3, c.hidden_size, generator=g, dtype=torch.float64)
    layer.aux_loss_scale = 1.0
    y, _ = layer(x)
    (0.0 * y).sum().backward()  # only the attached losses' gradient reaches the router
    w = layer.router.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, c.hidden_size) @ w.t()
    experts = top_k_routing(logits.detach(), 2, False)[1]  # the router picks on the model's (float64) logits
    ref = _ref_aux(logits, experts, 2, 0.1) + _ref_seq_aux(logits, experts, 8, 3, 2, 0.7, "softmax")
    ref.backward()
    torch.testing.assert_close(layer.aux_loss_total, ref.detach(), rtol=ROUTER64, atol=0.0)
    torch.testing.assert_close(layer.router.weight.grad, w.grad, rtol=ROUTER64, atol=0.0)
    alone = _ref_aux(logits, experts, 2, 0.1).item(), _ref_seq_aux(logits, experts, 8, 3, 2, 0.7, "softmax").item()
    assert min(abs(layer.aux_loss_total.item() - v) for v in alone) > 1e-3  # not one of them alone


def test_listed_balancing_types_from_the_command_line():
    """The flags take Megatron's lists (a one-entry list is its entry); mismatched or unknown ones stop in one
    line naming the fix."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings

    base = ["--model", "gpt2_tiny", "--num-experts", "4", "--mock-data"]
    m = parse_settings(base + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss",
                               "--moe-aux-loss-coeff", "0.01", "0.001"], world_size=1).model
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == (["aux_loss", "seq_aux_loss"], [0.01, 0.001])
    m = parse_settings(base + ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.02"],
                       world_size=1).model
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == ("seq_aux_loss", 0.02)
    from omnitron.core.training.arguments import setting_words  # a checkpoint's settings as flags: the same model

    for types, coeffs in (("seq_aux_loss", 0.02), (["aux_loss", "seq_aux_loss"], [0.01, 0.001])):
        words = setting_words({"moe_router_load_balancing_type": types, "moe_aux_loss_coeff": coeffs})
        m = parse_settings(base + words, world_size=1).model
        assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == (types, coeffs), words
    bad = {("aux_loss", "seq_aux_loss"): ("0.01",), ("aux_loss",): ("0.01", "0.02")}
    for types, coeffs in bad.items():
        with pytest.raises(ConfigError, match="needs one --moe-aux-loss-coeff per type"):
            parse_settings(base + ["--moe-router-load-balancing-type", *types, "--moe-aux-loss-coeff", *coeffs],
                           world_size=1)
    with pytest.raises(ConfigError, match="global_aux_loss: the balance loss over the whole global batch"):
        parse_settings(base + ["--moe-router-load-balancing-type", "global_aux_loss"], world_size=1)
    with pytest.raises(ConfigError, match="names a type twice"):
        parse_settings(base + ["--moe-router-load-balancing-type", "aux_loss", "aux_loss",
                               "--moe-aux-loss-coeff", "0.1", "0.2"], world_size=1)
