"""Layer-parameter names between omnitron and Megatron-Core for MoE, MLA and MTP models (shared by the
``--ckpt-format torch`` and ``torch_dist`` converters).

Transcribed from megatron-core 0.16.1 (``models/gpt/gpt_layer_specs.py``, ``transformer/moe/experts.py``,
``extensions/transformer_engine.py`` ``_sharded_state_dict_grouped``, ``transformer/multi_token_prediction.py``)
and checked against its ``GPTModel.state_dict()`` / ``sharded_state_dict()`` on CPU
(tests/checkpoint/test_megatron_core_interop.py):

- Routed experts. Module names: SequentialMLP ``mlp.experts.local_experts.E.linear_fc1.weight``; TEGroupedMLP
  (``--moe-grouped-gemm``) ``mlp.experts.linear_fc1.weightE``. Both shard to one key with an expert axis,
  ``mlp.experts.experts.linear_fc1.weight`` ``[E, ...]`` (``mlp.experts.experts.E.linear_fc1.weight`` under
  ``singleton_local_shards``). omnitron: ``mlp.experts.E.linear_fc1.weight``. Router (``mlp.router.weight``,
  the buffer ``mlp.router.expert_bias``) and shared experts (``mlp.shared_experts.*``) keep their names.
- Norms. TE spec: a dense MLP fuses the pre-MLP norm into ``mlp.linear_fc1.layer_norm_weight``, a MoE layer keeps
  ``pre_mlp_layernorm``; GQA fuses the input norm into ``self_attention.linear_qkv.layer_norm_weight``, MLA keeps
  ``input_layernorm`` and fuses ``q_layernorm`` / ``kv_layernorm`` into ``linear_q_up_proj`` /
  ``linear_kv_up_proj`` (``.layer_norm_weight``). Local spec: module names are omnitron's; its sharded keys
  map ``input_layernorm.`` / ``pre_mlp_layernorm.`` to the fused names for GQA layers (MoE ones too), not for MLA.
- MTP: ``mtp.layers.K.{enorm,hnorm,eh_proj,final_layernorm}`` and ``mtp.layers.K.transformer_layer.<layer rest>``
  (never stacked), the same in both. Later megatron-core (the d98e8a6 snapshot) calls the layer module
  ``mtp_model_layer``: its ``--ckpt-format torch`` files say so (the importer reads both), its torch_dist keys
  keep ``transformer_layer``.
"""
from __future__ import annotations

import re

_GQA_NORMS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
              "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
_MLA_NORMS = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
              "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
_FUSED_BACK = {"self_attention.linear_qkv.layer_norm_": "input_layernorm.",
               "mlp.linear_fc1.layer_norm_": "pre_mlp_layernorm.",
               "self_attention.linear_q_up_proj.layer_norm_": "self_attention.q_layernorm.",
               "self_attention.linear_kv_up_proj.layer_norm_": "self_attention.kv_layernorm."}
_SEQUENTIAL = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SINGLETON = re.compile(r"^mlp\.experts\.experts\.(\d+)\.(.+)$")
_OURS = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
STACKED_EXPERTS = "mlp.experts.experts."
_LAYER = re.compile(r"^(decoder\.layers\.(\d+)\.|mtp\.layers\.(\d+)\.transformer_layer\.)(.+)$")


def omnitron_rest(rest: str) -> str:
    """omnitron's name of a layer parameter ``rest`` (after ``decoder.layers.N.``) in any of Megatron's spellings:
    TE-fused norms, SequentialMLP / TEGroupedMLP / singleton expert names (a stacked ``mlp.experts.experts.*``
    key is split by the caller)."""
    for fused, ours in _FUSED_BACK.items():
        if rest.startswith(fused):
            return ours + rest[len(fused):]
    for pat in (_SEQUENTIAL, _SINGLETON):
        m = pat.match(rest)
        if m:
            return f"mlp.experts.{m.group(1)}.{m.group(2)}"
    m = _GROUPED.match(rest)
    if m:
        return f"mlp.experts.{m.group(3)}.{m.group(1)}.{m.group(2)}"
    return rest


