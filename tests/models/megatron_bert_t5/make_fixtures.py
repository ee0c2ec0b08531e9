"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN CODE: the BERT and T5 losses omnitron must
reproduce on the same weights and batch (tests/models/test_bert_t5_megatron.py).

Needs the Megatron-LM d98e8a6 snapshot (``megatron/``) and psutil on the path; runs on CPU (gloo, one process),
offline, in float32. Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/models/megatron_bert_t5/make_fixtures.py

omnitron is not imported. Cases: megatron-core's ``BertModel`` (local spec) built as pretrain_bert's
model_provider builds it, with and without the binary head (``num_tokentypes = 2 if bert_binary_head else 0``;
without the head pretrain_bert feeds no token types), and its ``T5Model`` with 3 encoder and 1 decoder layers
(the local spec's final norms are TENorm, None without Transformer Engine: the plain LayerNorm stands in, as
Megatron with TE has them). Weights: Megatron's own seeded CPU initialization. Stored per case: the weights
(omnitron's names: BERT's ``encoder.`` is ``decoder.``, T5's ``lm_head.output_layer.bias`` is
``output_layer.bias``), the batch in omnitron's form (padding mask true at padding), Megatron's per-token loss
and, for BERT, its sentence-order logits, and the loss pretrain_bert / pretrain_t5's loss function takes.
"""
from __future__ import annotations

import contextlib
import os
import sys
from copy import deepcopy

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
V, S, SD, B, H = 128, 16, 8, 3, 32  # vocabulary, encoder / decoder sequence, batch, hidden
COMMON = dict(hidden_size=H, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
              attention_dropout=0.0, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
              masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False)


def _setup():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def _state(model, rename) -> dict:
    return {rename(k): v.detach().clone() for k, v in model.state_dict().items()
            if torch.is_tensor(v) and "_extra_state" not in k and k != "position_embeddings.weight"}


def bert_case(binary: bool, seed: int) -> dict:
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, bias_activation_fusion=True, **COMMON)
    model = BertModel(config=cfg, transformer_layer_spec=bert_layer_local_spec, vocab_size=V, max_sequence_length=S,
                      num_tokentypes=2 if binary else 0, add_binary_head=binary,
                      share_embeddings_and_output_weights=True, parallel_output=True).eval()
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(1, V, (B, S), generator=g)
    lengths = torch.tensor([S, S - 5, S - 8])
    pad = torch.arange(S)[None] >= lengths[:, None]
    types = (torch.arange(S)[None] >= (lengths[:, None] // 2)).long() * ~pad
    mask = ((torch.rand(B, S, generator=g) < 0.3) & ~pad).float()
    mask[:, 1] = 1.0
    labels, is_random = torch.randint(1, V, (B, S), generator=g), torch.tensor([0, 1, 1])
    with torch.no_grad():  # pretrain_bert: padding_mask 1 = keep; no token types without the binary head
        lm, sop = model(tokens, (~pad).long(), tokentype_ids=types if binary else None, lm_labels=labels)
    lm_loss = (lm.float().view(-1) * mask.view(-1)).sum() / mask.sum()
    loss = lm_loss + (F.cross_entropy(sop.view(-1, 2).float(), is_random) if binary else 0.0)
    return {"kind": "bert", "binary": binary, "weights": _state(model, lambda k: k.replace("encoder.", "decoder.", 1)),
            "batch": {"tokens": tokens, "padding_mask": pad, "tokentype_ids": types, "loss_mask": mask,
                      "labels": labels, "is_random": is_random},
            "lm": lm.float(), "sop_logits": sop.float() if binary else None, "loss": float(loss)}


def t5_case(enc: int, dec: int, seed: int) -> dict:
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.models.T5.t5_spec import (LNImpl, get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=dec, bias_activation_fusion=True, **COMMON)
    ecfg = deepcopy(cfg)
    ecfg.num_layers = enc
    es, ds = get_t5_encoder_with_local_block_spec(enc), get_t5_decoder_with_local_block_spec(dec)
    es.layer_norm = ds.layer_norm = LNImpl
    model = T5Model(config=cfg, encoder_config=ecfg, transformer_encoder_layer_spec=es,
                    transformer_decoder_layer_spec=ds, vocab_size=V, max_sequence_length=S, parallel_output=True,
                    share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute").eval()
    g = torch.Generator().manual_seed(seed + 1)
    enc_tok, dec_tok = torch.randint(1, V, (B, S), generator=g), torch.randint(1, V, (B, SD), generator=g)
    enc_tok[1, 11:], enc_tok[2, 7:], dec_tok[1, 6:], dec_tok[2, 4:] = 0, 0, 0, 0  # id 0 pads (Megatron's rule)
    labels, loss_mask = torch.randint(1, V, (B, SD), generator=g), (dec_tok != 0).float()
    masks = T5MaskedWordPieceDataset.config_attention_mask(enc_tok, dec_tok, enc_tok == 0, dec_tok == 0, True)
    with torch.no_grad():
        lm = model(enc_tok, dec_tok, *masks, lm_labels=labels).float()
    loss = (lm.view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
    return {"kind": "t5", "encoder_num_layers": enc, "decoder_num_layers": dec,
            "weights": _state(model, lambda k: k.replace("lm_head.output_layer.", "output_layer.")),
            "batch": {"tokens": enc_tok, "decoder_tokens": dec_tok, "padding_mask": enc_tok == 0, "labels": labels,
                      "loss_mask": loss_mask}, "lm": lm, "loss": float(loss)}


def main() -> None:
    _setup()
    cases = {"bert_binary": bert_case(True, 3), "bert_no_binary_head": bert_case(False, 4), "t5_3_1": t5_case(3, 1, 5)}
    meta = {"shape": {"vocab_size": V, "seq_length": S, "decoder_seq_length": SD, "hidden_size": H}}
    torch.save({"meta": meta, "cases": cases}, os.path.join(HERE, "fixtures.pt"))
    for name, c in cases.items():
        print(name, c["loss"], file=sys.stderr)


if __name__ == "__main__":
    main()
