"""Multi-token prediction (transformer/mtp.py): the loss and every gradient of a float64 model against the
definition (DeepSeek-V3 section 2.2) written out here in plain torch; the parameter count; refusals; and the
pipeline-parallel layout (the MTP modules and an embedding copy on the last stage) against one process."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.parity import ADAM_LOOP_REL, reference_kernels

# float64 throughout; the model and the reference differ only in the order of sums (dot products of <= 64
# terms, a few chained GEMMs, log-softmax over 40 columns): relative error ~ sqrt(n) u * depth ~ 1e-14. A wrong
# shift, concat order, norm or mask changes the loss by O(0.1).
TOL = 1e-11


def _config(**kw):
    from omnitron.core.models.gpt import GPTConfig

    base = dict(num_layers=2, hidden_size=24, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
                seq_length=12, vocab_size=40, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                attention_dropout=0.0, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                position_embedding_type="rope", mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                params_dtype=torch.float64)
    base.update(kw)
    return GPTConfig(**base)


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _shift(t: torch.Tensor, k: int) -> torch.Tensor:
    return torch.cat([t[:, k:], torch.zeros_like(t[:, :k])], dim=1)


def _ce(h: torch.Tensor, w_out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` cross-entropy of ``h [s, b, h] @ w_out^T`` against ``labels [b, s]``."""
    logp = torch.log_softmax(h.transpose(0, 1) @ w_out.t(), dim=-1)
    return -logp.gather(-1, labels[..., None])[..., 0]


def _reference(m, c, tokens, labels, mask):
    """(LM loss, MTP loss) from the definition: the main hidden ``h_0`` (embedding, layers, final norm), then per
    depth k ``h_k = norm_f(layer_k(W_k [norm_e(E[t_{i+k}]) ; norm_h(h_{k-1})]))`` and the masked mean CE against
    ``t_{i+k+1}``, weighted ``lambda / D``. The decoder layers are the model's own modules (tested elsewhere)."""
    emb = m.embedding.word_embeddings.weight
    w_out = emb if m.output_layer.weight is None else m.output_layer.weight
    freqs = m._rope_freqs(None, tokens.shape[1], tokens.device)
    x = emb[tokens.t()]
    for layer in m.decoder.layers.values():
        x = layer(x, freqs)
    h = _rms(x, m.decoder.final_layernorm.weight, c.layernorm_epsilon)
    lm = (_ce(h, w_out, labels) * mask).sum() / mask.sum()
    mtp = 0.0
    for k, d in enumerate(m.mtp.layers, start=1):
        e = _rms(emb[_shift(tokens, k).t()], d.enorm.weight, c.layernorm_epsilon)
        h = torch.cat([e, _rms(h, d.hnorm.weight, c.layernorm_epsilon)], dim=-1) @ d.eh_proj.weight.t()
        h = _rms(d.transformer_layer(h, freqs), d.final_layernorm.weight, c.layernorm_epsilon)
        mk = _shift(mask, k)
        mtp = mtp + (_ce(h, w_out, _shift(labels, k)) * mk).sum() / mk.sum()
    return lm, c.mtp_loss_scaling_factor / c.mtp_num_layers * mtp


@pytest.mark.parametrize("untie", [False, True])
def test_mtp_loss_and_gradients_equal_the_definition(untie):
    from omnitron.core.models.gpt import GPTModel

    c = _config(untie_embeddings_and_output_weights=untie)
    with reference_kernels():
        m = GPTModel(c, ParallelGroups.single(), backend=get_backend("cpu"), seed=7 + untie)
        with torch.no_grad():  # norm weights away from 1, so a missing norm weight shows
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(0.3 * torch.randn_like(p))
        g = torch.Generator().manual_seed(3 + untie)
        tokens = torch.randint(0, c.vocab_size, (3, c.seq_length), generator=g)
        labels = torch.randint(0, c.vocab_size, (3, c.seq_length), generator=g)
        mask = (torch.rand(3, c.seq_length, generator=g) > 0.2).double()
        m.mtp.aux_loss_scale = 2.5  # the step's weight of a micro-batch's loss
        out = m(tokens=tokens, labels=labels, loss_mask=mask)
        ((out * mask).sum() / mask.sum()).backward()
        ours = {n: p.grad.clone() for n, p in m.named_parameters()}
        ours_mtp = m.mtp.loss_total
        m.zero_grad()
        lm, mtp = _reference(m, c, tokens, labels, mask)
        (lm + 2.5 * mtp).backward()
    assert mtp.item() > 0.05  # lambda / D x ~2 x 2 depths: the check below is not of a vanishing term
    torch.testing.assert_close(ours_mtp, mtp.detach(), rtol=TOL, atol=0.0)
    for n, p in m.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=TOL, atol=1e-14, msg=lambda s: f"{n}: {s}")