def te_rest(rest: str, *, mla: bool, moe: bool) -> str:
    """The TE spec's module name of omnitron layer parameter ``rest`` (experts still omnitron's)."""
    if rest.startswith("input_layernorm.") and not mla:
        return _GQA_NORMS["input_layernorm."] + rest[len("input_layernorm."):]
    if rest.startswith("pre_mlp_layernorm.") and not moe:
        return _GQA_NORMS["pre_mlp_layernorm."] + rest[len("pre_mlp_layernorm."):]
    for ours, fused in _MLA_NORMS.items():
        if rest.startswith(ours):
            return fused + rest[len(ours):]
    return rest


def local_sharded_rest(rest: str, *, mla: bool) -> str:
    """The local spec's sharded key of ``rest`` (its ``sharded_state_dict_keys_map``: GQA layers only)."""
    if not mla:
        for ours, fused in _GQA_NORMS.items():
            if rest.startswith(ours):
                return fused + rest[len(ours):]
    return rest


def dist_rests(rest: str, *, mla: bool, moe: bool) -> list[str]:
    """The torch_dist keys (after the layer prefix) omnitron writes for ``rest``: the TE spec's and the local
    spec's where they differ, so one checkpoint loads under both (extra keys are skipped by Megatron's default
    ``--dist-ckpt-strictness assume_ok_unexpected``); experts under the stacked ``mlp.experts.experts.``."""
    m = _OURS.match(rest)
    if m:
        return [STACKED_EXPERTS + m.group(2)]
    return list(dict.fromkeys([te_rest(rest, mla=mla, moe=moe), local_sharded_rest(rest, mla=mla)]))


def torch_rest(rest: str, *, mla: bool, moe: bool, te: bool) -> str:
    """The module name (``--ckpt-format torch``) of ``rest``: SequentialMLP's experts, TE-fused norms if ``te``."""
    m = _OURS.match(rest)
    if m:
        return f"mlp.experts.local_experts.{m.group(1)}.{m.group(2)}"
    return te_rest(rest, mla=mla, moe=moe) if te else rest


def layer_of(name: str) -> tuple[str, int | None, int | None, str] | None:
    """``(prefix, decoder layer, mtp depth, rest)`` of an omnitron layer parameter name, else None."""
    m = _LAYER.match(name)
    if m is None:
        return None
    return m.group(1), None if m.group(2) is None else int(m.group(2)), \
        None if m.group(3) is None else int(m.group(3)), m.group(4)


def is_moe(cfg, layer: int | None) -> bool:
    """Whether decoder layer ``layer`` (None: an MTP layer, built from the last decoder layer's spec) is MoE."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    return bool(cfg.num_experts) and is_moe_layer(cfg, cfg.num_layers - 1 if layer is None else layer)


def homogeneous(cfg) -> bool:
    """Whether Megatron stacks the decoder's layers under one key each (``TransformerBlock.sharded_state_dict``:
    not when ``--moe-layer-freq`` is a pattern or an integer above 1)."""
    freq = cfg.moe_layer_freq if cfg.num_experts else 1
    return isinstance(freq, int) and freq == 1 or (isinstance(freq, str) and freq.strip() == "1")


def extra_state_modules(rests) -> list[str]:
    """The modules of layer parameter names ``rests`` (Megatron's) that have an ``_extra_state``: every linear
    (``linear_*``, ``eh_proj``) and the TE spec's core attention."""
    mods = {r.rsplit(".", 1)[0] for r in rests if r.endswith(".weight")}
    out = sorted(m for m in mods if m.split(".")[-1].startswith("linear_") or m.endswith("eh_proj"))
    if any(m.startswith("self_attention.") for m in out):
        out.append("self_attention.core_attention")
    return out
