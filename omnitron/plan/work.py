"""The work of one micro-batch at a layout's local shapes: GEMMs, attention FLOPs, bytes each parallelism moves.

Pure functions of the model config and the layout (no rates): the speed model (:mod:`omnitron.plan.speed`)
prices them with a bench report, and tests check them against FLOPs counted on a real forward + backward
(``torch.utils.flop_counter``) and bytes handed to the collectives of a real tensor-parallel run.

Shapes per rank (``T = b s / cp`` tokens of a micro-batch, widths divided by ``tp``):

=========== ================================ ==========================================
GEMM        ``[m, k] @ [k, n]``              note
=========== ================================ ==========================================
qkv         ``T x h @ h x (a + 2 g) d / tp``  ``a`` heads, ``g`` query groups, ``d`` head dim
proj        ``T x a d / tp @ a d / tp x h``
fc1         ``T x h @ h x f' / tp``            ``f' = 2 f`` with SwiGLU
fc2         ``T x f / tp @ f / tp x h``
logits      ``T x h @ h x V_pad / tp``         the last stage only
=========== ================================ ==========================================

Attention (core: ``Q K^T`` and ``P V``): ``4 b (a / tp) s^2 d / 2 / cp`` FLOPs forward (causal halves the
score matrix; context parallelism splits it evenly: the ring's load-balanced chunks). Backward is twice
each forward GEMM (input and weight gradients), so forward + backward = 3 x forward.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.models.gpt.config import ffn_size, head_dim, padded_vocab_size, query_groups


@dataclass(frozen=True)
class Local:
    """The rank-local sizes of one micro-batch: tokens, widths after the tensor-parallel split."""

    tokens: int
    seq: int
    batch: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    fc1: int
    vocab: int
    tp: int
    cp: int


def local_shapes(cfg, tp: int, cp: int, micro_batch: int) -> Local:
    a, g, f = cfg.num_attention_heads, query_groups(cfg), ffn_size(cfg)
    return Local(tokens=micro_batch * cfg.seq_length // cp, seq=cfg.seq_length, batch=micro_batch,
                 hidden=cfg.hidden_size, heads=a // tp, groups=max(1, g // tp), head_dim=head_dim(cfg), ffn=f // tp,
                 fc1=(2 * f if cfg.swiglu else f) // tp, vocab=padded_vocab_size(cfg, tp) // tp, tp=tp, cp=cp)


def layer_gemms(x: Local) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one layer's forward GEMMs on one rank."""
    d = x.head_dim
    return [("qkv", x.tokens, (x.heads + 2 * x.groups) * d, x.hidden), ("proj", x.tokens, x.hidden, x.heads * d),
            ("fc1", x.tokens, x.fc1, x.hidden), ("fc2", x.tokens, x.hidden, x.ffn)]


def head_gemm(x: Local) -> tuple[str, int, int, int]:
    return ("logits", x.tokens, x.vocab, x.hidden)


def gemm_flops(gemms) -> float:
    return float(sum(2 * m * n * k for _, m, n, k in gemms))


def attention_flops(x: Local) -> float:
    """Forward FLOPs of one layer's core attention on one rank (causal, split over cp)."""
    return 4.0 * x.batch * x.heads * x.seq * x.seq * x.head_dim * 0.5 / x.cp


# ---- bytes moved per micro-batch --------------------------------------------------------------------
def tp_collectives(x: Local, elem: int, sp: bool,
                   regather: bool = True) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) (op, bytes) of one layer's tensor-parallel collectives per micro-batch, each the
    attention's half, then the MLP's.

    Without SP: the row-parallel outputs (attention proj, fc2) are all-reduced forward and the
    column-parallel inputs' gradients backward: 2 + 2 all-reduces of ``[T, h]``. With SP each all-reduce is an
    all-gather (the column-parallel input, forward; the row-parallel output's gradient, backward) and a
    reduce-scatter; and a column-parallel linear on the plain GEMM path (``regather``; not an FP8 one, which
    saves its own copy of the gathered input) all-gathers its saved input shard again in backward for its weight
    gradient (:mod:`omnitron.core.parallel.tensor.gather_linear`, as Megatron-LM; since 2026-12-05): per half
    forward 1 + 1, backward 1 + 1 (+ 1), each of the full ``[T, h]``."""
    if x.tp == 1:
        return [], []
    full = x.tokens * x.hidden * elem
    if not sp:
        return [("all_reduce", full)] * 2, [("all_reduce", full)] * 2
    back = [("all_gather", full), ("reduce_scatter", full)] + [("all_gather", full)] * regather
    return [("all_gather", full), ("reduce_scatter", full)] * 2, back * 2


def stage_tp_collectives(cfg, x: Local, elem: int, sp: bool, layers: int, first: bool,
                         last: bool, regather: bool = True) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) (op, bytes) of a stage's tensor-parallel collectives per micro-batch: its layers'
    (:func:`tp_collectives`; ``regather``: their column-parallel linears on the plain GEMM path), the first
    stage's vocabulary-parallel embedding (all-reduce; under SP a reduce-scatter, all-gathered backward, and the
    learned positions' split, all-gathered backward), the last stage's output layer (its input's gradient
    all-reduced; under SP gathered forward, reduce-scattered backward and its input re-gathered) and the
    vocabulary-parallel cross-entropy's fp32 all-reduces of ``[T]`` (max) and ``[2, T]`` (sum of exponentials,
    target logit)."""
    if x.tp == 1:
        return [], []
    f, b = tp_collectives(x, elem, sp, regather)
    fwd, bwd = f * layers, b * layers
    for end, on in ((first_stage_tp(cfg, x, elem, sp), first), (last_stage_tp(x, elem, sp), last)):
        if on:
            fwd, bwd = fwd + end[0], bwd + end[1]
    return fwd, bwd


def first_stage_tp(cfg, x: Local, elem: int, sp: bool) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) tensor-parallel collectives of the first stage's vocabulary-parallel embedding."""
    if x.tp == 1:
        return [], []
    full = x.tokens * x.hidden * elem
    bwd = [("all_gather", full)] * (2 if cfg.position_embedding_type == "learned_absolute" else 1) if sp else []
    return [("reduce_scatter" if sp else "all_reduce", full)], bwd


