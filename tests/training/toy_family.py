"""A fifth model family defined entirely here, to show the family contract is all the engine needs.

``omnitron train --model-family-module toy_family --model toy_tiny`` imports this module, which
registers the ``toy`` family: a window language model (each position's logits are a linear map of
the mean of the last ``--toy-context`` token embeddings), its own config field and preset, its own
synthetic dataset (arithmetic progressions modulo the vocabulary: the next token follows from the
previous two) and a refusal (no tensor or pipeline parallelism).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnitron.core.config.parallel import ConfigError
from omnitron.core.models.family import ModelFamily, register_family
from omnitron.core.models.gpt.config import GPTConfig
from omnitron.core.parallel.tensor.random import RNGTracker


@dataclass(kw_only=True)
class ToyConfig(GPTConfig):
    toy_context: int = 2
    """--toy-context: how many trailing tokens each position averages."""


def toy_tiny(**overrides) -> ToyConfig:
    kw = dict(num_layers=1, hidden_size=16, num_attention_heads=1, seq_length=16, max_position_embeddings=16,
              init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0)
    kw.update(overrides)
    return ToyConfig(**kw)


def init_weights(cfg: ToyConfig, seed: int) -> dict[str, torch.Tensor]:
    """The initial weights for ``seed``, float64 (the model casts them to its dtype)."""
    g = torch.Generator().manual_seed(seed)
    v, h = cfg.vocab_size, cfg.hidden_size
    return {"embedding": torch.randn(v, h, generator=g, dtype=torch.float64) * cfg.init_method_std,
            "output": torch.randn(v, h, generator=g, dtype=torch.float64) * cfg.init_method_std,
            "bias": torch.zeros(v, dtype=torch.float64)}


def window_mean(x: torch.Tensor, context: int) -> torch.Tensor:
    """``x [b, s, h]`` -> mean over each position's last ``context`` rows (fewer at the start)."""
    c = torch.cumsum(x, dim=1)
    shifted = torch.nn.functional.pad(c, (0, 0, context, 0))[:, :-context]  # [b, s, h]: cumsum up to t - context
    count = torch.clamp(torch.arange(1, x.shape[1] + 1, device=x.device), max=context).to(x.dtype)
    return (c - shifted) / count[None, :, None]


class ToyModel(nn.Module):
    """The whole toy model on one chunk: per-token cross-entropy out."""

    pre_process = post_process = True

    def __init__(self, config: ToyConfig, groups, *, backend=None, seed: int = 1234) -> None:
        super().__init__()
        self.config = config
        self.rng_tracker = RNGTracker(backend)  # no dropout here; checkpoints save its (empty) streams
        w = init_weights(config, seed)
        self.embedding = nn.Parameter(w["embedding"].to(config.params_dtype))
        self.output = nn.Parameter(w["output"].to(config.params_dtype))
        self.bias = nn.Parameter(w["bias"].to(config.params_dtype))

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = window_mean(self.embedding[tokens], self.config.toy_context)  # [b, s, h]
        logits = x @ self.output.t() + self.bias  # [b, s, V]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                 reduction="none").view_as(labels)  # [b, s]


class ProgressionDataset(torch.utils.data.Dataset):
    """Sample ``i``: ``a, a + d, a + 2d, ...`` modulo ``vocab`` with ``a``, ``d`` drawn from ``seed + i``."""

    def __init__(self, n: int, seq_length: int, vocab: int, seed: int) -> None:
        self.n, self.s, self.v, self.seed = n, seq_length, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed + i)
        a, d = int(torch.randint(self.v, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        seq = (a + d * torch.arange(self.s + 1)) % self.v
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.s)}


def build_datasets(settings, tokenizer, *, train_samples, valid_samples, test_samples, is_builder_rank=True,
                   barrier=None):
    """The contract's first signature, kept: an out-of-tree family written before ``is_node_builder`` trains."""
    if barrier is not None:
        barrier()
    s, v, seed = settings.model.seq_length, tokenizer.vocab_size, settings.training.seed
    return tuple(ProgressionDataset(n, s, v, seed + 10_000 * k) if n else None
                 for k, n in enumerate((train_samples, valid_samples, test_samples)))


def validate(cfg: ToyConfig, parallel) -> None:
    if parallel.tensor_model_parallel_size > 1 or parallel.pipeline_model_parallel_size > 1:
        raise ConfigError("the toy family has no tensor or pipeline parallelism; use --tensor-model-parallel-size 1 "
                          "--pipeline-model-parallel-size 1 (data parallelism works)")
    if cfg.toy_context < 1:
        raise ConfigError(f"--toy-context must be >= 1, got {cfg.toy_context}")


TOY_FAMILY = register_family(ModelFamily(
    name="toy", description="toy (a test family: window LM)", config_cls=ToyConfig, presets={"toy_tiny": toy_tiny},
    build_stage=ToyModel, pipelined=False,
    forward_step=lambda chunk, m, batch, hidden: chunk(batch["tokens"], batch["labels"]),
    build_datasets=build_datasets, num_parameters=lambda c: 2 * c.vocab_size * c.hidden_size + c.vocab_size,
    validate=validate, generate_refusal="the toy family does not generate"))
