"""Validation of a GPT model config against the parallel layout (validate_model), and the derived values the
checks read (max_positions, offload_layers, uses_rope).

Kept apart from config.py (which re-exports every name here) so that file holds the config's fields and the
accounting. This module imports nothing from config.py (config.py imports it): ``c`` is any GPTConfig, or a
config built on its fields (BERT's, T5's).
"""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.transformer.shapes import ffn_size, query_groups


def max_positions(c) -> int:
    return c.max_position_embeddings or c.seq_length


def offload_layers(c) -> int:
    """How many leading layers offload their saved tensors (0: offloading off)."""
    return c.cpu_offloading_num_layers if (c.cpu_offloading or c.cpu_offloading_num_layers) else 0


def _validate_offloading(c, parallel: ParallelConfig) -> None:
    """Megatron's limits on --cpu-offloading (transformer_config.py), each with its fix."""
    n = c.cpu_offloading_num_layers
    if not (c.cpu_offloading or n):
        if getattr(c, "cpu_offloading_retain_pinned_cpu_buffers", False):
            raise ConfigError("--cpu-offloading-retain-pinned-cpu-buffers keeps --cpu-offloading's host buffers "
                              "between steps; it needs --cpu-offloading-num-layers N (or drop it)")
        return
    if not 0 < n < c.num_layers:
        raise ConfigError(f"--cpu-offloading-num-layers {n}: offload between 1 and --num-layers - 1 "
                          f"({c.num_layers - 1}) layers (the last layer's backward comes first: it stays)")
    if not (c.cpu_offloading_activations or c.cpu_offloading_weights):
        raise ConfigError("--cpu-offloading with --no-cpu-offloading-activations and no --cpu-offloading-weights "
                          "offloads nothing; drop one of them")
    if parallel.pipeline_model_parallel_size > 1:  # each chunk offloads its own first n layers
        from omnitron.core.parallel.pipeline.layout import config_layer_ranges

        fewest = min(k for _, k in config_layer_ranges(c.num_layers, parallel).values())
        if fewest == 0:
            raise ConfigError(f"--cpu-offloading-num-layers {n}: a pipeline chunk holds no layer (the embedding or "
                              f"the loss alone under --account-for-embedding/loss-in-pipeline-split); every chunk "
                              f"needs n + 1 layers: lower the virtual pipeline size or drop --cpu-offloading")
        if n >= fewest:
            raise ConfigError(f"--cpu-offloading-num-layers {n} with pipeline parallelism offloads the first {n} "
                              f"layers of every pipeline chunk, but a chunk holds {fewest}; offload at most "
                              f"{fewest - 1} (a chunk's last layer stays: its backward comes first)")
    if c.recompute_granularity is not None:
        raise ConfigError("--cpu-offloading with --recompute-granularity: recomputed layers save nothing to offload "
                          "(Megatron refuses the pair too); choose one")


def _validate_fine_grained(c) -> None:
    """Megatron's limits on --fine-grained-activation-offloading, and the modules omnitron maps."""
    from omnitron.core.transformer.offload_modules import MODULES, REFUSED

    if not c.fine_grained_activation_offloading:
        if c.offload_modules:
            raise ConfigError("--offload-modules needs --fine-grained-activation-offloading")
        return
    if offload_layers(c):
        raise ConfigError("--fine-grained-activation-offloading cannot be combined with --cpu-offloading (nor in "
                          "Megatron); choose one")
    if not c.offload_modules:
        raise ConfigError(f"--fine-grained-activation-offloading needs --offload-modules (of {', '.join(MODULES)})")
    for name in c.offload_modules:
        if name in REFUSED:
            raise ConfigError(f"--offload-modules {name} is not supported: {REFUSED[name]}; use "
                              f"{', '.join(MODULES)}")
        if name not in MODULES:
            raise ConfigError(f"--offload-modules {name!r} unknown; choose from {', '.join(MODULES)}")
    if c.multi_latent_attention and "qkv_linear" in c.offload_modules:
        raise ConfigError("--offload-modules qkv_linear: --multi-latent-attention's layers have no QKV linear (their "
                          "queries, keys and values come from low-rank projections); drop qkv_linear")
    if c.min_offloaded_tensor_size < 0:
        raise ConfigError(f"--min-offloaded-tensor-size must be >= 0, got {c.min_offloaded_tensor_size}")
    if c.recompute_granularity == "full":
        raise ConfigError("--fine-grained-activation-offloading with --recompute-granularity full: recomputed "
                          "layers save nothing to offload; choose one")


