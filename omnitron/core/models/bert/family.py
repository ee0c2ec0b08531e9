"""The BERT family's contract with the engine (see :mod:`omnitron.core.models.family`)."""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError
from omnitron.core.models.bert import config as B
from omnitron.core.models.family_base import ModelFamily


def build_stage(cfg, groups, **kw):
    from omnitron.core.models.bert.model import BertModel

    return BertModel(cfg, groups, **kw)


def forward_step(chunk, m, batch: dict, hidden):
    """``(per-token MLM loss, binary logits)`` on the last stage, for :func:`bert_loss`; every stage reads
    the padding mask. The micro-batch's sentence-order loss is also kept for the log (``sop loss``)."""
    out = chunk(batch["tokens"], batch["padding_mask"], batch["tokentype_ids"], labels=batch["labels"],
                hidden=hidden)
    if m.post_process and out[1] is not None:
        from omnitron.core.models.bert.model import record_sop_loss

        record_sop_loss(m, out[1], batch["is_random"])
    return out


def loss(output, batch):
    from omnitron.core.models.bert.model import bert_loss

    return bert_loss(output, batch)


def build_datasets(settings, tokenizer, **sizes):
    from omnitron.core.data.bert_dataset import build_bert_datasets

    return build_bert_datasets(settings.data, tokenizer, binary_head=settings.model.bert_binary_head, **sizes)


def check_wordpiece_flags(merged: dict, name: str) -> None:
    """BERT and T5: a WordPiece tokenizer (the default) with [CLS]/[SEP]/[MASK]/[PAD], and no --prompt."""
    tok = merged.setdefault("tokenizer_type", "BertWordPieceLowerCase")
    if not tok.startswith("BertWordPiece"):
        raise ConfigError(f"--tokenizer-type {tok}: {name} needs [CLS]/[SEP]/[MASK]/[PAD] tokens; use "
                          "--tokenizer-type BertWordPieceLowerCase or BertWordPieceCase")
    if merged.get("prompt"):
        raise ConfigError(f"--prompt samples a GPT continuation, which {name} training here does not write; "
                          "drop --prompt")


def check_flags(merged: dict) -> None:
    """The WordPiece check, and no ``--calculate-per-token-loss``: BERT's loss (:func:`bert_loss`, Megatron's
    pretrain_bert) is each micro-batch's masked-LM mean plus its sentence-order loss, one number per
    micro-batch with no token count to sum, so the flag would silently train the per-micro-batch mean."""
    check_wordpiece_flags(merged, "BERT")
    if merged.get("calculate_per_token_loss"):
        raise ConfigError("--calculate-per-token-loss with --model-type bert: BERT's loss is the mean of each "
                          "micro-batch's masked-LM loss plus its sentence-order loss, not a sum over tokens; drop "
                          "--calculate-per-token-loss")


BERT_FAMILY = ModelFamily(
    name="bert", description="bert (Megatron's pretrain_bert: masked LM + sentence-order head)",
    config_cls=B.BertConfig, presets={"bert_tiny": B.bert_tiny, "bert_base": B.bert_base},
    build_stage=build_stage, forward_step=forward_step, loss_fn=loss, stages_read_batch=True,
    build_datasets=build_datasets, num_parameters=B.num_parameters,
    validate=B.validate_bert,
    check_flags=check_flags,
    generate_refusal="this is a BERT checkpoint: a bidirectional encoder has no text to generate; generate from a "
                     "GPT, T5 or multimodal (LLaVA) checkpoint")
