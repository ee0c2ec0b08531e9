"""omnitron's GPT under Megatron's model-shape flags, one at a time, against megatron-core's own ``GPTModel``: the
logits, per-token losses and every parameter's gradient megatron-core computed at tensor-parallel sizes 1 and 2
(tests/models/megatron_gpt_flags/fixtures.pt, written by its make_fixtures.py with the Megatron-LM d98e8a6 snapshot,
local layer spec, float64 on CPU) are omnitron's on the same weights and tokens; RoPE's inverse frequencies are
megatron-core's. Cases: GPT-2 (learned positions, LayerNorm, tanh GeLU with biases, tied), QK norms (with GQA and
RMSNorm too), interleaved RoPE, half the channels rotated (at base 500, which the case cannot test: heads 4 wide
rotate 2 channels at the one frequency 1, whatever the base), Llama 3.1's RoPE scaling at base 5e5, zero-centred
LayerNorm weights (--apply-layernorm-1p), RMSNorm eps 1e-2, SwiGLU with biases, GeLU without biases, a qkv bias
alone, untied learned positions, --kv-channels 12 (heads x 12 != hidden), one and two query groups, sliding windows
(every layer, every other), learnable / off-by-one softmax sinks, no position embedding (``none``, NoPE) and
--squared-relu (with biases, without). omnitron runs each case in one process and at tp2 on two gloo ranks;
megatron-core's tp2 run is compared with both.

Tolerance: both sides hold the same weights (exact in the fixture) in float64 and run the float64 reference kernels;
what is not float64 is RoPE's inverse frequencies (megatron-core's float32 arange and power, omnitron's float64
power rounded to float32: one ulp, u = 2**-24 = 6e-8 relative each, so 1e-7 bounds their norm-wise difference; in
angles up to 11 rad: 7e-7 ~ 12 u absolute, a relative perturbation of the rotated q and k of at most 12 u),
omnitron's cross-entropy (float32: its log-sum-exp, exponentials, division and subtraction give each token's loss
and its logits' gradient a relative error of at most ~4 u) and the stored logits and gradients (float32: u).
Each perturbation reaches a token's loss and gradient with gain ~1 (first order, the backward is linear in it
and float64 after the loss), so each token's loss and logits err by at most (12 + 4 + 1) u relative. A
parameter's gradient is the sum over the tokens' losses of their gradients, and such a sum may cancel (the keys'
LayerNorm bias moves every score of a query almost alike, so softmax nearly ignores it: its gradient is 1/13 of
its terms' sizes in the qk_layernorm case); so the error is bounded relative to the terms, not to the sum: with
g_t the gradient of token t's loss (divided by the token count, as the mean is), |g - g_ref| <= 17 u sum_t |g_t|
(the triangle inequality), checked as the norm-wise ``||g - g_ref|| / sum_t ||g_t||``; loss and logits norm-wise
relative to their own norm. TOL = 20 u = 1.2e-6 (measured: at most 1.1 u on any case and quantity, the roundings
mostly cancelling). A wrong channel pair, norm epsilon, scale, bias or mask errs by 1e-3 or more relative to the
sum, 8e-5 (1e-3 / 13) or more relative to its terms (test_a_wrong_flag_is_caught plants three).
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.parity import reference_kernels, relative_error

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "megatron_gpt_flags", "fixtures.pt"),
                      weights_only=True)
TOL = 20 * 2.0 ** -24  # the docstring's first-order bound, 17 u, rounded up


def config_of(flags: dict, base: dict, V: int, S: int):
    """omnitron's GPTConfig of a fixture case: ``base`` its sizes, ``flags`` the rest (Megatron's argument names
    read here)."""
    from omnitron.core.models.gpt import GPTConfig

    same = ("position_embedding_type", "normalization", "layernorm_epsilon", "swiglu", "add_bias_linear",
            "add_qkv_bias", "num_query_groups", "kv_channels", "qk_layernorm", "rotary_interleaved", "rotary_percent",
            "rotary_base", "softmax_type", "squared_relu")
    kw = {k: flags[k] for k in same if k in flags}
    if "window_size" in flags:
        kw["window_size"] = ",".join(map(str, flags["window_size"]))
    if "window_attn_skip_freq" in flags:
        kw["window_attn_skip_freq"] = str(flags["window_attn_skip_freq"])
    return GPTConfig(**base, seq_length=S,
                     vocab_size=V, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                     untie_embeddings_and_output_weights=flags.get("untie", False),
                     apply_layernorm_1p=flags.get("layernorm_zero_centered_gamma", False),
                     rope_scaling_factor=8.0 if flags.get("rope_scaling") else 1.0,  # Megatron's default factor
                     bias_gelu_fusion=not flags.get("squared_relu"),  # Megatron's squared ReLU cases: unfused
                     params_dtype=torch.float64, **kw)


def omnitron_name(name: str) -> str:
    """megatron-core's parameter name in omnitron's model (the learnable sinks sit on the attention itself)."""
    return name.replace(".core_attention.softmax_offset", ".softmax_offset")


def run_omnitron(fx: dict, config=None) -> tuple[dict, dict]:
    """omnitron's one-process float64 model of a case on its weights (``config``: its GPTConfig, default
    :func:`config_of` the case's flags): (outputs, gradients by Megatron's names)."""
    from omnitron.core.models.gpt import GPTModel

    V, S = fx["logits"].shape[-1], fx["tokens"].shape[1]
    model = GPTModel(config or config_of(fx["flags"], fx["base"], V, S), ParallelGroups.single()).double().train()
    names = {omnitron_name(n): n for n in fx["weights"]}
    missing = model.load_state_dict({o: fx["weights"][n].double() for o, n in names.items()}, strict=False)
    assert not missing.unexpected_keys and all(n.endswith("inv_freq") for n in missing.missing_keys), missing
    assert sorted(n for n, _ in model.named_parameters()) == sorted(names)
    with reference_kernels():
        with torch.no_grad():
            logits = model(fx["tokens"]).transpose(0, 1)  # [b, s, V], as megatron-core returns them
        loss = model(fx["tokens"], labels=fx["labels"])
        loss.double().mean().backward()
    out = {"logits": logits, "loss": loss.detach(), "inv_freq": getattr(model, "inv_freq", None)}
    return out, {names[n]: p.grad for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def token_scales(case: str) -> dict:
    """Per parameter (Megatron's names), ``sum_t ||g_t||``: the norms of the terms whose sum is its gradient, g_t the
    gradient of token t's loss over the token count (omnitron's one-process float64 model, one backward a token;
    kept per case for the tp2 test)."""
    from omnitron.core.models.gpt import GPTModel

    fx = FIXTURES[case]
    V, S = fx["logits"].shape[-1], fx["tokens"].shape[1]
    model = GPTModel(config_of(fx["flags"], fx["base"], V, S), ParallelGroups.single()).double().train()
    names = {omnitron_name(n): n for n in fx["weights"]}
    model.load_state_dict({o: fx["weights"][n].double() for o, n in names.items()}, strict=False)
    n = fx["tokens"].numel()
    sums = {n_: 0.0 for n_ in fx["weights"]}
    with reference_kernels():
        for t in range(n):
            model.zero_grad()
            loss = model(fx["tokens"], labels=fx["labels"])  # afresh: the cross-entropy's backward is in place
            (loss.double().flatten()[t] / n).backward()
            for o, p in model.named_parameters():
                sums[names[o]] += float(p.grad.norm())
    return sums


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm())


def worst(fx: dict, out: dict, grads: dict, scales: dict, tp2: bool = False) -> dict:
    """Errors against megatron-core's run (tp2: its two-rank run's loss and gathered gradients), each gradient's
    relative to ``scales`` (token_scales), the loss and logits norm-wise relative (the docstring's measure)."""
    ref = fx["tp2"] if tp2 else fx
    errs = {"loss": relative_error(out["loss"], ref["loss"])}
    errs.update({n: distance(g, ref["grads"][n]) / scales[n] for n, g in grads.items()})
    if not tp2:
        errs["logits"] = relative_error(out["logits"], fx["logits"])
    return errs


@pytest.mark.parametrize("case", sorted(FIXTURES))
def test_gpt_flag_equals_megatron_core(case):
    fx = FIXTURES[case]
    out, grads = run_omnitron(fx)
    if fx["inv_freq"] is not None:
        assert relative_error(out["inv_freq"], fx["inv_freq"]) < 1e-7  # one float32 ulp each (docstring)
    scales = token_scales(case)
    for tp2 in (False, True):
        errs = worst(fx, out, grads, scales, tp2)
        assert max(errs.values()) < TOL, (tp2, sorted(errs.items(), key=lambda kv: -kv[1])[:3])


def _tp2_errors() -> dict:
    """On each of two ranks: omnitron's GPT at tensor-parallel size 2 (float64, the reference kernels) on every
    case's weights; per case, the loss's relative error and each gathered gradient's distance (tp-partial ones
    reduced as the training step reduces them) from megatron-core's two-rank run."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt import GPTModel, allreduce_sequence_parallel_grads, gather_full_state
    from omnitron.core.models.gpt.state import shard_full_state
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    be = get_backend()
    groups, dev = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=be), be.device()
    out = {}
    for case, fx in FIXTURES.items():
        V, S = fx["logits"].shape[-1], fx["tokens"].shape[1]
        model = to_device(GPTModel(config_of(fx["flags"], fx["base"], V, S), groups).double(), dev).train()
        names = {omnitron_name(n): n for n in fx["weights"]}
        shard_full_state(model, {o: fx["weights"][n].double() for o, n in names.items()}, groups)
        loss = model(fx["tokens"].to(dev), labels=fx["labels"].to(dev))
        loss.double().mean().backward()
        allreduce_sequence_parallel_grads(model, groups)
        grads = gather_full_state(model, groups, grads=True)
        errs = {n: distance(grads[o].cpu(), fx["tp2"]["grads"][n]) for o, n in names.items()}
        errs["loss"] = relative_error(loss.detach().cpu(), fx["tp2"]["loss"])
        out[case] = errs
    return out


def test_gpt_flags_at_tp2_equal_megatron_core_at_tp2():
    """omnitron's own tp2 layout (not only its one process) against megatron-core's tp2 run, every case."""
    from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed

    ranks = run_distributed(_tp2_errors, 2, env=REFERENCE_KERNELS, timeout_s=600)
    for case, fx in FIXTURES.items():
        scales = token_scales(case)
        for rank in ranks:
            errs = {n: e if n == "loss" else e / scales[n] for n, e in rank[case].items()}
            assert max(errs.values()) < TOL, (case, sorted(errs.items(), key=lambda kv: -kv[1])[:3])


@pytest.mark.parametrize("case,flag,wrong", [("rotary_interleaved", "rotary_interleaved", False),
                                             ("rmsnorm_eps_1e-2", "layernorm_epsilon", 1e-5),
                                             ("rotary_percent_half_base_500", "rotary_percent", 1.0)])
def test_a_wrong_flag_is_caught(case, flag, wrong):
    """The measure still fails a planted wrong flag: the case's model built with ``flag`` set to ``wrong``."""
    fx = dict(FIXTURES[case])
    scales = token_scales(case)
    fx["flags"] = {**fx["flags"], flag: wrong}
    out, grads = run_omnitron(fx)
    errs = worst(fx, out, grads, scales)
    assert max(errs.values()) > 100 * TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_post_layernorm_residual_flag_is_megatron_cores_no_op():
    """--apply-residual-connection-post-layernorm: megatron-core's layers never read it (the fixture case
    ``residual_post_layernorm_flag`` is its pre-norm model), so the command line takes it and builds the same model,
    and a Megatron checkpoint's args with it import."""
    from omnitron.core.checkpoint.megatron import config_from_megatron
    from omnitron.core.training.arguments import parse_settings

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64"]
    flagged = parse_settings(base + ["--apply-residual-connection-post-layernorm"], 1)
    assert flagged.model == parse_settings(base, 1).model
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                apply_residual_connection_post_layernorm=True)
    assert config_from_megatron(args, vocab_size=64, dtype=torch.float32).num_layers == 2


