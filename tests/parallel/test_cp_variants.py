"""Context parallelism for the 2025-26 attention variants, against one process in float64.

(a) Core attention over the cp-split sequence (``transformer/cp_attention.py``: p2p ring, a2a, allgather,
a2a+p2p) against plain float64 attention on the whole sequence: a value head dim unlike the query's (MLA), a
causal sliding window (blocks outside it skipped, cut ones masked), attention sinks (the sink once per row),
grouped-query heads, and attention dropout (the hash masks of the whole sequence: every layout draws those);
without cp, a windowed / sink layer on a one-rank ring's blocks (values, and no [s, s] scores).
(b) GPT models in float64 at cp2 against the one-process model: multi-latent attention (decoupled RoPE at the
chunks' global positions, YaRN), alternating sliding windows with learnable / off-by-one sinks (GQA), and
multi-token prediction (the shifts crossing chunk boundaries): loss and every gradient (cp4 and tp2 x cp2 with
sequence parallelism, -m slow). (c) The training loop with windows and sinks at cp2 (-m slow). Sim variants of
(a) and (b) are -m slow.
"""
from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.context import split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.ops import LargestTensor
from omnitron.testing.sim import requires_sim

# float64 throughout: the collectives move values exactly and the layouts differ from the references only in
# the order of the softmax's and the GEMMs' sums (<= 64 keys, a few chained GEMMs in the models): relative
# errors ~ n u ~ 1e-14. A wrong window position, a sink counted per block or a shift inside the chunk moves
# results by 1e-2 or more. 1e-11 leaves three orders of magnitude.
TOL = 1e-11
DROP_SEED = 7

# (name, hq, hkv, dqk, dv, window, sinks, dropout, rows per chunk): s = 2 cp x rows per chunk. The last case
# cuts each 96-row chunk into tiles of 65 and 31 rows (.tiles: causal, whole, cut and skipped tiles all occur)
ATTN = [("mla", 4, 4, 10, 6, None, False, 0.0, 4), ("window-sinks-gqa", 4, 2, 8, 8, (3, 0), True, 0.0, 4),
        ("window-mqa-wide", 4, 1, 8, 8, (100, 0), False, 0.0, 4), ("window0-sinks", 4, 4, 6, 4, (0, 0), True, 0.0, 4),
        ("mla-dropout", 4, 4, 10, 6, None, False, 0.3, 4), ("window-sinks-dropout", 4, 2, 8, 8, (5, 0), True, 0.3, 4),
        ("window-tiles-sinks", 4, 1, 8, 8, (64, 0), True, 0.0, 96)]


def _full_dropout(shape, p: float) -> torch.Tensor:
    """The hash dropout multipliers ``[b, hq, s, s]`` of the whole sequence, which every cp layout draws."""
    from omnitron.kernels.hash_dropout import HashDropout

    b, hq, s, _ = shape
    pos = torch.arange(s)
    return HashDropout(DROP_SEED, p, pos, pos).multiplier(b, hq, slice(None), torch.float64)


def _keep(s: int, window) -> torch.Tensor:
    """``[s, s]`` True where query i sees key j: causal, within ``window``."""
    d = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    return (d >= 0) & (d <= (window[0] if window else s))


