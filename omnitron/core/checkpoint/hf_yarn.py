"""Hugging Face's YaRN ``rope_parameters`` to and from omnitron's YaRN flags (--rotary-scaling-factor, --mscale,
--mscale-all-dim, ...), for the architectures that carry YaRN (DeepSeek-V3's MLA, gpt-oss's and Qwen3-MoE's
grouped-query attention; :mod:`.hf_moe`).

transformers 5's ``_compute_yarn_parameters`` computes the same inverse frequencies as
:func:`omnitron.core.transformer.yarn.yarn_inv_freq`; its scales are derived otherwise (:func:`_yarn_mscales`).
"""
from __future__ import annotations

import math

from omnitron.core.checkpoint.hf_llama import HFConversionError
from omnitron.core.transformer.yarn import concentration, yarn_get_mscale


def _rope_kind(hf: dict) -> tuple[dict, str]:
    """(rope parameters, rope type) of a config: ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    return params, params.get("rope_type", params.get("type", "default"))


def _yarn_rope(hf: dict) -> dict:
    """RoPE base and YaRN's settings (rope_type ``yarn``) of a config (scales: :func:`_yarn_mscales`)."""
    params, kind = _rope_kind(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return dict(rotary_base=theta)
    if kind != "yarn":
        raise HFConversionError(f"config.json: rope_type {kind!r} is not supported; omnitron implements plain RoPE "
                                "and YaRN ('yarn') for this architecture")
    mscale, mscale_all_dim = _yarn_mscales(params, float(params["factor"]))
    return dict(rotary_base=theta, rotary_scaling_factor=float(params["factor"]),
                mscale=mscale, mscale_all_dim=mscale_all_dim,
                yarn_original_max_position_embeddings=int(params.get("original_max_position_embeddings", 4096)),
                yarn_beta_fast=float(params.get("beta_fast", 32.0)), yarn_beta_slow=float(params.get("beta_slow", 1.0)),
                yarn_correction_range_round_to_int=bool(params.get("truncate", True)))


def _gqa_rope(hf: dict) -> dict:
    """:func:`_yarn_rope` of a grouped-query attention's config with its --position-embedding-type: ``yarn`` where
    the config has YaRN (Megatron's spelling; its ``rope`` would ignore the factor), else ``rope``."""
    out = _yarn_rope(hf)
    return dict(out, position_embedding_type="yarn" if "rotary_scaling_factor" in out else "rope")


def _yarn_mscales(params: dict, factor: float) -> tuple[float, float]:
    """(--mscale, --mscale-all-dim) of transformers' YaRN ``params`` (``_compute_yarn_parameters``).

    transformers multiplies the rotated parts by ``attention_factor``, else by ``m(f, mscale) / m(f,
    mscale_all_dim)`` when both are set (non-zero), else by ``m(f, 1)`` (``mscale`` alone is ignored); MLA's softmax
    scale takes ``m(f, mscale_all_dim)^2`` when that is set (``yarn_apply_mscale``). omnitron multiplies them by
    ``m(f, --mscale) / m(f, --mscale-all-dim)`` and MLA's softmax scale by ``m(f, --mscale-all-dim)^2``, with
    ``m(f, 0) = 1``: so --mscale-all-dim is ``mscale_all_dim`` and --mscale solves ``m(f, --mscale) = target x
    m(f, mscale_all_dim)`` (exact up to a rounding of the constant)."""
    ms, msa, af = params.get("mscale"), float(params.get("mscale_all_dim") or 0.0), params.get("attention_factor")
    if af is None and ms and msa:
        return float(ms), msa
    if af is None and not msa:
        return 1.0, 0.0
    target = yarn_get_mscale(factor, 1.0) if af is None else float(af)
    if factor <= 1.0:  # omnitron's YaRN at factor 1 is plain RoPE, unscaled
        if target != 1.0:
            raise HFConversionError(f"config.json: YaRN attention_factor={af} with factor {factor} is not supported: "
                                    "omnitron scales the rotated parts only above factor 1")
        return 1.0, msa
    return (target * yarn_get_mscale(factor, msa) - 1.0) / (0.1 * math.log(factor)), msa


def _yarn_to_hf(cfg) -> dict:
    """``rope_parameters`` of ``cfg``: plain RoPE, or YaRN; ``attention_factor`` (omnitron's concentration) where
    transformers would not derive it from ``mscale`` / ``mscale_all_dim`` (it takes their ratio only when both are
    set, else ``m(f, 1)``: :func:`_yarn_mscales`)."""
    out = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rotary_scaling_factor != 1.0:
        out = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
               "mscale": cfg.mscale, "mscale_all_dim": cfg.mscale_all_dim, "beta_fast": cfg.yarn_beta_fast or 32.0,
               "beta_slow": cfg.yarn_beta_slow or 1.0, "truncate": cfg.yarn_correction_range_round_to_int,
               "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings or 4096}
        if not (cfg.mscale and cfg.mscale_all_dim) and not (cfg.mscale == 1.0 and not cfg.mscale_all_dim):
            out["attention_factor"] = float(concentration(cfg))
    return out