def _validate_moe_overlap(c, parallel: ParallelConfig) -> None:
    """Where --overlap-moe-expert-parallel-comm runs (Megatron's limits; the schedules: pipeline/combined.py)."""
    if not getattr(parallel, "overlap_moe_expert_parallel_comm", False):
        return
    flag = "--overlap-moe-expert-parallel-comm"
    if not c.num_experts or parallel.expert_model_parallel_size < 2:
        raise ConfigError(f"{flag} overlaps expert-parallel all-to-alls: it needs --num-experts and "
                          f"--expert-model-parallel-size >= 2")
    if c.recompute_granularity == "full" or offload_layers(c):
        raise ConfigError(f"{flag} with --recompute-granularity full or --cpu-offloading is not supported (Megatron "
                          f"refuses full recomputation with it too; selective recomputation runs); drop one")
    if getattr(c, "moe_shared_expert_overlap", False):
        raise ConfigError(f"{flag} with --moe-shared-expert-overlap: Megatron refuses the pair; drop "
                          f"--moe-shared-expert-overlap (here it changes nothing: the shared expert runs in order)")
    if (getattr(c, "mtp_num_layers", None) or 0) > 1:
        raise ConfigError(f"{flag} with --mtp-num-layers {c.mtp_num_layers}: Megatron overlaps at most one MTP layer; "
                          f"use --mtp-num-layers 1 or drop the flag")