def last_stage_tp(x: Local, elem: int, sp: bool) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) tensor-parallel collectives of the last stage's output layer and cross-entropy."""
    if x.tp == 1:
        return [], []
    full = x.tokens * x.hidden * elem
    fwd = ([("all_gather", full)] if sp else []) + [("all_reduce", 4 * x.tokens), ("all_reduce", 8 * x.tokens)]
    # under SP the output layer (never FP8) reduce-scatters its input's gradient and re-gathers its input shard
    return fwd, [("reduce_scatter", full), ("all_gather", full)] if sp else [("all_reduce", full)]


def cp_ring(x: Local, elem: int) -> tuple[list[int], list[int]]:
    """(forward, backward) bytes of each hop of one layer's ring attention: ``cp - 1`` key/value exchanges
    forward; backward ``cp - 1`` key/value and ``cp`` key/value-gradient exchanges (the last takes each block
    home). A hop carries K and V, ``2 b (g / tp) (s / cp) d`` elements; the gradients circulate in the ring's
    float32 accumulators (float64 with a float64 model: ``ring.py``'s ``promote_types(dtype, float32)``)."""
    if x.cp == 1:
        return [], []
    n = 2 * x.batch * x.groups * (x.seq // x.cp) * x.head_dim
    return [n * elem] * (x.cp - 1), [n * elem] * (x.cp - 1) + [n * max(elem, 4)] * x.cp


def cp_blocks(x: Local) -> list[tuple[float, bool]]:
    """(FLOPs forward + backward in the bench's count, causal) of each ring step's block on the busiest rank:
    step 0 is the rank's own causal block (``s / cp`` query and key rows); each later step a full block of all
    its query rows against half of the visiting keys (or half its rows against all: the same size)."""
    q = x.seq // x.cp
    full = 3 * 4.0 * x.batch * x.heads * q * q * x.head_dim
    return [(full * 0.5, True)] + [(full * 0.5, False)] * (x.cp - 1)


def cp_ring_elementwise(x: Local) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(forward, backward) element-wise work of one layer's ring attention beyond its block kernels: the merge of
    each later step's partial result into the output (``ring_merge`` over ``[b, a/tp, s/cp, d]``); backward, per
    step, the query-gradient accumulation and the circulating key/value gradient's zeroing, fill and
    accumulation (``add`` over ``[b, a/tp, s/cp, d]`` and 3 x ``[2, b, g/tp, s/cp, d]``)."""
    if x.cp == 1:
        return [], []
    q = x.batch * x.heads * (x.seq // x.cp) * x.head_dim
    kv = 2 * x.batch * x.groups * (x.seq // x.cp) * x.head_dim
    return [("ring_merge", q)] * (x.cp - 1), ([("add", q)] + [("add", kv)] * 3) * x.cp


def pp_message(x: Local, elem: int, sp: bool) -> int:
    """Bytes of the activation (forward) or its gradient (backward) sent between two stages: ``[s/cp, b, h]``
    (split over tp under SP)."""
    return x.tokens * x.hidden * elem // (x.tp if sp else 1)


def layer_params(cfg, tp: int) -> float:
    """Parameters of one Transformer layer on one tp rank (norms and row-parallel biases replicated)."""
    h, f, d = cfg.hidden_size, ffn_size(cfg), head_dim(cfg)
    a, g = cfg.num_attention_heads, query_groups(cfg)
    bias = 1 if cfg.add_bias_linear else 0
    norm = h * (2 if cfg.normalization == "LayerNorm" else 1)
    fc1 = 2 * f if cfg.swiglu else f
    split = fc1 * (h + bias) + f * h
    return split / tp + attention_params(cfg, tp) + 2 * norm + bias * h


def attention_params(cfg, tp: int) -> float:
    """Parameters of one layer's attention on one tp rank (its output bias, replicated, included). Multi-latent
    attention: the down-projections and latent norms replicated, the up-projections and output split over tp."""
    h, d, a, g = cfg.hidden_size, head_dim(cfg), cfg.num_attention_heads, query_groups(cfg)
    bias = 1 if cfg.add_bias_linear else 0
    norm = 2 if cfg.normalization == "LayerNorm" else 1
    if getattr(cfg, "multi_latent_attention", False):
        n, qr, kvr, rope = a, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
        dq, qk_norm = cfg.qk_head_dim + rope, (norm if cfg.qk_layernorm else 0)
        split = (h * n * dq if qr is None else qr * n * dq) + kvr * n * (cfg.qk_head_dim + cfg.v_head_dim) \
            + n * cfg.v_head_dim * h
        whole = (0 if qr is None else h * qr + qr * qk_norm) + h * (kvr + rope) + kvr * qk_norm
        return split / tp + whole + bias * h
    qkv_bias = 1 if bias or getattr(cfg, "add_qkv_bias", False) else 0  # --add-qkv-bias: linear_qkv's only
    split = (a + 2 * g) * d * (h + qkv_bias) + a * d * h + (a if cfg.softmax_type == "learnable" else 0)
    return split / tp + bias * h + (2 * d * norm if cfg.qk_layernorm else 0)


# ---- element-wise work per micro-batch ---------------------------------------------------------------
def layer_elementwise(cfg, x: Local, sp: bool, attention_dropout: bool = True) -> list[tuple[str, int]]:
    """(op, elements) of one layer's element-wise forward ops on one rank (each has a backward of the same size):
    two norms, two residual adds and (with ``--hidden-dropout``) two dropouts on the ``[T, h]`` stream (its
    ``1 / tp`` shard under SP), the MLP activation on ``[T, f / tp]``, and with ``--attention-dropout`` the
    dropout of the ``[b, a / tp, s / cp, s]`` attention probabilities (the score path itself is priced by
    the attention rows)."""
    stream = x.tokens * x.hidden // (x.tp if sp else 1)
    norm = "rms_norm" if cfg.normalization == "RMSNorm" else "layer_norm"
    ops = [(norm, stream), (norm, stream), ("add", stream), ("add", stream)]
    if cfg.hidden_dropout > 0:
        ops += [("dropout", stream), ("dropout", stream)]
    ops.append(("silu_mul" if cfg.swiglu else "gelu", x.tokens * x.ffn))
    if cfg.attention_dropout > 0 and attention_dropout:  # (False: ring attention's blocks draw their own)
        ops.append(("dropout", attention_dropout_elements(cfg, x)))
    return ops


def bias_passes(cfg, x: Local, gemms) -> list[tuple[str, int]]:
    """(op, elements) of the linear biases of ``gemms`` (``(name, m, n, k)``; ``--add-bias-linear``), priced as
    add passes: forward, the GEMM's output gets the bias (addmm: one more pass over ``[m, n]``); backward, the
    bias gradient sums the output gradient's rows (one more pass). Row-parallel biases (proj, fc2) are added
    once, after the reduction, on every rank. ``--add-qkv-bias`` alone: the qkv GEMM's only."""
    if not cfg.add_bias_linear:
        gemms = [g for g in gemms if g[0] == "qkv"] if getattr(cfg, "add_qkv_bias", False) else []
    return [("add", m * n) for _, m, n, _ in gemms]


def qkv_split_backward(x: Local) -> list[tuple[str, int]]:
    """(op, elements) of the backward of one layer's q / k / v split, priced at the forward rate of the op named:
    autograd writes each piece's gradient into a zeroed tensor of the whole ``[T, (a + 2 g) d / tp]`` (select /
    slice backward: a fill and a copy, about one third of an add pass each) and sums the three (two add passes),
    about three add passes over the qkv elements in all."""
    return [("add", 3 * x.tokens * (x.heads + 2 * x.groups) * x.head_dim)]


def attention_dropout_elements(cfg, x: Local) -> int:
    """Elements of one layer's attention-probability dropout: ``[b, a / tp, s / cp, s]``."""
    return x.batch * x.heads * (x.seq // x.cp) * x.seq


def embedding_elementwise(cfg, x: Local, sp: bool) -> list[tuple[str, int]]:
    """The first stage's: the position add (learned positions) and the embedding dropout."""
    stream = x.tokens * x.hidden // (x.tp if sp else 1)
    ops = [("add", stream)] if cfg.position_embedding_type == "learned_absolute" else []
    return ops + ([("dropout", stream)] if cfg.hidden_dropout > 0 else [])


def head_elementwise(cfg, x: Local, sp: bool) -> list[tuple[str, int]]:
    """The last stage's: the final norm and the cross-entropy over the rank's ``[T, V_pad / tp]`` logits."""
    stream = x.tokens * x.hidden // (x.tp if sp else 1)
    return [("rms_norm" if cfg.normalization == "RMSNorm" else "layer_norm", stream),
            ("cross_entropy", x.tokens * x.vocab)]
