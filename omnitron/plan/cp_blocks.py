"""Memory of attention dropout under context parallelism: the block path's transient, nothing score-sized saved.

With ``--attention-dropout`` and cp > 1 the engine runs attention on its block kernels (the p2p ring, a2a, the
all-gather's blocks, a2a+p2p: :mod:`omnitron.core.transformer.cp_attention`) with the counter-based hash mask
(:mod:`omnitron.kernels.hash_dropout`): a block keeps only its output and log-sum-exp, and the mask is drawn
again in backward, so no ``[b, heads, s, s]`` scores and no 1-byte mask per score are saved (what the one-process
layer with dropout saves, and the activation and transient probes measure). So the plan probes such a layer
WITHOUT attention dropout (:func:`priced_config`: the saved tensors of the fused path, ``q, k, v``, the output and
the log-sum-exp) and adds the block kernel's own peak (:func:`block_dropout_bytes`): the chunked reference block
that takes the hash mask (:mod:`omnitron.kernels.reference.attention_block`) holds ``ROW_CHUNK = 256`` query rows
against the block's keys at a time, fp32 scores, probabilities, their gradient, the multiplier and the hash's
int32 words, ``O(256 x s/cp)`` per head; its peak is replayed from the kernel itself run on ``meta`` tensors at
the real shape under the storage log (:class:`omnitron.kernels.alloc_log.Timeline`: exact for the kernel's own
allocations, no arithmetic, well under a second at s 8192). It is added to the stage's transient term: it is
live while one layer's core attention runs, on top of what the probe's peak holds (an upper bound where the
probe's peak falls elsewhere, in the logits' backward; but the ring's own buffers, its fp32 accumulators and
exchanged blocks, are not modelled at all, and the sum covers them). Measured against cp2 training steps
(4 layers, h 128, 2026-12-04): p2p s 256 / 1024 / 2048 +8.4% / +4.0% / -1.6%, a2a s 1024 +12.3%, allgather
-8.2%. Placing the chunk at the probe's attention calls instead (what is live there plus the chunk) gave -9.8% /
-8.9% / -13.5%, a2a -1.4%, allgather -18.7%: the ring's buffers then go missing.

On an accelerator backend (``--backend`` other than cpu, sim or auto) the blocks run the fused flash block with the
hash dropout (:mod:`omnitron.kernels.triton_kernels.flash_block`), which holds no chunk: its own allocations are
its float32 outputs (forward: the block's output and log-sum-exp; backward: dq, dk, dv, the row sums of
``dout * out`` and a contiguous copy of the log-sum-exp rows) and the positions as int32
(:func:`fused_block_peak`, written out: the kernel runs only on a GPU or under Triton's interpreter).

Sliding windows and attention sinks take the block path under every ``--cp-comm-type`` (a2a and allgather run the
ring's tiles, the sinks after the merge), and at cp = 1 too (a one-rank ring's tiles, since 2026-12-06, except with
``--reset-attention-mask``). With a full-attention layer among them (gpt-oss: its full layers have sinks) the
largest block priced is the windowless one. With a window on every layer no kernel call is larger than a tile
(:mod:`omnitron.core.parallel.context.tiles`): ``t = max(64, left + 1)`` rows, cut at the chunk runs (the whole
sequence on one rank or under a2a, ``s / 2 ring`` rows per chunk on a ring), either a square causal diagonal tile
or one cut by the window's edge, which runs the reference kernel with its keep mask whatever the backend; the
term is the largest of their peaks (:func:`largest_blocks`: the exact tile shapes, on one run or those any rank of
a ring runs at any step), not the windowless block's ``ROW_CHUNK x s`` chunk.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from omnitron.core.transformer.shapes import head_dim, query_groups


@dataclass(frozen=True)
class Block:
    """The largest block one rank's attention runs: ``heads`` query heads over ``kv_heads``, ``rows`` query rows
    against ``keys`` keys (``causal``: a square block under the causal mask)."""

    heads: int
    kv_heads: int
    rows: int
    keys: int
    causal: bool
    masked: bool = False
    """A window's cut tile: the reference kernel with a keep mask ``[rows, keys]`` (the tile's, made beforehand)."""


def block_path(settings, cfg) -> bool:
    """Whether this layout's attention dropout runs on the block kernels with the hash mask (module doc): cp > 1,
    or cp = 1 where every layer runs the one-rank blocks (:func:`one_rank_blocks`)."""
    if not cfg.attention_dropout:
        return False
    return settings.parallel.context_parallel_size > 1 or one_rank_blocks(settings, cfg)


def one_rank_blocks(settings, cfg) -> bool:
    """Whether every layer's attention at cp = 1 runs a one-rank ring's blocks: sinks on every layer
    (``--softmax-type`` not vanilla) or a sliding window on every layer, and no ``--reset-attention-mask`` (its
    per-document mask keeps the masked softmax). MLA has neither."""
    from omnitron.core.transformer.window import window_layers

    if getattr(settings.data, "reset_attention_mask", False) or getattr(cfg, "multi_latent_attention", False):
        return False
    return getattr(cfg, "softmax_type", "vanilla") != "vanilla" or all(window_layers(cfg))


def priced_config(settings, cfg):
    """``cfg`` as the activation and transient probes should run it: without attention dropout where the engine
    takes the block path (nothing score-sized is saved), else unchanged."""
    return replace(cfg, attention_dropout=0.0) if block_path(settings, cfg) else cfg


def largest_block(settings, cfg) -> Block:
    """The block whose reference chunk is the largest, per ``--cp-comm-type`` (``s`` the sequence, ``c = s / 2cp``
    a load-balanced chunk): p2p the ring's first, causal, step ``(s/cp, s/cp)``; a2a the whole sequence causal on
    ``1 / cp`` of the heads; allgather a late chunk's rows against the keys before it ``(c, s - c)``; a2a+p2p the
    ring over the p2p ranks on the a2a group's heads."""
    pc = settings.parallel
    tp, cp, s = pc.tensor_model_parallel_size, pc.context_parallel_size, cfg.seq_length
    hq, hkv = cfg.num_attention_heads // tp, max(1, query_groups(cfg) // tp)
    comm = pc.cp_comm_type
    if comm == "allgather":
        c = s // (2 * cp)
        return Block(hq, hkv, c, s - c, False)
    heads = _head_split(pc)
    ring = cp // heads  # the ranks the sequence stays split over
    return Block(hq // heads, max(1, hkv // heads), s // ring, s // ring, True)


def _head_split(pc) -> int:
    """The ranks the heads are split over (a2a: every cp rank; a2a+p2p: the a2a group; else none)."""
    return {"a2a": pc.context_parallel_size,
            "a2a+p2p": (pc.hierarchical_context_parallel_sizes or [1])[0]}.get(pc.cp_comm_type, 1)


def largest_blocks(settings, cfg) -> list[Block]:
    """The blocks whose kernel peak may be the largest: :func:`largest_block`, or with a sliding window on every
    layer the tiles (module docstring) on :func:`largest_block`'s heads: on one run the distinct tile shapes
    :func:`omnitron.core.parallel.context.tiles.step_plan` makes, on a ring those any rank makes at any step
    (:func:`~omnitron.core.parallel.context.tiles.ring_tile_shapes`)."""
    from omnitron.core.parallel.context.tiles import TILE_MIN, ring_tile_shapes
    from omnitron.core.transformer.window import parse_window, window_layers

    blk = largest_block(settings, cfg)
    window = parse_window(cfg.window_size) if all(window_layers(cfg)) else None
    if window is None or window[0] < 0:
        return [blk]
    pc = settings.parallel
    ring = pc.context_parallel_size // _head_split(pc)  # allgather: the gathered blocks keep the ring's chunks
    left, t = window[0], max(TILE_MIN, window[0] + 1)
    if ring > 1:  # chunk runs of s / 2 ring rows, cut into tiles from each chunk's start
        return [replace(blk, rows=r, keys=k, causal=causal, masked=masked)
                for r, k, causal, masked in sorted(ring_tile_shapes(ring, cfg.seq_length // ring, window))]
    # one run (the whole sequence): pieces of t rows and a remainder; each piece against itself (causal when the
    # window covers it, else cut) and against the piece before it (cut; absent when left = 0), none further back
    full, rem = divmod(cfg.seq_length, t)
    diagonal = ([t] if full else []) + ([rem] if rem else [])
    behind = ([t] if full >= 2 else []) + ([rem] if full and rem else []) if left >= 1 else []
    return ([replace(blk, rows=n, keys=n, causal=n - 1 <= left, masked=n - 1 > left) for n in diagonal]
            + [replace(blk, rows=n, keys=t, causal=False, masked=True) for n in behind])


@functools.lru_cache(maxsize=256)
def block_peak(blk: Block, batch: int, d: int, dv: int, dtype: torch.dtype, p: float) -> int:
    """Peak bytes the reference block kernel allocates in its forward or its backward (the larger) for ``blk`` at
    ``batch``, head dims ``d`` (queries, keys) and ``dv`` (values), inputs of ``dtype``, hash dropout ``p`` (0:
    none), replayed on ``meta`` tensors (module docstring)."""
    from omnitron.kernels.alloc_log import Timeline, peak
    from omnitron.kernels.hash_dropout import HashDropout
    from omnitron.kernels.reference.attention_block import block_backward, block_forward

    dev = torch.device("meta")
    q = torch.empty(batch, blk.heads, blk.rows, d, device=dev, dtype=dtype)
    k = torch.empty(batch, blk.kv_heads, blk.keys, d, device=dev, dtype=dtype)
    v = torch.empty(batch, blk.kv_heads, blk.keys, dv, device=dev, dtype=dtype)
    drop = HashDropout(0, p, torch.arange(blk.rows, device=dev), torch.arange(blk.keys, device=dev)) if p else None
    mask = torch.ones(blk.rows, blk.keys, dtype=torch.bool, device=dev) if blk.masked else None
    kw = dict(causal=blk.causal, scale=1.0, drop=drop, mask=mask)
    fwd = Timeline()
    with fwd:
        out, lse = block_forward(q, k, v, **kw)
    out = out.to(dtype)  # as the ring passes them: its merged output and the output gradient in the inputs' dtype
    dout, bwd = torch.empty_like(out), Timeline()
    with bwd:
        block_backward(dout, q, k, v, out, lse, **kw)
    return round(max(peak(fwd.events), peak(bwd.events)))


def fused_block_peak(blk: Block, batch: int, d: int, dv: int) -> int:
    """Peak bytes the fused flash block with hash dropout allocates in its forward or its backward (the larger) for
    ``blk`` at ``batch``, head dims ``d`` and ``dv`` (module docstring)."""
    pos = 4 * (blk.rows + blk.keys)
    fwd = 4 * batch * blk.heads * blk.rows * (dv + 1)
    bwd = 4 * batch * (blk.heads * blk.rows * (2 + d) + blk.kv_heads * blk.keys * (d + dv))
    return max(fwd, bwd) + pos


def fused_blocks(settings) -> bool:
    """Whether the layout's blocks run the fused flash block (an accelerator backend named by ``--backend``)."""
    return (getattr(settings, "backend", None) or "cpu") not in ("cpu", "sim", "auto")


def block_dropout_bytes(settings, cfg) -> int:
    """The block path's transient on one rank (0 where the layout does not take it): the largest
    :func:`block_peak` (or on an accelerator :func:`fused_block_peak`, but for a masked tile) of
    :func:`largest_blocks` at the micro-batch size."""
    if not block_path(settings, cfg):
        return 0
    mla = getattr(cfg, "multi_latent_attention", False)
    d = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim if mla else head_dim(cfg)
    dv, batch = cfg.v_head_dim if mla else d, settings.training.micro_batch_size
    peaks = []
    for blk in largest_blocks(settings, cfg):
        if mla:  # every query head has its own key and value
            blk = replace(blk, kv_heads=blk.heads)
        fused = fused_blocks(settings) and not blk.masked  # a keep mask runs the reference kernel (blocks._calls)
        peaks.append(fused_block_peak(blk, batch, d, dv) if fused
                     else block_peak(blk, batch, d, dv, cfg.params_dtype, cfg.attention_dropout))
    return max(peaks)
