"""The GPT/Llama family's contract with the engine (see :mod:`omnitron.core.models.family`)."""
from __future__ import annotations

import functools

from omnitron.core.models.family_base import ModelFamily
from omnitron.core.models.gpt import config as C
from omnitron.core.models.gpt import presets as P


def build_stage(cfg, groups, **kw):
    from omnitron.core.models.gpt.model import GPTModel

    return GPTModel(cfg, groups, **kw)


def forward_step(chunk, m, batch: dict | None, hidden):
    """Tokens and positions in on the first stage, per-token loss out on the last; every stage reads the
    batch's document ids under ``--reset-attention-mask``. RoPE turns at the sequence positions on every stage
    (the batch's positions, restarted by ``--reset-position-ids``, feed the learned position embedding only)."""
    labels = batch["labels"] if m.post_process else None
    docs = batch.get("document_ids") if batch is not None else None  # --reset-attention-mask: every stage
    # multi-token prediction on the last stage reads the tokens and the loss mask too
    mtp = {"tokens": batch["tokens"], "loss_mask": batch.get("loss_mask")} if m.post_process and \
        getattr(m, "mtp", None) is not None else {}
    if m.pre_process:
        mtp["tokens"] = batch["tokens"]
        return chunk(position_ids=batch["position_ids"], labels=labels, document_ids=docs,
                     rope_at_sequence_positions=True, **mtp)
    return chunk(hidden=hidden, labels=labels, document_ids=docs, rope_at_sequence_positions=True, **mtp)


def build_datasets(settings, tokenizer, **sizes):
    from omnitron.core.data import build_gpt_datasets

    return build_gpt_datasets(settings.data, tokenizer, **sizes)


def generate(loaded, prompts, tokens, **kw) -> dict:
    from omnitron.core.inference.text import complete_gpt

    return complete_gpt(loaded, prompts, tokens, **kw)


GPT_FAMILY = ModelFamily(
    name="gpt", description="gpt (default): decoder-only GPT-2 / Llama", config_cls=C.GPTConfig,
    presets={"gpt2_tiny": P.gpt2_tiny, "llama_tiny": P.llama_tiny, "gpt_1p3b": P.gpt_1p3b, "llama3_8b": P.llama3_8b,
             "llama3_70b": P.llama3_70b, "llama3_405b": P.llama3_405b,
             "mixtral_8x7b": P.mixtral_8x7b,
             "deepseek_v3": P.deepseek_v3, "deepseek_v3_tiny": P.deepseek_v3_tiny, "gpt_oss_20b": P.gpt_oss_20b,
             "qwen3_30b_a3b": P.qwen3_30b_a3b, "qwen2_5_7b": P.qwen2_5_7b,
             **{f"gpt3_{size}": functools.partial(P.gpt3, size) for size in P.GPT3_SIZES}},
    build_stage=build_stage, forward_step=forward_step, build_datasets=build_datasets,
    num_parameters=C.num_parameters, generate=generate)