@pytest.mark.parametrize("untie", [False, True])
def test_only_the_end_stages_hold_tied_embedding_copies(untie):
    """finalize_model_grads sums the tied copies over ``groups.embedding`` (first and last pipeline rank). Under a
    V-shaped schedule the last pipeline rank holds middle stages only: such a chunk holds no copy (an untied MTP
    model's middle chunk once asked for the last stage's ``mtp_embedding`` and stopped zb-v / dualpipe-v)."""
    from omnitron.core.models.gpt import GPTModel

    c = _config(untie_embeddings_and_output_weights=untie)
    kw = dict(backend=get_backend("cpu"), num_layers=1)
    first, middle, last = (GPTModel(c, ParallelGroups.single(), pre_process=pre, post_process=post, **kw)
                           for pre, post in ((True, False), (False, False), (False, True)))
    assert middle.shared_embedding_parameters() == []
    assert [p.shape for p in first.shared_embedding_parameters()] == [first.embedding.word_embeddings.weight.shape]
    copy = last.mtp_embedding.weight if untie else last.output_layer.weight
    assert len(last.shared_embedding_parameters()) == 1 and last.shared_embedding_parameters()[0] is copy


def test_mtp_parameter_count_and_refusals():
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.config import num_parameters, validate_model
    from omnitron.core.models.gpt.presets import deepseek_v3_tiny

    for c in (_config(), deepseek_v3_tiny(mtp_num_layers=2)):  # dense, and MLA + MoE (the last layer's kind)
        with torch.device("meta"):
            m = GPTModel(c, ParallelGroups.single())
        assert sum(p.numel() for p in m.parameters()) == num_parameters(c)
        assert num_parameters(c) > num_parameters(_replace(c, mtp_num_layers=None))
    validate_model(_config(), ParallelConfig(context_parallel_size=2))  # runs under cp (test_cp_variants.py)
    with pytest.raises(ConfigError, match="needs rotary positions"):
        validate_model(_config(position_embedding_type="learned_absolute"), ParallelConfig())
    with pytest.raises(ConfigError, match="positive integer"):
        validate_model(_config(mtp_num_layers=0), ParallelConfig())


def _replace(c, **kw):
    import dataclasses

    return dataclasses.replace(c, **kw)


def _tiny_args(tmp: str, *extra: str) -> list[str]:
    return ["--model", "deepseek_v3_tiny", "--mtp-num-layers", "1", "--seq-length", "32", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--num-workers", "0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--lr-warmup-iters", "0",
            "--lr-decay-style", "constant", "--log-interval", "1", "--no-tensorboard", "--eval-interval", "0",
            "--log-dir", tmp, *extra]


def test_mtp_trains_through_the_cli(tmp_path):
    """``--mtp-num-layers`` reaches the model; the run logs the MTP loss beside the LM loss."""
    import json

    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    settings = parse_settings(_tiny_args(str(tmp_path), "--train-iters", "1", "--seq-length", "16"), 1)
    assert settings.model.mtp_num_layers == 1
    train(settings, get_backend("cpu"))
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    mtp = [r["mtp_loss"] for r in recs if "mtp_loss" in r]
    assert len(mtp) == 1 and all(0.1 * 3.0 < v < 0.1 * 6.0 for v in mtp), mtp  # lambda x ~ln(64) at init


LAYOUTS = {"pp2": ("--pipeline-model-parallel-size", "2"),
           # the V: first and last stage on rank 0, middle stages only on the last pipeline rank
           "pp2 zb-v": ("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
                        "--num-layers-per-virtual-pipeline-stage", "1"),
           "tp2_sp": ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
           "cp2": ("--context-parallel-size", "2")}  # MLA's ring and the shifts across chunks (test_cp_variants)


def _train_layouts(tmp: str) -> dict[str, dict]:
    import torch.distributed as dist

    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    return {name: train(settings_in(_tiny_args(f"{tmp}/{name}", *lay), dist.get_world_size(), torch.float64),
                        get_backend())["losses"] for name, lay in LAYOUTS.items()}


@pytest.mark.slow  # two two-process and two one-process trainings of the tiny preset: 130 s on the loaded machine
@pytest.mark.multiprocess
def test_mtp_layouts_match_one_process(tmp_path):
    """pp2 (the MTP depth and a copy of the untied embedding on the last stage, its gradient summed with the
    first stage's), tp2 + sp and cp2 train a float64 model as one process: three steps' LM losses agree to
    ADAM_LOOP_REL. Steps 2 and 3 depend on the MTP gradients of the steps before (lr 1e-2)."""
    from omnitron.core.training.loop import train
    from omnitron.testing.distributed import run_distributed
    from omnitron.testing.training import settings_in

    one = train(settings_in(_tiny_args(str(tmp_path / "one")), 1, torch.float64), get_backend("cpu"))["losses"]
    none = train(settings_in(_tiny_args(str(tmp_path / "none"), "--mtp-loss-scaling-factor", "0"), 1, torch.float64),
                 get_backend("cpu"))["losses"]
    assert abs(one[3] - none[3]) > 1e-4 * abs(one[3])  # the MTP gradient moves the step-3 loss beyond the tolerance
    for rank_losses in run_distributed(_train_layouts, 2, str(tmp_path)):
        for name, losses in rank_losses.items():
            for it in one:
                assert losses[it] == pytest.approx(one[it], rel=ADAM_LOOP_REL), (name, it, losses, one)
