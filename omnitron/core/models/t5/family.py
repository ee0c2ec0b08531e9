"""The T5 family's contract with the engine (see :mod:`omnitron.core.models.family`)."""
from __future__ import annotations

from omnitron.core.models.bert.family import check_wordpiece_flags
from omnitron.core.models.family_base import ModelFamily
from omnitron.core.models.t5 import config as T


def build_stage(cfg, groups, **kw):
    from omnitron.core.models.t5.model import T5Model

    return T5Model(cfg, groups, **kw)


def forward_step(chunk, m, batch: dict, hidden):
    """One stage; per-token decoder loss, masked by the default loss function."""
    return chunk(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"], labels=batch["labels"],
                 decoder_padding_mask=batch.get("decoder_padding_mask"))


def build_datasets(settings, tokenizer, **sizes):
    from omnitron.core.data.t5_dataset import build_t5_datasets

    return build_t5_datasets(settings.data, tokenizer, decoder_seq_length=T.decoder_length(settings.model), **sizes)


def check_flags(merged: dict) -> None:
    """BERT's tokenizer rule; ``--encoder-seq-length`` sets ``--seq-length`` (Megatron's alias)."""
    check_wordpiece_flags(merged, "T5")
    if merged.get("encoder_seq_length"):
        merged["seq_length"] = merged["encoder_seq_length"]


def generate(loaded, prompts, tokens, **kw) -> dict:
    from omnitron.core.inference.text import complete_t5

    return complete_t5(loaded, prompts, tokens, **kw)


T5_FAMILY = ModelFamily(
    name="t5", description="t5 (pretrain_t5: encoder-decoder, span corruption)", config_cls=T.T5Config,
    presets={"t5_tiny": T.t5_tiny, "t5_base": T.t5_base}, build_stage=build_stage, pipelined=False,
    forward_step=forward_step, build_datasets=build_datasets, num_parameters=T.num_parameters,
    validate=T.validate_t5, check_flags=check_flags,
    tokenizer_kwargs=lambda cfg: {"vocab_extra_ids": cfg.vocab_extra_ids}, generate=generate)