def _reference(q, k, v, scale, window, sinks, drop=None, docs=None):
    """softmax([q k^T scale + causal window mask | sink]) without the sink column (* dropout) @ v, whole sequence;
    ``docs [b, s]`` (document ids) also masks keys of other documents."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    keep = _keep(q.shape[2], window)
    keep = keep if docs is None else (keep & (docs[:, :, None] == docs[:, None]))[:, None]
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], -1)
    prob = torch.softmax(s, -1)[..., : q.shape[2]]
    return (prob if drop is None else prob * drop) @ v


def _module(groups, comm: str, backend):
    """The attributes cp_attention reads from an attention module."""
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.parallel.tensor.random import MODEL_PARALLEL

    tracker = RNGTracker(backend)
    tracker.add(MODEL_PARALLEL, 5)
    sub = (groups.cp_a2a, groups.cp_p2p) if comm == "a2a+p2p" else None
    return types.SimpleNamespace(cp_group=groups.cp, cp_comm_type=comm, cp_subgroups=sub, tracker=tracker,
                                 backend=backend)


def _layouts(cp: int):
    """(comm type, ParallelConfig) pairs run at this cp."""
    out = [(c, ParallelConfig(context_parallel_size=cp, cp_comm_type=c)) for c in ("p2p", "a2a", "allgather")]
    if cp == 4:
        out.append(("a2a+p2p", ParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p",
                                              hierarchical_context_parallel_sizes=[2, 2])))
    return out


def attention_worker(cps) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.transformer.cp_attention import cp_attention

    torch.set_num_threads(1)
    be, out = get_backend(), []
    dev = be.device()  # sim: the attention runs on sim tensors, the reference on the host
    for cp in cps:
        for comm, cfg in _layouts(cp):
            groups = ParallelGroups.build(cfg, be.collectives)
            rank = groups.cp.rank
            for n, (name, hq, hkv, dqk, dv, window, with_sinks, p, c) in enumerate(ATTN):
                g = torch.Generator().manual_seed(100 * cp + n)  # the same full tensors on every rank
                b, s, scale = 2, 2 * cp * c, 0.37
                q = torch.randn(b, hq, s, dqk, generator=g, dtype=torch.float64)
                k = torch.randn(b, hkv, s, dqk, generator=g, dtype=torch.float64)
                v, dout = (torch.randn(b, h, s, dv, generator=g, dtype=torch.float64) for h in (hkv, hq))
                sinks = torch.randn(hq, generator=g, dtype=torch.float64) + 1.0 if with_sinks else None
                full = [t.clone().requires_grad_(True) for t in (q, k, v)]
                fs = None if sinks is None else sinks.clone().requires_grad_(True)
                drop = _full_dropout(q.shape, p) if p else None
                ref = _reference(*full, scale, window, fs, drop)
                ref.backward(dout)
                want = [split_sequence(t, 2, cp, rank) for t in [ref] + [t.grad for t in full]]
                mine = [split_sequence(t, 2, cp, rank).to(dev).requires_grad_(True) for t in (q, k, v)]
                ms = None if sinks is None else sinks.to(dev).requires_grad_(True)
                m = _module(groups, comm, be)
                if p:
                    # the hash's seed, as the reference's masks
                    m.tracker.draw_seed = lambda device, name=None: DROP_SEED
                o = cp_attention(m, *mine, p, scale=scale, window=window, sinks=ms)
                o.backward(split_sequence(dout, 2, cp, rank).to(dev))
                got = [o] + [t.grad for t in mine]
                if ms is not None:  # each rank's share of the sinks' gradient: summed over cp as the data grads
                    be.collectives.all_reduce(ms.grad, group=groups.cp.handle)
                    got, want = got + [ms.grad], want + [fs.grad]
                err = max(((a.cpu() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
                dropped = p == 0 or 0.2 < (drop == 0)[:, :, _keep(s, window)].double().mean().item() < 0.4
                out.append(((cp, comm, name), err, dropped))
    return out


def _check_attention(per_rank, cps) -> None:
    want = sum(7 * len(_layouts(cp)) for cp in cps)  # per layout: 5 cases without dropout, 2 with
    for rank_result in per_rank:
        assert len(rank_result) == want, [c for c, *_ in rank_result]
        for case, err, dropped in rank_result:
            assert dropped and err < TOL, (case, err)


def test_cp_attention_variants_match_full_attention():
    # the backend's kernels (cpu: ATen's flash kernel in float64 on whole and causal tiles, the reference on cut ones)
    _check_attention(run_distributed(attention_worker, 2, [2]), [2])


@pytest.mark.slow
def test_cp_attention_variants_at_cp4_match_full_attention():
    """cp4: chunks of 4 rows in 32, a2a+p2p as 2 x 2 (the ring over super-chunks keeps global positions)."""
    _check_attention(run_distributed(attention_worker, 4, [4]), [4])


@pytest.mark.slow
@requires_sim()
def test_cp_attention_variants_on_sim_match_full_attention():
    _check_attention(run_distributed(attention_worker, 4, [2, 4], backend="sim"), [2, 4])


# (window, sinks, dropout) at cp2 over s = 2048 rows, hq 4, hkv 2 (a2a then holds 2 query heads, 1 key/value head)
SCALE_CASES = [((100, 0), True, 0.0), ((100, 0), False, 0.0), (None, True, 0.0), ((100, 0), True, 0.2)]


def scale_worker() -> list:
    """Per case and comm type: (largest tensor made, relative error against float64 attention on the host)."""
    from omnitron.backends import get_backend
    from omnitron.core.transformer.cp_attention import cp_attention

    torch.set_num_threads(1)
    be, out = get_backend(), []
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2), be.collectives)
    for n, (window, with_sinks, p) in enumerate(SCALE_CASES):
        g = torch.Generator().manual_seed(300 + n)
        b, hq, hkv, s, d, scale = 1, 4, 2, 2048, 8, 0.37
        q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
        sinks = torch.randn(hq, generator=g, dtype=torch.float64) if with_sinks else None
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        drop = _full_dropout(q.shape, p) if p else None
        ref = _reference(*full, scale, window, sinks, drop)
        ref.backward(dout)
        want = [split_sequence(t, 2, 2, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
        for comm in ("a2a", "allgather"):
            m = _module(groups, comm, be)
            m.tracker.draw_seed = lambda device, name=None: DROP_SEED
            mine = [split_sequence(t, 2, 2, groups.cp.rank).to(be.device()).requires_grad_(True) for t in (q, k, v)]
            with LargestTensor() as largest:
                o = cp_attention(m, *mine, p, scale=scale, window=window,
                                 sinks=None if sinks is None else sinks.to(be.device()))
                o.backward(split_sequence(dout, 2, 2, groups.cp.rank).to(be.device()))
            got = [o] + [t.grad for t in mine]
            err = max(((a.cpu() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
            out.append(((comm, window, with_sinks, p), largest.most, err))
    return out


def test_all_to_all_and_allgather_windows_and_sinks_make_no_full_scores():
    """a2a and allgather with a sliding window or sinks run the ring's tiles and blocks (as p2p does), not a masked
    softmax over ``[b, h/cp, s, s]`` (a2a) or ``[b, h, s/cp, s]`` (allgather) scores: at s = 2048, cp2, those are
    b hq s^2 / cp = 8.4M elements. What the blocked path may make: a rank's gathered keys and values and its
    gradients (``[b, h, s, d]``: 65K), the reference kernel's row chunk of scores (``[b, hq, ROW_CHUNK, sk]``, sk <=
    s: 2.1M, where a block runs on the reference: dropout, masked tiles) and the tiles' masks (128 x 128): all
    under b hq ROW_CHUNK s, a quarter of the full scores. The results equal float64 attention on one process
    (forward and every gradient, to TOL: see the top of this file; the keys here are 2048, n u ~ 1e-13)."""
    from omnitron.kernels.reference.attention_block import ROW_CHUNK

    bound = 1 * 4 * ROW_CHUNK * 2048
    for rank_result in run_distributed(scale_worker, 2):
        assert len(rank_result) == 2 * len(SCALE_CASES)
        for case, most, err in rank_result:
            assert most <= bound, (case, most, bound)
            assert err < 1e-11, (case, err)


# (s, window, softmax type, dropout, document ids) of one process's SelfAttention (cp = 1), hq 4, hkv 2, d 8. At
# s = 1024 memory is bounded too; s = 301 is odd (the one-rank tiles cover every row, not two halves of 150).
ONE_RANK_CASES = [(1024, (100, 0), "learnable", 0.0, False), (1024, (100, 0), "off-by-one", 0.0, False),
                  (1024, None, "learnable", 0.2, False), (1024, (127, 0), "vanilla", 0.2, False),
                  (301, (64, 0), "learnable", 0.0, False), (40, (5, 0), "learnable", 0.0, True)]


@pytest.mark.parametrize("s,window,softmax,p,docs", ONE_RANK_CASES)
def test_windows_and_sinks_without_cp_make_no_full_scores(s, window, softmax, p, docs):
    """Without context parallelism a layer with a sliding window or sinks runs the blocks of a one-rank ring (only
    the tiles the window reaches, the sink once per row after the merge, the hash dropout of the cp paths), not a
    masked softmax over ``[b, hq, s, s]`` scores (4.2M elements at s = 1024). What it may make: ``[b, hq, s, d]``
    outputs and gradients (33K) and, with a window, tiles of ``t = max(64, left + 1)`` keys: so under a window the
    bound is ``b hq max(s d, t^2)``; without one the reference block's row chunk ``b hq ROW_CHUNK s`` (dropout: 2.1M, an
    quarter of the full scores). Packed documents keep the masked softmax (the blocks know positions, not
    documents): checked for values only. Output and the gradients of q, k, v and the learnable sinks equal float64
    attention on one process to TOL (top of this file: <= 1024 keys, n u ~ 1e-13)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.parallel.tensor.random import MODEL_PARALLEL
    from omnitron.core.transformer.attention import SelfAttention
    from omnitron.core.parallel.context.tiles import TILE_MIN
    from omnitron.kernels.reference.attention_block import ROW_CHUNK

    be, g = get_backend("cpu"), torch.Generator().manual_seed(s + 7 * len(softmax) + int(10 * p))
    c = replace(_config("window+learnable"), softmax_type=softmax, attention_dropout=p)
    tracker = RNGTracker(be)
    tracker.add(MODEL_PARALLEL, 5)
    tracker.draw_seed = lambda device, name=None: DROP_SEED  # the hash's seed, as the reference's masks
    attn = SelfAttention(c, group=ParallelGroups.single().tp, sequence_parallel=False, tracker=tracker, backend=be,
                         out_std=0.02)
    attn.window = window
    q, dout = (torch.randn(1, 4, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    ids = torch.randint(0, 3, (1, s), generator=g).sort().values if docs else None
    sinks = attn.sinks()
    if softmax == "learnable":
        with torch.no_grad():
            sinks.copy_(torch.randn(4, generator=g, dtype=torch.float64))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fs = None if sinks is None else sinks.detach().clone().requires_grad_(softmax == "learnable")
    ref = _reference(*full, 8 ** -0.5, window, fs, _full_dropout(q.shape, p) if p else None, ids)
    ref.backward(dout)
    mine = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with LargestTensor() as largest:
        o = attn.core_attention(*mine, None, ids)
        o.backward(dout)
    got, want = [o] + [t.grad for t in mine], [ref] + [t.grad for t in full]
    if softmax == "learnable":
        got, want = got + [attn.softmax_offset.grad], want + [fs.grad]
    err = max(((a - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
    assert err < TOL, err
    bound = 1 * 4 * max(s * 8, max(TILE_MIN, window[0] + 1) ** 2) if window else 1 * 4 * ROW_CHUNK * s
    assert docs or largest.most <= bound, (largest.most, bound)


@pytest.mark.parametrize("cp,s_l,left", [(4, 4, 1), (2, 512, 100), (2, 512, 0), (4, 256, 300)])
def test_ring_tiles_cover_the_window_once(cp, s_l, left):
    """The tiles of every rank and step cover each (query, key) pair of the causal window exactly once; with a
    window narrower than a chunk they touch O(s x (left + tile)) pairs, not O(s^2); masks stay per tile."""
    from omnitron.core.parallel.context import chunk_positions
    from omnitron.core.parallel.context.tiles import TILE_MIN, step_plan

    s = cp * s_l
    seen = torch.zeros(s, s, dtype=torch.int64)
    touched = 0
    for r in range(cp):
        for i in range(cp):
            for tile in step_plan(i, r, cp, s_l, True, (left, 0)):
                qi = chunk_positions(s, cp, r)[tile.rows]
                ki = chunk_positions(s, cp, (r - i) % cp)[tile.cols]
                keep = torch.ones(len(qi), len(ki), dtype=torch.bool)
                if tile.mask is not None:
                    keep = tile.mask
                elif tile.causal:
                    keep = keep.tril()
                seen[qi[:, None], ki[None, :]] += keep.long()
                touched += len(qi) * len(ki)
    assert torch.equal(seen, _keep(s, (left, 0)).long())
    t = max(TILE_MIN, left + 1)
    assert touched <= s * (left + 2 * t), (touched, s)


def test_refusals():
    from omnitron.core.parallel.context import ring_attention

    one = types.SimpleNamespace(size=2, rank=0)
    q = torch.zeros(1, 4, 4, 8)
    with pytest.raises(ValueError, match="a sliding window is causal here"):
        ring_attention(q, q, q, group=one, collectives=None, causal=False, window=(2, 0))
    with pytest.raises(ValueError, match="one logit per query head \\(4\\)"):
        ring_attention(q, q, q, group=one, collectives=None, sinks=torch.zeros(2))


def test_mla_refusals_and_flash_declines():
    """MLA under cp refuses per-document masks (the ring's blocks know positions, not documents); the fused block
    kernels decline a value head dim unlike the query's (MLA), so the ring runs the reference there."""
    from omnitron.backends import get_backend
    from omnitron.backends.cpu.kernels import supports_on
    from omnitron.core.parallel.tensor import RNGTracker
    from omnitron.core.transformer.mla import MLASelfAttention

    be, single = get_backend("cpu"), ParallelGroups.single()
    attn = MLASelfAttention(_config("mla"), group=single.tp, sequence_parallel=False, tracker=RNGTracker(be),
                            backend=be, out_std=0.02)
    attn.cp_group = types.SimpleNamespace(size=2, rank=0)
    q, v = torch.zeros(1, 4, 4, 10), torch.zeros(1, 4, 4, 6)
    with pytest.raises(ValueError, match="--reset-attention-mask .* does not run under context parallelism"):
        attn.core_attention(q, q, v, None, torch.zeros(1, 4, dtype=torch.long))
    fwd, _ = supports_on("cpu")
    assert "head dim" in fwd(q, q, v, causal=True, scale=1.0) and fwd(q, q, q, causal=True, scale=1.0) is None


# ---- (b) models ----------------------------------------------------------------------------------
SEQ = 16


def _config(kind: str):
    from omnitron.core.models.gpt import GPTConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=SEQ,
                vocab_size=61, make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
                untie_embeddings_and_output_weights=True, params_dtype=torch.float64)
    mla = dict(multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4,
               v_head_dim=5, qk_layernorm=True, rotary_scaling_factor=8.0, mscale=0.707, mscale_all_dim=0.3,
               yarn_original_max_position_embeddings=8)
    gqa = dict(num_query_groups=2)
    window = dict(gqa, window_size="3,0", window_attn_skip_freq="2")
    kinds = {"mla": mla, "mla+mtp": dict(mla, mtp_num_layers=1, mtp_loss_scaling_factor=0.5),
             "window+learnable": dict(window, softmax_type="learnable"),
             "window+off-by-one": dict(window, softmax_type="off-by-one"),
             "mtp": dict(gqa, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)}
    return GPTConfig(**{**base, **kinds[kind]})


MODEL_CASES = [("mla", "p2p"), ("mla", "a2a"), ("mla+mtp", "allgather"), ("window+learnable", "p2p"),
               ("window+learnable", "a2a"), ("window+off-by-one", "allgather"), ("mtp", "p2p")]


def _batch():
    g = torch.Generator().manual_seed(21)
    tokens = torch.randint(0, 61, (2, SEQ), generator=g)
    labels = torch.randint(0, 61, (2, SEQ), generator=g)
    return {"tokens": tokens, "labels": labels, "loss_mask": (torch.rand(2, SEQ, generator=g) > 0.25).double()}


def _perturb(model) -> None:
    """Sinks and norm weights away from their initial 0 / 1, so a sink or norm mistake shows: the same full
    values in every layout (drawn per name at the full shape, this tp rank's shard kept)."""
    import zlib

    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import full_shape, shard_param

    tp = model.groups.tp
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "softmax_offset" in name or "norm" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn(full_shape(p, tp.size), generator=g, dtype=p.dtype) * 0.5
                p.add_(shard_param(full, p, tp.size, M.local_rank(tp)).to(p.device))


def _loss(model, batch, count):
    """The step's objective: masked LM loss sum / count (multi-token prediction joins it in backward)."""
    out = model(tokens=batch["tokens"], position_ids=batch.get("position_ids"), labels=batch["labels"],
                loss_mask=batch["loss_mask"])
    return (out * batch["loss_mask"]).sum() / count


def one_process(kind: str) -> tuple[float, float, dict]:
    """(LM loss, MTP loss, gradients) of the one-process float64 model."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, gather_full_state

    model = GPTModel(_config(kind), ParallelGroups.single(), backend=get_backend("cpu"), seed=3)
    _perturb(model)
    batch = _batch()
    loss = _loss(model, batch, batch["loss_mask"].sum())
    loss.backward()
    mtp = model.mtp.loss_total.item() if getattr(model, "mtp", None) is not None else 0.0
    return loss.item(), mtp, gather_full_state(model, ParallelGroups.single(), grads=True)


def model_worker(cases, cp: int = 2, tp: int = 1) -> dict:
    """Per case at cp (x tp with sequence parallelism): the LM and MTP losses and every full gradient, averaged over
    cp as the dp x cp reduction does."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, allreduce_sequence_parallel_grads, gather_full_state
    from omnitron.core.parallel.context import context_parallel_batch
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    be, out = get_backend(), {}
    for kind, comm in cases:  # comm: one --cp-comm-type, or a tuple of one per layer
        per_layer = (comm,) if isinstance(comm, str) else comm
        extra = dict(hierarchical_context_parallel_sizes=[2, cp // 2]) if "a2a+p2p" in per_layer else {}
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp, cp_comm_type=comm,
                                                     tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                                                     **extra), be.collectives)
        dev = be.device()  # the host for cpu; sim tensors for sim (its collectives take no host tensors)
        model = to_device(GPTModel(_config(kind), groups, backend=be, seed=3), dev)
        _perturb(model)
        batch = context_parallel_batch({k: v.to(dev) for k, v in _batch().items()}, groups.cp)
        loss = _loss(model, batch, batch["cp_num_tokens"])
        loss.backward()
        allreduce_sequence_parallel_grads(model, groups)
        has_mtp = getattr(model, "mtp", None) is not None
        mtp = model.mtp.loss_total.detach().clone() if has_mtp else torch.zeros((), device=dev)
        vals = torch.stack([loss.detach(), mtp.double()])
        for t in [vals] + [p.grad for p in model.parameters()]:
            be.collectives.all_reduce(t, group=groups.cp.handle)
            t /= groups.cp.size
        out[(kind, comm)] = (vals.cpu().tolist(), gather_full_state(model, groups, grads=True))
        out[("types", kind, comm)] = _attention_types(model)
    return out


def _attention_types(model) -> list[str]:
    """The --cp-comm-type each decoder layer's attention runs, then each multi-token-prediction depth's."""
    layers = list(model.decoder.layers.values()) + list(getattr(getattr(model, "mtp", None), "layers", []))
    return [next(m.cp_comm_type for m in layer.modules() if hasattr(m, "cp_comm_type")) for layer in layers]


def _check_models(per_rank, cases) -> None:
    from omnitron.testing.parity import reference_kernels

    with reference_kernels():  # as the workers (REFERENCE_KERNELS): the fused CPU rope and norms round in float32
        refs = {kind: one_process(kind) for kind in {k for k, _ in cases}}
    for case in cases:
        lm, mtp, grads = refs[case[0]]
        (got_lm, got_mtp), got = per_rank[0][case]
        assert got_lm == pytest.approx(lm, rel=TOL) and got_mtp == pytest.approx(mtp, rel=TOL, abs=1e-300), case
        assert (mtp > 0.05) == ("mtp" in case[0])  # the MTP term is there, not a vanishing one
        assert got.keys() == grads.keys(), case
        for name, g in grads.items():
            scale = g.abs().max().item()
            assert scale > 0 and (got[name] - g).abs().max().item() <= TOL * scale, (case, name)


def test_models_at_cp2_match_one_process():
    _check_models(run_distributed(model_worker, 2, MODEL_CASES, env=REFERENCE_KERNELS), MODEL_CASES)


# --cp-comm-type per layer (Megatron's list, one per layer): the 2-layer models mix the types, each layer's
# attention runs its own (an MTP depth k the k-th type, as Megatron numbers its layers), and loss and gradients
# are the one-process model's (every type computes the same attention: the mix must not change the maths)
PER_LAYER_CASES = [("mla", ("p2p", "a2a")), ("window+learnable", ("a2a+p2p", "allgather")),
                   ("mtp", ("allgather", "p2p"))]


def test_models_with_per_layer_cp_comm_types_match_one_process():
    per_rank = run_distributed(model_worker, 2, PER_LAYER_CASES, env=REFERENCE_KERNELS)
    _check_models(per_rank, PER_LAYER_CASES)
    for kind, comm in PER_LAYER_CASES:
        depths = 2 if kind == "mtp" else 0
        assert per_rank[0][("types", kind, comm)] == list(comm) + list(comm[:depths])


@pytest.mark.slow
@requires_sim()
def test_models_at_cp2_on_sim_match_one_process():
    cases = [("mla+mtp", "p2p"), ("window+learnable", "p2p"), ("window+off-by-one", "a2a")]
    _check_models(run_distributed(model_worker, 2, cases, backend="sim", env=REFERENCE_KERNELS), cases)


@pytest.mark.slow
def test_models_at_cp4_and_tp2_cp2_match_one_process():
    """cp4 (chunks of 2 rows: a window of 3 spans three chunks; a2a+p2p as 2 x 2) and tp2 x cp2 with sequence
    parallelism (sinks split over tp, then over cp by a2a)."""
    cp4 = [("mla+mtp", "p2p"), ("window+learnable", "a2a+p2p"), ("mtp", "allgather"), ("window+off-by-one", "p2p")]
    _check_models(run_distributed(model_worker, 4, cp4, 4, env=REFERENCE_KERNELS), cp4)
    tp2 = [("mla", "p2p"), ("window+learnable", "a2a"), ("mtp", "p2p")]
    _check_models(run_distributed(model_worker, 4, tp2, 2, 2, env=REFERENCE_KERNELS), tp2)


GPT_OSS = ("--window-size", "3,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable")


@pytest.mark.slow
def test_window_sink_training_at_cp2_matches_one_process(tmp_path):
    """Three SGD steps of a float64 windowed model with learnable sinks: cp2 over p2p, a2a and allgather; losses
    equal one process's to test_cp_comm_types' LOOP_REL (its analysis: float64 sums in other orders, amplified by
    the lr-0.5 steps)."""
    from test_cp_comm_types import LOOP_REL, one_process_losses, run_layouts

    one = one_process_losses(str(tmp_path / "one"), *GPT_OSS)
    plain = one_process_losses(str(tmp_path / "plain"))
    assert abs(one[-1] - plain[-1]) > 1e-4 * abs(plain[-1])  # the window and sinks move the run 1e8 x the bound
    runs = {comm: (*GPT_OSS, "--context-parallel-size", "2", "--cp-comm-type", comm)
            for comm in ("p2p", "a2a", "allgather")}
    for res in run_layouts(str(tmp_path / "cp"), runs, 2):
        for comm, losses in res.items():
            assert losses == pytest.approx(one, rel=LOOP_REL), (comm, losses, one)
