"""GPT model configuration (GPT-2 and Llama styles) and accounting; presets in presets.py (the package,
``omnitron.core.models.gpt``, exports the small ones); validation in validate.py.

Field names are Megatron's argument names; the CLI spells them ``--num-layers`` etc.
Derived numbers (padded vocabulary, parameter count, FLOPs) come from named functions and are
never written back into the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.models.gpt.validate import (  # noqa: F401 - re-exported: validate_model and its helpers
    _validate_context_parallel, _validate_fine_grained, _validate_mla, _validate_moe_overlap, _validate_mtp,
    _validate_offloading, _validate_recompute_num_layers, max_positions, offload_layers, uses_rope, validate_model)
from omnitron.core.transformer.shapes import (  # noqa: F401 - re-exported
    ffn_size, head_dim, padded_vocab_size, query_groups)
from omnitron.core.transformer.yarn import yarn_inv_freq


@dataclass(kw_only=True)
class GPTConfig:
    """A decoder-only Transformer LM. Defaults are GPT-2 style."""

    num_layers: int
    """--num-layers: Transformer layers in the whole model (all pipeline stages together)."""
    hidden_size: int
    """--hidden-size: width of the residual stream."""
    num_attention_heads: int
    """--num-attention-heads: query heads per layer."""
    ffn_hidden_size: int | None = None
    """--ffn-hidden-size: MLP width (per gate branch under SwiGLU); default 4 * hidden."""
    num_query_groups: int | None = None
    """--num-query-groups: key/value heads (grouped-query attention); None = one per query head (MHA)."""
    kv_channels: int | None = None
    """--kv-channels: per-head dimension; default hidden / heads."""
    seq_length: int = 1024
    """--seq-length: training sequence length."""
    max_position_embeddings: int | None = None
    """--max-position-embeddings: rows of the learned position table; default seq_length."""
    vocab_size: int = 50257
    """Real vocabulary size (from the tokenizer); padded per :func:`padded_vocab_size`."""
    make_vocab_size_divisible_by: int = 128
    """--make-vocab-size-divisible-by: the padded vocabulary is a multiple of this times tp."""
    padded_vocab_size: int | None = None
    """--padded-vocab-size: the embedding and output rows, as given (Megatron: no rounding then); a multiple of
    tp, at least the tokenizer's vocabulary. None: rounded per --make-vocab-size-divisible-by."""
    normalization: str = "LayerNorm"
    """--normalization: ``LayerNorm`` or ``RMSNorm``."""
    layernorm_epsilon: float = 1e-5
    """--layernorm-epsilon."""
    swiglu: bool = False
    """--swiglu: gated SiLU MLP (three matrices) instead of GeLU."""
    position_embedding_type: str = "learned_absolute"
    """--position-embedding-type: ``learned_absolute``, ``rope``, ``yarn`` (RoPE with YaRN's scaling of
    --rotary-scaling-factor and the --yarn-* / --mscale* flags, transformer/yarn.py; gpt-oss) or ``none`` (no
    position signal but the causal mask: NoPE, as Megatron's ``none``)."""
    rotary_base: float = 10000.0
    """--rotary-base: RoPE frequency base."""
    rotary_percent: float = 1.0
    """--rotary-percent: fraction of each head's channels that are rotated."""
    rotary_interleaved: bool = False
    """--rotary-interleaved: rotate adjacent channel pairs instead of halves."""
    rope_scaling_factor: float = 1.0
    """--rope-scaling-factor: Llama-3.1 frequency scaling factor (1.0 = off). On the command line it needs
    --use-rope-scaling, as Megatron's flag does (alone it is refused: Megatron would not scale); a config
    file's ``rope_scaling_factor`` scales by itself."""
    untie_embeddings_and_output_weights: bool = False
    """--untie-embeddings-and-output-weights: separate output matrix instead of the word embedding."""
    hidden_dropout: float = 0.1
    """--hidden-dropout: dropout on embeddings and on each sublayer's output before the residual add."""
    attention_dropout: float = 0.1
    """--attention-dropout: dropout on attention probabilities."""
    add_bias_linear: bool = True
    """--add-bias-linear / --disable-bias-linear: biases in every linear layer."""
    add_qkv_bias: bool = False
    """--add-qkv-bias: a bias on the attention's query/key/value projection (``linear_qkv``) even with
    --disable-bias-linear (Qwen2 / Qwen2.5: ``--disable-bias-linear --add-qkv-bias``); the output projection and
    the MLP keep --add-bias-linear's setting. Not with --multi-latent-attention (Megatron's MLA has no such bias)."""
    bias_gelu_fusion: bool = True
    """--no-bias-gelu-fusion: as Megatron, the GeLU MLP (no --swiglu) runs the tanh approximation only through
    the fused bias-GeLU, i.e. with this on and biases on; off, or with --disable-bias-linear, it runs the exact
    erf GeLU (:func:`omnitron.core.transformer.mlp.exact_gelu`)."""
    squared_relu: bool = False
    """--squared-relu: the MLP's activation is ``relu(x)^2`` (Primer; Nemotron-4) in place of the GeLU; not with
    --swiglu (Megatron asserts the same)."""
    qk_layernorm: bool = False
    """--qk-layernorm: normalize queries and keys per head (same norm type as the model)."""
    apply_layernorm_1p: bool = False
    """--apply-layernorm-1p: every norm scales by ``1 + weight`` with the weight initialised to 0 (Megatron's
    zero-centred gamma, ``layernorm_zero_centered_gamma``): the same function, a weight that weight decay
    and low precision see near 0 instead of near 1."""
    init_method_std: float = 0.02
    """--init-method-std: std of the normal init of weights."""
    apply_scaled_init: bool = True
    """Output projections (attention out, MLP fc2) use std / sqrt(2 * num_layers), as Megatron."""
    recompute_granularity: str | None = None
    """--recompute-granularity: None, ``full`` (whole layers) or ``selective`` (core attention)."""
    recompute_method: str | None = None
    """--recompute-method: ``uniform`` (chunks of recompute_num_layers) or ``block`` (first N layers of a stage)."""
    recompute_num_layers: int | None = None
    """--recompute-num-layers: layers per chunk (uniform) or layers recomputed per stage (block)."""
    cpu_offloading: bool = False
    """--cpu-offloading: move what the first --cpu-offloading-num-layers layers save for backward to host
    memory during forward, back before their backward (omnitron/core/transformer/offload.py); implied by
    --cpu-offloading-num-layers > 0, as in Megatron."""
    cpu_offloading_num_layers: int = 0
    """--cpu-offloading-num-layers: how many layers (the first ones; fewer than --num-layers) offload; with
    pipeline parallelism, the first ones of every pipeline chunk (fewer than the chunk holds)."""
    fine_grained_activation_offloading: bool = False
    """--fine-grained-activation-offloading (Megatron's): the --offload-modules of every layer offload what they
    save for backward (omnitron/core/transformer/offload_modules.py); not with --cpu-offloading."""
    offload_modules: list[str] | None = None
    """--offload-modules: Megatron's names attn_norm, qkv_linear, attn_proj, mlp_norm (its core_attn, expert_fc1,
    moe_act, fused_group_mlp and gdp_qkv are refused with the reason)."""
    min_offloaded_tensor_size: int = 1024 * 1024
    """--min-offloaded-tensor-size: elements below which a saved tensor stays on the device (Megatron's default)."""
    cpu_offloading_activations: bool = True
    """--cpu-offloading-activations / --no-cpu-offloading-activations: offload saved activations."""
    cpu_offloading_weights: bool = False
    """--cpu-offloading-weights: also offload saved tensors that are parameters (frees nothing while the
    parameter stays on the device; counted)."""
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    """--cpu-offloading-retain-pinned-cpu-buffers (Megatron's): keep --cpu-offloading's pinned host buffers when their
    tensors come back and reuse them for later offloads of the same size and dtype (the next micro-batch's, the next
    step's) instead of allocating new ones: what is computed is the same; pinning is slow and the host memory stays
    allocated between steps."""
    params_dtype: torch.dtype = torch.float32
    """Dtype parameters are stored in (fp32 masters are the optimizer's business)."""
    num_experts: int | None = None
    """--num-experts: Mixture-of-Experts layers with this many experts in place of every MLP (None: dense)."""
    moe_router_topk: int = 2
    """--moe-router-topk: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """--moe-ffn-hidden-size: width of each expert's MLP; default --ffn-hidden-size."""
    moe_router_load_balancing_type: list[str] | str = "aux_loss"
    """--moe-router-load-balancing-type: ``aux_loss`` (Switch/GShard load-balancing loss over the micro-batch),
    ``seq_aux_loss`` (DeepSeek-V3's, per sequence, averaged over the sequences) or ``none``; or several (Megatron's
    list form, ``aux_loss seq_aux_loss``): their losses added, each with its own --moe-aux-loss-coeff."""
    moe_aux_loss_coeff: list[float] | float = 0.0
    """--moe-aux-loss-coeff: weight of the load-balancing loss added to the LM loss (one per type when
    --moe-router-load-balancing-type lists several). 0 (Megatron's default) turns it off; 1e-2 is the usual
    setting for training MoE models from scratch."""
    moe_router_pre_softmax: bool = False
    """--moe-router-pre-softmax: softmax over all experts before the top-k (default: over the k picked). With
    sigmoid scores it changes nothing, as in Megatron's ``topk_routing_with_score_function``."""
    moe_router_score_function: str = "softmax"
    """--moe-router-score-function: ``softmax`` or ``sigmoid`` (DeepSeek-V3: sigmoid scores, the k picks
    normalised to sum 1)."""
    moe_router_dtype: str | None = None
    """--moe-router-dtype: ``fp32`` computes the router's logits (so its top-k) and probabilities in float32; unset
    (Megatron's default), in the model's dtype: bf16 logits and probabilities in a --bf16 run. The scores (softmax,
    sigmoid) and load-balancing statistics are float32 either way (float64 in a float64 model); ``fp64`` is refused."""
    moe_z_loss_coeff: float | None = None
    """--moe-z-loss-coeff: weight of the router z-loss ``mean(logsumexp(logits)^2)`` (None or 0: off;
    1e-3 is usual). Added to the LM loss and logged with the load-balancing loss."""
    moe_layer_freq: str | int = 1
    """--moe-layer-freq: which layers are MoE (the rest keep the dense MLP): every N-th layer (1: all),
    or a 0/1 per-layer pattern such as ``([0]+[1]*3)*2`` or ``[1,0,1,0]``."""
    moe_shared_expert_intermediate_size: int | None = None
    """--moe-shared-expert-intermediate-size: width of a dense MLP every token goes through, added to the
    routed output (DeepSeek/Qwen shared experts); tensor-parallel like the dense MLP. None: none."""
    moe_shared_expert_overlap: bool = False
    """--moe-shared-expert-overlap: accepted for Megatron compatibility; the shared expert runs in order
    (no overlap with the dispatch), which gives the same numbers."""
    moe_expert_capacity_factor: float | None = None
    """--moe-expert-capacity-factor: each expert takes at most ceil(F * tokens * topk / num_experts) of a
    micro-batch's tokens, dropping the rest (None or negative, as in Megatron: dropless)."""
    moe_token_drop_policy: str = "probs"
    """--moe-token-drop-policy: which assignments an over-full expert drops: ``probs`` (lowest routing
    probability) or ``position`` (latest in the sequence)."""
    moe_pad_expert_input_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity: every expert processes exactly its capacity (padding rows are
    tokens it was not routed to, weighted 0); needs --moe-expert-capacity-factor."""
    moe_grouped_gemm: bool = False
    """--moe-grouped-gemm: each MLP GEMM of the local experts runs as one grouped GEMM (``torch._grouped_mm``)
    instead of one GEMM per expert (Megatron's SequentialMLP); the same function. Where its preconditions do
    not hold (FP8 experts, float64, widths not 16-byte aligned) the per-expert GEMMs run, said once in the log."""

    moe_router_num_groups: int | None = None
    """--moe-router-num-groups: group-limited routing: the experts form this many equal groups (DeepSeek's
    device/node-limited routing)."""
    moe_router_group_topk: int | None = None
    """--moe-router-group-topk: groups each token may pick experts from (the groups with the largest sums of
    their top-k / group-topk scores); None: no group limit."""
    moe_router_topk_scaling_factor: float | None = None
    """--moe-router-topk-scaling-factor: the routing probabilities are multiplied by this (DeepSeek-V3: 2.5)."""
    moe_router_enable_expert_bias: bool = False
    """--moe-router-enable-expert-bias: auxiliary-loss-free balancing (sigmoid scores): a per-expert bias added
    to the scores for the selection only, moved after each step by the rate against the step's token counts."""
    moe_router_bias_update_rate: float = 1e-3
    """--moe-router-bias-update-rate: the expert bias moves by this times sign(mean count - count) per step."""
    multi_latent_attention: bool = False
    """--multi-latent-attention: DeepSeek-V2/V3 multi-head latent attention (transformer/mla.py) in place of
    the grouped-query attention; RoPE on the --qk-pos-emb-head-dim channels only, whatever
    --position-embedding-type says (as Megatron; but ``yarn``, refused: MLA's YaRN is --rope-type)."""
    q_lora_rank: int | None = None
    """--q-lora-rank: width of the compressed query latent (None: queries projected directly from the hidden)."""
    kv_lora_rank: int = 32
    """--kv-lora-rank: width of the compressed key/value latent."""
    qk_head_dim: int = 128
    """--qk-head-dim: per-head query/key channels without position (the query head is this plus the next)."""
    qk_pos_emb_head_dim: int = 64
    """--qk-pos-emb-head-dim: per-head rotated query/key channels (the key's are shared by the heads)."""
    v_head_dim: int = 128
    """--v-head-dim: per-head value channels."""
    rotary_scaling_factor: float = 1.0
    """--rotary-scaling-factor: YaRN's context extension factor (transformer/yarn.py) of MLA's RoPE, or of the
    grouped-query attention's RoPE under --position-embedding-type yarn (gpt-oss) (1: plain RoPE). As in
    Megatron, ``rope`` without MLA does not read it: that combination is refused, naming ``yarn``."""
    mscale: float = 1.0
    """--mscale: YaRN's mscale (the rotated parts are scaled by m(mscale) / m(mscale_all_dim))."""
    mscale_all_dim: float = 0.0
    """--mscale-all-dim: YaRN's mscale_all_dim (the softmax scale is m(mscale_all_dim)^2 / sqrt(d))."""
    yarn_original_max_position_embeddings: int | None = None
    """--yarn-original-max-position-embeddings: the context YaRN extends (None: 4096, Megatron's MLA default)."""
    yarn_beta_fast: float | None = None
    """--yarn-beta-fast: YaRN's fast correction rotations (None: 32)."""
    yarn_beta_slow: float | None = None
    """--yarn-beta-slow: YaRN's slow correction rotations (None: 1)."""
    yarn_correction_range_round_to_int: bool = True
    """--no-yarn-correction-range-round-to-int: YaRN's ramp ends stay fractional (gpt-oss; HF ``truncate: false``)."""
    window_size: str | None = None
    """--window-size LEFT,RIGHT: sliding-window attention (transformer/window.py): query i attends to keys
    i - LEFT .. i (causal: RIGHT must be 0; -1: unbounded). Hugging Face's sliding_window W is W-1,0."""
    window_attn_skip_freq: str | None = None
    """--window-attn-skip-freq: N: every N-th layer (1-based) keeps full attention, the rest the window
    (gpt-oss: 2); or a 0/1 per-layer list expression, 1 = window. None: every layer has the window."""
    softmax_type: str = "vanilla"
    """--softmax-type: ``vanilla``; ``off-by-one`` (an extra zero logit in each attention softmax) or
    ``learnable`` (gpt-oss's attention sinks: one learned logit per head, ``softmax_offset``)."""
    quick_geglu: bool = False
    """--quick-geglu: the gated MLP (as --swiglu, which it implies) with ``x sigmoid(1.702 x)`` on the gate;
    without --ffn-hidden-size 4 x hidden wide, as Megatron (not --swiglu's two thirds), and on the command line
    refused beside --swiglu, as Megatron asserts."""
    glu_linear_offset: float = 0.0
    """--glu-linear-offset: the gated MLP computes ``act(gate) * (up + offset)`` (gpt-oss: 1)."""
    activation_func_clamp_value: float | None = None
    """--activation-func-clamp-value: the gated MLP clamps the gate to at most C and up to [-C, C] (gpt-oss: 7)."""
    moe_router_bias: bool | None = None
    """A learned bias on the router's logits (:func:`router_bias`). None: Megatron-Core's rule (since 0.15), a
    router bias iff --add-bias-linear; True / False: always / never (gpt-oss's router; a checkpoint written before
    the rule records False)."""
    mtp_num_layers: int | None = None
    """--mtp-num-layers: multi-token prediction depths (DeepSeek-V3; transformer/mtp.py) on the last pipeline
    stage, depth k predicting the token k + 1 ahead (None: none)."""
    mtp_loss_scaling_factor: float = 0.1
    """--mtp-loss-scaling-factor: lambda, the weight of the mean of the depths' losses added to the LM loss."""

    def __post_init__(self) -> None:
        for flag, v in (("--num-layers", self.num_layers), ("--hidden-size", self.hidden_size),
                        ("--num-attention-heads", self.num_attention_heads), ("--seq-length", self.seq_length),
                        ("vocab size", self.vocab_size),
                        ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
        # NOTE: given, these must be positive too: 0 read as "not given" (``x or default``: --num-query-groups 0 ran
        # plain multi-head attention), a negative one failed in the model build (a negative tensor dimension)
        for flag, v in (("--num-query-groups", self.num_query_groups), ("--kv-channels", self.kv_channels),
                        ("--ffn-hidden-size", self.ffn_hidden_size), ("--padded-vocab-size", self.padded_vocab_size)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}; drop it for the default")
        if not self.init_method_std >= 0:  # torch.nn.init.normal_ (Megatron's initialisation) refuses std < 0
            raise ConfigError(f"--init-method-std must be >= 0, got {self.init_method_std}")
        choices = (("--normalization", self.normalization, ("LayerNorm", "RMSNorm")),
                   ("--position-embedding-type", self.position_embedding_type,
                    ("learned_absolute", "rope", "yarn", "none")),
                   ("--recompute-granularity", self.recompute_granularity, (None, "full", "selective")),
                   ("--recompute-method", self.recompute_method, (None, "uniform", "block")))
        for flag, v, ok in choices:
            if v not in ok:
                instead = POSITION_INSTEAD.get(v, "") if flag == "--position-embedding-type" else ""
                raise ConfigError(f"{flag} {v!r} is not one of {', '.join(map(str, ok))}" + instead)
        for flag, p in (("--hidden-dropout", self.hidden_dropout), ("--attention-dropout", self.attention_dropout)):
            if not 0.0 <= p < 1.0:
                raise ConfigError(f"{flag} must be in [0, 1), got {p}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        from omnitron.core.transformer.moe.validate import check_moe_fields

        check_moe_fields(self)
        if self.squared_relu and (self.swiglu or self.quick_geglu):
            raise ConfigError("--squared-relu is the MLP's activation in place of --swiglu / --quick-geglu (Megatron "
                              "refuses both together): drop one")
        if self.quick_geglu:  # Megatron: --quick-geglu sets the gated linear unit
            if not self.swiglu and not self.ffn_hidden_size:  # Megatron's validate_args sizes it without
                self.ffn_hidden_size = 4 * self.hidden_size  # --swiglu: 4h, not the SwiGLU default
            self.swiglu = True
        if self.swiglu and not self.ffn_hidden_size and ffn_size(self) < 1:
            raise ConfigError(f"--swiglu without --ffn-hidden-size takes Megatron's int(4 x {self.hidden_size} x 2/3 "
                              f"/ 64) x 64 = 0 at --hidden-size {self.hidden_size}: give --ffn-hidden-size")
        self._check_window_and_sinks()
        self._check_yarn()
        self._check_glu()

    def _check_glu(self) -> None:
        """Megatron's rules for the gated MLP's offset and clamp (transformer_config.py, mlp.py): both act on the
        gated MLP only (a GeLU or squared-ReLU MLP would halve its fc1 output here and fail in fc2's GEMM); the
        clamped SwiGLU (not quick GeGLU) needs a finite positive clamp, an MoE model and no offset."""
        offset, clamp = self.glu_linear_offset, self.activation_func_clamp_value
        if not (self.swiglu or self.quick_geglu):
            given = (("--glu-linear-offset", offset != 0.0), ("--activation-func-clamp-value", clamp is not None))
            for flag, on in given:
                if on:
                    raise ConfigError(f"{flag} acts on the gated MLP only (Megatron reads it under --swiglu / "
                                      f"--quick-geglu); give one of those, or drop {flag}")
        if clamp is None or self.quick_geglu:
            return
        if not math.isfinite(clamp) or clamp <= 0:
            raise ConfigError(f"--activation-func-clamp-value {clamp:g} for SwiGLU must be finite and above 0 "
                              "(Megatron refuses it): give a positive clamp")
        if not self.num_experts:
            raise ConfigError("--activation-func-clamp-value with --swiglu needs --num-experts (Megatron clamps "
                              "SwiGLU in MoE models only): add --num-experts, or drop the clamp")
        if offset != 0.0:
            raise ConfigError(f"--glu-linear-offset {offset:g} with a clamped --swiglu: Megatron refuses an offset "
                              "beside the SwiGLU clamp (gpt-oss's offset is --quick-geglu's); drop one")

    def _check_yarn(self) -> None:
        """Megatron's spellings of YaRN: ``yarn`` on grouped-query attention; MLA's own (``--rope-type``)."""
        kind, factor = self.position_embedding_type, self.rotary_scaling_factor
        if kind == "yarn" and self.multi_latent_attention:
            raise ConfigError("--position-embedding-type yarn with --multi-latent-attention: MLA's YaRN is "
                              "--rope-type yarn (its default) under --position-embedding-type rope; give that")
        if kind != "yarn" and factor != 1.0 and not self.multi_latent_attention:
            raise ConfigError(f"--rotary-scaling-factor {factor} with --position-embedding-type {kind}: Megatron "
                              f"reads the factor only under --position-embedding-type yarn (its {kind} ignores it); "
                              f"give yarn for YaRN, or drop --rotary-scaling-factor")
        extras = [flag for flag, on in (("--rotary-interleaved", self.rotary_interleaved),
                                        ("--rotary-percent", self.rotary_percent != 1.0),
                                        ("--rope-scaling-factor", self.rope_scaling_factor != 1.0)) if on]
        if kind == "yarn" and extras:
            raise ConfigError(f"--position-embedding-type yarn with {', '.join(extras)}: Megatron's "
                              f"YarnRotaryEmbedding rotates every channel of the head in halves, unscaled by Llama "
                              f"3.1 (it ignores --rotary-percent and --use-rope-scaling, asserts against interleaved "
                              f"pairs); drop {' '.join(extras)}")

    def _check_window_and_sinks(self) -> None:
        """--window-size, --window-attn-skip-freq, --softmax-type by themselves."""
        from omnitron.core.transformer.window import SOFTMAX_TYPES, parse_window, window_layers

        if self.softmax_type not in SOFTMAX_TYPES:
            raise ConfigError(f"--softmax-type {self.softmax_type!r} is not one of {', '.join(SOFTMAX_TYPES)}")
        window = parse_window(self.window_size)
        if window is not None and window[1] not in (0, -1):
            raise ConfigError(f"--window-size {self.window_size}: GPT attention is causal, the right side is 0 "
                              f"(use {window[0]},0)")
        window_layers(self)  # raises on a bad --window-attn-skip-freq


# ---- derived values ------------------------------------------------------------------------
def recompute_layers(c: GPTConfig, num_layers: int) -> list[list[int]]:
    """Local layer indices grouped into recompute chunks (empty: no full recomputation)."""
    if c.recompute_granularity != "full":
        return []
    n = c.recompute_num_layers or 1
    if c.recompute_method == "block":
        return [[i] for i in range(min(n, num_layers))]
    return [list(range(i, min(i + n, num_layers))) for i in range(0, num_layers, n)]


def num_parameters(c: GPTConfig, *, tp: int = 1) -> int:
    """Parameters of the whole model as one process holds it (vocabulary padded for ``tp``)."""
    h, f, d, heads, g = c.hidden_size, ffn_size(c), head_dim(c), c.num_attention_heads, query_groups(c)
    b = 1 if c.add_bias_linear else 0
    norm = h * (2 if c.normalization == "LayerNorm" else 1)
    qkv_out = (heads + 2 * g) * d
    attn = qkv_out * h + (1 if b or c.add_qkv_bias else 0) * qkv_out + heads * d * h + b * h
    if c.qk_layernorm:
        attn += 2 * d * (2 if c.normalization == "LayerNorm" else 1)
    if c.softmax_type == "learnable":
        attn += heads
    if c.multi_latent_attention:
        attn = mla_parameters(c)

    def mlp(width: int) -> int:
        fc1_out = 2 * width if c.swiglu else width
        return fc1_out * h + b * fc1_out + width * h + b * h

    layers = c.num_layers * (attn + 2 * norm + mlp(f))
    last_ffn = mlp(f)  # the last layer's MLP: the kind an MTP depth's layer has
    if c.num_experts:  # MoE layers: E experts at --moe-ffn-hidden-size, the router [E, h], a shared expert
        from omnitron.core.transformer.moe.pattern import moe_layer_pattern

        moe = c.num_experts * (mlp(c.moe_ffn_hidden_size or f) + h + (1 if router_bias(c) else 0))
        if c.moe_shared_expert_intermediate_size:
            moe += mlp(c.moe_shared_expert_intermediate_size)
        pattern = moe_layer_pattern(c.moe_layer_freq, c.num_layers)
        layers += sum(pattern) * (moe - mlp(f))
        last_ffn = moe if pattern[-1] else last_ffn
    if c.mtp_num_layers:  # per depth: enorm, hnorm, eh_proj [h, 2h], one layer, its final norm
        layers += c.mtp_num_layers * (3 * norm + 2 * h * h + attn + 2 * norm + last_ffn)
    v = padded_vocab_size(c, tp)
    total = layers + norm + v * h
    if c.position_embedding_type == "learned_absolute":
        total += max_positions(c) * h
    if c.untie_embeddings_and_output_weights:
        total += v * h
    return total


def mla_parameters(c: GPTConfig) -> int:
    """Parameters of one multi-latent attention module (transformer/mla.py)."""
    h, n, qr, kvr = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
    dq, norm = c.qk_head_dim + c.qk_pos_emb_head_dim, (2 if c.normalization == "LayerNorm" else 1)
    q = h * n * dq if qr is None else h * qr + qr * n * dq + (qr * norm if c.qk_layernorm else 0)
    kv = h * (kvr + c.qk_pos_emb_head_dim) + kvr * n * (c.qk_head_dim + c.v_head_dim)
    kv += kvr * norm if c.qk_layernorm else 0
    return q + kv + n * c.v_head_dim * h + (h if c.add_bias_linear else 0)


def flops_per_iteration(c: GPTConfig, batch_size: int, seq_length: int | None = None, causal: bool = False,
                        tp: int = 1) -> float:
    """Training FLOPs (forward + backward) for ``batch_size`` sequences, the vocabulary padded for tensor-parallel
    size ``tp`` (Megatron's ``padded_vocab_size``; the training log pads for the run's), Megatron's formula:
    GEMMs of attention and MLP, attention scores non-causal (``causal=True`` halves that term),
    logits counted. ``12 B s L h^2 (attn + mlp + logits)``. MoE, multi-latent-attention and MTP models take
    Megatron's current formula (:func:`omnitron.core.models.gpt.flops.megatron_flops`: routed experts, MLA's
    projections, the MTP depths; causal core attention, as Megatron counts it now). The planner's count; the
    training log takes ``megatron_flops`` for every model, as Megatron's log does."""
    s = seq_length or c.seq_length
    if c.num_experts or c.multi_latent_attention or c.mtp_num_layers:
        from omnitron.core.models.gpt.flops import megatron_flops

        return megatron_flops(c, batch_size, s, tp=tp)
    h, L = c.hidden_size, c.num_layers
    q_ratio = head_dim(c) * c.num_attention_heads / h
    score = s / h / (2.0 if causal else 1.0)
    attn = (1.0 + query_groups(c) / c.num_attention_heads + score) * q_ratio
    mlp = ffn_size(c) / h * (1.5 if c.swiglu else 1.0)
    logits = padded_vocab_size(c, tp) / (2.0 * L * h)
    return 12.0 * batch_size * s * L * h * h * (attn + mlp + logits)


POSITION_INSTEAD = {
    "mrope": ": Megatron's multimodal RoPE (Qwen2-VL's, split in mrope sections) is not implemented; use rope",
    "relative": ": Megatron's relative position buckets (T5's --relative-attention-num-buckets) are not implemented; "
                "use learned_absolute",
}
"""Megatron's other --position-embedding-type choices: what to give instead, appended to the refusal."""


def router_bias(c) -> bool:
    """Whether an MoE router has a bias on its logits: ``moe_router_bias``, or when None, --add-bias-linear
    (Megatron-Core's TopKRouter holds ``bias [E]`` exactly when ``add_bias_linear``)."""
    own = getattr(c, "moe_router_bias", False)
    return bool(c.add_bias_linear) if own is None else bool(own)


def rope_inv_freq(c: GPTConfig) -> torch.Tensor:
    """Inverse frequencies ``[r/2]`` for the rotated channels, with Llama-3.1 scaling when enabled, YaRN's under
    --position-embedding-type yarn (multi-latent attention: YaRN's over --qk-pos-emb-head-dim whatever the type,
    :mod:`omnitron.core.transformer.yarn`)."""
    if c.multi_latent_attention:
        return yarn_inv_freq(c)
    rot = int(head_dim(c) * c.rotary_percent)
    rot -= rot % 2
    if c.position_embedding_type == "yarn":  # every channel (GPTConfig refuses --rotary-percent with it)
        return yarn_inv_freq(c, rot)
    inv = 1.0 / (c.rotary_base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if c.rope_scaling_factor != 1.0:
        low, high, orig = 1.0, 4.0, 8192  # Llama-3.1 constants
        wavelen = 2 * math.pi / inv
        smooth = ((orig / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > orig / low, inv / c.rope_scaling_factor, inv)
        mid = (wavelen <= orig / low) & (wavelen >= orig / high)
        inv = torch.where(mid, (1 - smooth) * inv / c.rope_scaling_factor + smooth * inv, scaled)
    return inv.float()