def validate_model(c, parallel: ParallelConfig, *, check_layers: bool = True) -> None:
    """Check the model against the parallel layout; raise ConfigError naming the flag and the fix.

    ``check_layers=False`` skips the even split of layers over pipeline stages (uneven placements
    are checked by the pipeline layer-placement code)."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    heads, groups = c.num_attention_heads, query_groups(c)
    if c.mtp_num_layers is not None:
        _validate_mtp(c)
    if c.multi_latent_attention:
        _validate_mla(c)
    if (c.window_size is not None or c.softmax_type != "vanilla") and c.multi_latent_attention:
        raise ConfigError("--window-size / --softmax-type run with grouped-query attention only, yet; drop them "
                          "or --multi-latent-attention")
    elif c.kv_channels is None and c.hidden_size % heads:
        raise ConfigError(f"--hidden-size {c.hidden_size} is not divisible by --num-attention-heads {heads}; "
                          f"change one of them or set --kv-channels")
    if heads % groups:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    if heads % tp:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                          f"use a tensor-parallel size that divides {heads}")
    if groups % tp and tp % groups:
        raise ConfigError(f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} do not divide one "
                          f"another: key/value heads are either split over tp (groups a multiple of tp) or "
                          f"replicated (tp a multiple of groups); change one of them")
    if ffn_size(c) % tp:
        raise ConfigError(f"--ffn-hidden-size {ffn_size(c)} is not divisible by --tensor-model-parallel-size {tp}")
    _validate_offloading(c, parallel)
    _validate_fine_grained(c)
    _validate_moe_overlap(c, parallel)
    cp = parallel.context_parallel_size
    if cp > 1:
        _validate_context_parallel(c, cp, tp, parallel.sequence_parallel, getattr(parallel, "cp_comm_type", "p2p"),
                                   getattr(parallel, "hierarchical_context_parallel_sizes", None))
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    if check_layers and c.num_layers % (pp * vp):
        raise ConfigError(f"--num-layers {c.num_layers} is not divisible by --pipeline-model-parallel-size {pp} x "
                          f"virtual stages {vp}; change --num-layers or the pipeline sizes")
    if parallel.sequence_parallel and cp == 1 and c.seq_length % tp:
        raise ConfigError(f"--seq-length {c.seq_length} is not divisible by --tensor-model-parallel-size {tp}, "
                          f"which --sequence-parallel requires; change --seq-length or drop --sequence-parallel")
    if c.position_embedding_type == "learned_absolute" and c.seq_length > max_positions(c):
        raise ConfigError(f"--seq-length {c.seq_length} exceeds --max-position-embeddings {max_positions(c)}")
    if c.recompute_granularity == "full" and c.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if c.recompute_method is not None and c.recompute_granularity != "full":
        raise ConfigError(f"--recompute-method {c.recompute_method} only applies with --recompute-granularity full")
    _validate_recompute_num_layers(c)
    if c.window_attn_skip_freq is not None and c.window_size is None:  # parsed as Megatron's parser types it
        from types import SimpleNamespace

        from omnitron.core.transformer.window import window_layers

        window_layers(SimpleNamespace(window_size="0,0", window_attn_skip_freq=c.window_attn_skip_freq,
                                      num_layers=c.num_layers))
    from omnitron.core.transformer.moe.validate import validate_moe

    validate_moe(c, parallel)


def _validate_recompute_num_layers(c) -> None:
    """--recompute-num-layers as Megatron's TransformerConfig takes it: a count of layers under full
    recomputation (below 1 Megatron's uniform method loops forever; here 0 was taken as 1 and a negative count
    recomputed nothing, silently), none under selective (Megatron refuses it there)."""
    n = c.recompute_num_layers
    if n is None or c.recompute_granularity is None:
        return
    if c.recompute_granularity == "selective":
        raise ConfigError(f"--recompute-num-layers {n} applies to --recompute-granularity full only (Megatron "
                          f"refuses it with selective); drop it")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"--recompute-num-layers must be a positive integer (layers per recompute chunk, or "
                          f"recomputed per stage), got {n!r}")


def _validate_mtp(c) -> None:
    """Multi-token prediction's settings, and what it does not combine with (yet)."""
    if not isinstance(c.mtp_num_layers, int) or c.mtp_num_layers < 1:
        raise ConfigError(f"--mtp-num-layers must be a positive integer, got {c.mtp_num_layers!r}")
    if c.mtp_loss_scaling_factor < 0:
        raise ConfigError(f"--mtp-loss-scaling-factor must be >= 0, got {c.mtp_loss_scaling_factor}")
    if not uses_rope(c):
        raise ConfigError("--mtp-num-layers needs rotary positions (--position-embedding-type rope or "
                          "--multi-latent-attention): the MTP modules embed the shifted tokens without learned "
                          "position embeddings")