def test_no_position_embedding_builds_and_converts():
    """``--position-embedding-type none`` (NoPE, Megatron's ``none``): no position table, no RoPE buffer; a Megatron
    run's args with it import as it; a Hugging Face export (GPT-2 has learned positions, Llama RoPE) is refused."""
    from omnitron.core.checkpoint.hf import HFConversionError, hf_model_type
    from omnitron.core.checkpoint.megatron import config_from_megatron
    from omnitron.core.models.gpt import GPTModel, llama_tiny

    cfg = llama_tiny(num_layers=2, hidden_size=32, vocab_size=64, position_embedding_type="none")
    model = GPTModel(cfg, ParallelGroups.single())
    assert model.embedding.position_embeddings is None and not hasattr(model, "inv_freq")
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                position_embedding_type="none")
    back = config_from_megatron(args, vocab_size=64, dtype=torch.float32)
    assert back.position_embedding_type == "none" and back.max_position_embeddings is None
    with pytest.raises(HFConversionError, match="--position-embedding-type none"):
        hf_model_type(cfg)


def test_squared_relu_is_refused_with_swiglu_carried_by_megatron_args_and_refused_by_hf_export():
    """``--squared-relu``: refused with a gated MLP (Megatron asserts not --swiglu), carried by Megatron's args both
    ways, refused by a Hugging Face export (no such MLP there). With biases and the default bias-GeLU fusion the
    config is accepted (the same function, unfused; the command line refuses it as Megatron does:
    tests/training/test_megatron_flags.py), and the Megatron args written for it turn the fusion off, which
    Megatron's TransformerConfig refuses beside a squared ReLU."""
    from omnitron.core.checkpoint.hf import HFConversionError, hf_model_type
    from omnitron.core.checkpoint.megatron import args_for, config_from_megatron
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.models.gpt import gpt2_tiny

    with pytest.raises(ConfigError, match="--squared-relu .*--swiglu"):
        gpt2_tiny(squared_relu=True, swiglu=True)
    args = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, squared_relu=True)
    assert config_from_megatron(args, vocab_size=64, dtype=torch.float32).squared_relu
    biased = gpt2_tiny(squared_relu=True)
    assert biased.add_bias_linear and biased.bias_gelu_fusion  # Megatron's refused combination, accepted here
    assert not args_for(biased, 1, 1, 0, {}, "local").bias_gelu_fusion  # ... and written as Megatron takes it
    assert args_for(gpt2_tiny(), 1, 1, 0, {}, "local").bias_gelu_fusion  # the biased GeLU keeps its fusion
    with pytest.raises(HFConversionError, match="--squared-relu"):
        hf_model_type(biased)


def test_squared_relu_reaches_the_experts():
    """An MoE layer's expert MLP under --squared-relu is ``relu(x W1^T)^2 W2^T`` (plain float64 maths)."""
    import torch.nn.functional as F

    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.transformer.moe.experts import expert_mlp

    c = gpt2_tiny(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=24, vocab_size=32,
                  seq_length=8, max_position_embeddings=8, num_experts=2, squared_relu=True, add_bias_linear=False,
                  params_dtype=torch.float64)
    expert = GPTModel(c, ParallelGroups.single()).decoder.layers["0"].mlp.experts["0"]
    x = torch.randn(5, 16, dtype=torch.float64)
    w1, w2 = expert.linear_fc1.weight.detach(), expert.linear_fc2.weight.detach()
    # float64, the same products summed in another order: ~1e-15 relative; a GeLU or an unsquared ReLU errs by O(1)
    torch.testing.assert_close(expert_mlp(expert, x), F.relu(x @ w1.t()).pow(2) @ w2.t(), rtol=1e-12, atol=1e-12)