def _validate_mla(c) -> None:
    """Multi-latent attention's sizes, and the features it does not combine with (yet)."""
    for flag, v in (("--kv-lora-rank", c.kv_lora_rank), ("--qk-head-dim", c.qk_head_dim),
                    ("--qk-pos-emb-head-dim", c.qk_pos_emb_head_dim), ("--v-head-dim", c.v_head_dim),
                    ("--q-lora-rank", 1 if c.q_lora_rank is None else c.q_lora_rank)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{flag} must be a positive integer with --multi-latent-attention, got {v!r}")
    if c.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim {c.qk_pos_emb_head_dim} must be even (RoPE rotates channel pairs)")
    if c.add_qkv_bias:
        raise ConfigError("--add-qkv-bias biases the grouped-query attention's linear_qkv; Megatron's "
                          "--multi-latent-attention has no such bias: drop one of them")
    if c.num_query_groups is not None:
        raise ConfigError("--num-query-groups (grouped-query attention) and --multi-latent-attention exclude each "
                          "other, as in Megatron; drop one of them")
    if c.rotary_interleaved:
        raise ConfigError("--rotary-interleaved with --multi-latent-attention: MLA always rotates its "
                          "--qk-pos-emb-head-dim channels as interleaved pairs (DeepSeek's layout; Megatron would "
                          "apply the flag on top and no longer rotate); drop --rotary-interleaved")
    if c.rotary_percent != 1.0:
        raise ConfigError(f"--rotary-percent {c.rotary_percent}: multi-latent attention rotates all of its "
                          "--qk-pos-emb-head-dim channels (YaRN); drop --rotary-percent")
    if c.rotary_scaling_factor < 1.0:
        raise ConfigError(f"--rotary-scaling-factor must be >= 1 (YaRN extends the context), got "
                          f"{c.rotary_scaling_factor}")


def _validate_context_parallel(c, cp: int, tp: int, sequence_parallel: bool, comm="p2p",
                               sizes: list[int] | None = None) -> None:
    """The sequence splits into 2 x cp load-balanced chunks (and each rank's slice over tp under SP); a2a
    splits each tensor-parallel rank's heads over cp, a2a+p2p over its a2a size; a per-layer --cp-comm-type
    list has one type per layer (Megatron's rule)."""
    types = [comm] if isinstance(comm, str) else list(comm)
    if len(types) > 1 and len(types) != c.num_layers:
        raise ConfigError(f"--cp-comm-type gives {len(types)} types for --num-layers {c.num_layers}: give one type "
                          "for every layer, or one per layer")
    if len(types) > 1 and (c.mtp_num_layers or 0) > len(types):  # MTP depth k takes the k-th type (Megatron's)
        raise ConfigError(f"--mtp-num-layers {c.mtp_num_layers} with a per-layer --cp-comm-type of {len(types)} "
                          "types: depth k takes the k-th type; give one type for every layer")
    if "a2a+p2p" in types and sizes and (c.num_attention_heads // tp) % sizes[0]:
        raise ConfigError(f"--cp-comm-type a2a+p2p splits each tensor-parallel rank's {c.num_attention_heads // tp} "
                          f"attention heads over the a2a size {sizes[0]} (--hierarchical-context-parallel-sizes "
                          f"{sizes[0]} {sizes[1]}): they must be a multiple of it; use a smaller a2a size or "
                          "--cp-comm-type p2p")
    if "a2a" in types and (c.num_attention_heads // tp) % cp:
        raise ConfigError(f"--cp-comm-type a2a splits each tensor-parallel rank's {c.num_attention_heads // tp} "
                          f"attention heads over --context-parallel-size {cp}: they must be a multiple of it; "
                          "use --cp-comm-type p2p or allgather, or change the sizes")
    if c.seq_length % (2 * cp):
        raise ConfigError(f"--seq-length {c.seq_length} is not divisible by 2 x --context-parallel-size {cp} = "
                          f"{2 * cp} (each context-parallel rank holds two equal chunks of the sequence); change "
                          f"--seq-length to a multiple of {2 * cp} or --context-parallel-size")
    if sequence_parallel and (c.seq_length // cp) % tp:
        raise ConfigError(f"--seq-length {c.seq_length} / --context-parallel-size {cp} = {c.seq_length // cp} is not "
                          f"divisible by --tensor-model-parallel-size {tp}, which --sequence-parallel requires; "
                          f"change --seq-length or drop --sequence-parallel")


def uses_rope(c) -> bool:
    """Rotary angles are needed: ``--position-embedding-type rope`` or ``yarn``, or multi-latent attention (its
    decoupled RoPE, whatever the position embedding type)."""
    return c.position_embedding_type in ("rope", "yarn") or c.multi_latent_attention
