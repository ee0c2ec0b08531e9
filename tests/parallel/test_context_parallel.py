"""Context parallelism: ring attention against plain attention on the whole sequence, and GPT
training with the sequence split over cp ranks against one process (float64 with the reference kernels, TOL).

Every configuration of one world size runs inside one spawned world (spawns cost seconds).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.context import chunk_positions, split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels
from omnitron.testing.sim import requires_sim

# ---- (a) ring attention -------------------------------------------------------------------
ATTN_CASES = [(causal, hq, hkv, dtype, 0.0) for causal in (True, False) for hq, hkv in ((4, 4), (4, 2), (4, 1))
              for dtype in (torch.float64, torch.float32)]
ATTN_CASES += [(True, 4, 2, torch.float64, 0.3), (False, 4, 1, torch.float64, 0.3)]  # attention dropout
DROP_SEED = 99


def _full_dropout(shape, p: float) -> torch.Tensor:
    """The hash dropout multipliers ``[b, hq, s, s]`` of the whole sequence (omnitron.kernels.hash_dropout, its
    own tests check it against the integer reference): every cp layout draws exactly these."""
    from omnitron.kernels.hash_dropout import HashDropout

    b, hq, s, _ = shape
    pos = torch.arange(s)
    return HashDropout(DROP_SEED, p, pos, pos).multiplier(b, hq, slice(None), torch.float64)


def _reference_attention(q, k, v, causal: bool, drop=None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) (* dropout) v on the whole sequence, keys/values repeated per group."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    return (p if drop is None else p * drop) @ v


def ring_worker(cps: list[int]) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context import ring_attention

    torch.set_num_threads(1)
    coll, out, dev = get_backend().collectives, [], get_backend().device()  # the backend under test's device
    for cp in cps:
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp), coll)
        for n, (causal, hq, hkv, dtype, p) in enumerate(ATTN_CASES):
            g = torch.Generator().manual_seed(100 * cp + n)  # the same full tensors on every rank
            b, s, d = 2, 8 * cp, 8
            q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            drop = _full_dropout(q.shape, p) if p else None
            ref = _reference_attention(*full, causal, drop)
            ref.backward(dout)
            # the ring on the backend under test's device; the reference above on the host
            mine = [split_sequence(t, 2, cp, groups.cp.rank).to(dev, dtype).requires_grad_(True) for t in (q, k, v)]
            o = ring_attention(*mine, group=groups.cp, collectives=coll, causal=causal, dropout_p=p, seed=DROP_SEED)
            o.backward(split_sequence(dout, 2, cp, groups.cp.rank).to(dev, dtype))
            got = [t.cpu() for t in [o] + [t.grad for t in mine]]
            want = [split_sequence(t, 2, cp, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
            err = max(((a.double() - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
            seen = torch.ones(s, s, dtype=torch.bool).tril() if causal else torch.ones(s, s, dtype=torch.bool)
            dropped = p == 0 or 0.2 < (drop == 0)[:, :, seen].double().mean().item() < 0.4  # masks really drop
            out.append(((cp, causal, hq, hkv, str(dtype), p), err, o.dtype == dtype and dropped))
    return out


def test_ring_attention_matches_full_attention():
    for rank_result in run_distributed(ring_worker, 4, [2, 4]):
        assert len(rank_result) == 2 * len(ATTN_CASES)
        for case, err, dtype_kept in rank_result:
            # error relative to each tensor's largest element. An output is a sum over <= s = 32 keys of p v
            # (p from s-term softmax sums of exp of d = 8-term dot products), the gradients chain two or three
            # such sums; the ring merges cp <= 4 partial softmaxes (a rescale by exp(m_i - m) and an add each).
            # Reordering n <= 32 + 8 terms moves a sum by <= n u of its largest magnitude: 40 u = 2.4e-6 in
            # float32 (u = 6e-8) at worst, while roundings of random sign add to sqrt(n) u = 3.8e-7, which 2e-6
            # covers 5x (the float32 cases check the kernels' dtype handling; the float64 cases check the maths);
            # in float64 (u = 1.1e-16) even the worst case 40 u = 4.4e-15 is 200x under 1e-12, room for the
            # chained gradient sums. A misplaced chunk or a wrong mask moves an entry by ~1.
            tol = 1e-12 if case[-2] == "torch.float64" else 2e-6
            assert dtype_kept and err < tol, (case, err)


def test_load_balanced_layout():
    """Chunks r and 2cp-1-r: the ranks' positions partition the sequence, each in increasing order."""
    for cp in (1, 2, 3, 4):
        parts = [chunk_positions(24, cp, r) for r in range(cp)]
        assert torch.equal(torch.cat(parts).sort().values, torch.arange(24))
        for r, p in enumerate(parts):
            c = 24 // (2 * cp)
            assert p.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
    with pytest.raises(ValueError, match="divisible by 2 x --context-parallel-size 4"):
        chunk_positions(20, 4, 0)


# ---- (b) GPT training with the sequence split over cp ranks --------------------------------
STEPS, MBS, GBS, SEQ, LR, SEED = 2, 2, 8, 16, 0.5, 1234
# float64 with the reference kernels, u = 2**-53 = 1.1e-16. A layout differs from one process only in the order
# of sums: cp splits attention's key sums (<= 16 keys) into <= 4 partial softmaxes merged by rescaling, tp splits
# contractions of <= 64 terms, dp / cp all-reduces add <= 4 partial gradient sums where one process adds 4
# micro-batches' in turn, and cp's loss divides the sums of the ranks' masked token losses. Reordering n terms
# moves a sum by <= n u times the sum of its magnitudes: 64 x 4 u = 2.8e-14 relative to those (sqrt(n) u ~ 2e-15
# typical). Two SGD steps at lr 0.5 (the loop: 4 iterations clipped to norm 0.5) carry a gradient error into the
# weights at lr and back into the next gradient at gain ~1 + lr ||H|| < 2 (the run is stable): <= 2^4 x 2.8e-14 =
# 4.5e-13 after the loop's 4 iterations. TOL = 1e-12 leaves a factor 2 over that worst case (~100 over typical);
# absolute TOL / 10 for entries near zero. A float32 run (u = 6e-8) needs 1e-5; a slip of 1e-6 fails here.
TOL = 1e-12
# (tp, cp, pp, sequence parallel, model family); dp = 4 / (tp * cp * pp)
LAYOUTS = [(1, 2, 1, False, "llama"), (2, 2, 1, True, "llama"), (2, 2, 1, False, "gpt2"), (1, 2, 2, False, "llama"),
           (1, 4, 1, False, "llama")]


def _model_config(family: str):
    """Tiny models: Llama style (RoPE, GQA 4 heads / 2 groups, RMSNorm, SwiGLU) or GPT-2 style (learned positions)."""
    from omnitron.core.models.gpt import gpt2_tiny, llama_tiny

    make = llama_tiny if family == "llama" else gpt2_tiny
    return make(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
                max_position_embeddings=SEQ, vocab_size=96, hidden_dropout=0.0, attention_dropout=0.0,
                params_dtype=torch.float64)


def _data() -> list[dict]:
    """Every step's global batch: tokens, labels and a random loss mask (so cp ranks' token counts differ)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 96, (STEPS, GBS, SEQ + 1), generator=g)
    mask = (torch.rand(STEPS, GBS, SEQ, generator=g) > 0.3).double()
    return [{"tokens": i[:, :-1], "labels": i[:, 1:], "loss_mask": m} for i, m in zip(ids, mask)]


def _micro_batches(step: dict, lo: int, hi: int, device=None):
    for s in range(lo, hi, MBS):
        yield {k: v[s:s + MBS].to(device) for k, v in step.items()}


def reference(family: str) -> tuple[list[float], dict, dict]:
    """One process: per-step mean over micro-batches of the masked token mean; first grads, final weights."""
    from omnitron.core.models.gpt import GPTModel, gather_full_state

    groups = ParallelGroups.single()
    model = GPTModel(_model_config(family), groups, seed=SEED)
    losses, grads = [], None
    for step in _data():
        model.zero_grad()
        mbs = list(_micro_batches(step, 0, GBS))
        loss = sum((model(tokens=b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() / b["loss_mask"].sum()
                   for b in mbs) / len(mbs)
        loss.backward()
        losses.append(loss.item())
        grads = grads or {k: v.clone() for k, v in gather_full_state(model, groups, grads=True).items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LR)
    return losses, grads, gather_full_state(model, groups)


def _cp_step(chunk, batch, hidden):
    from omnitron.core.parallel.data import unwrap_model

    m = unwrap_model(chunk)
    return chunk(tokens=batch["tokens"] if m.pre_process else None, position_ids=batch["position_ids"]
                 if m.pre_process else None, hidden=hidden, labels=batch["labels"] if m.post_process else None)


def _cp_loss(output, batch):
    from omnitron.core.parallel.context import context_parallel_loss
    from omnitron.core.parallel.pipeline import default_loss_fn

    return context_parallel_loss(*default_loss_fn(output, batch), batch)


def _build(tp, cp, pp, sp, family):
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel

    cfg = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
                         sequence_parallel=sp)
    from omnitron.core.parallel.tensor.sharding import to_device

    groups = ParallelGroups.build(cfg, backend=get_backend())  # the backend under test: its device
    model = GPTModel(_model_config(family), groups, pre_process=groups.pp.is_first, post_process=groups.pp.is_last,
                     layer_offset=2 * groups.pp.rank if pp > 1 else 0, num_layers=4 // pp, seed=SEED)
    model = to_device(model, get_backend().device())
    return groups, DistributedDataParallel(model, groups,
                                           DataParallelConfig(overlap_grad_reduce=True, bucket_size=3000))


def _train_args(root: str, *extra: str) -> list[str]:
    """``omnitron train`` flags: Llama-style tiny model on mock data, SGD with tight clipping (the clipped
    update, and so the loss curve, depends on the exact global gradient norm)."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--seq-length", "16",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-workers", "0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--eval-interval", "2",
            "--eval-iters", "1", "--optimizer", "sgd", "--lr", "0.5", "--clip-grad", "0.5", "--hidden-dropout", "0",
            "--attention-dropout",
            "0", "--log-interval", "1", "--no-tensorboard", "--data-cache-path", root + "/cache", *extra]


def _train(argv: list[str], world: int, backend: str = "cpu", dtype: torch.dtype | None = None
           ) -> tuple[list[float], list[float]]:
    """The training loop's per-iteration losses and validation losses (the model in ``dtype`` when given)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    res = train(settings_in(argv, world, dtype), get_backend(backend))
    return list(res["losses"].values()), [v["val_loss"] for v in res["validation"]]


def gpt_worker(layouts, root: str) -> dict:
    """Per layout: per-step losses, first-step full gradients and final full weights of this rank's stage;
    then the training loop (``step.py``) at tp2 x cp2 with sequence parallelism and at cp2 x dp2 with the
    distributed optimizer."""
    from omnitron.core.models.gpt import gather_full_state
    from omnitron.core.parallel.context import context_parallel_batch
    from omnitron.core.parallel.data import finalize_model_grads
    from omnitron.core.parallel.pipeline import forward_backward

    torch.set_num_threads(1)
    results = {}
    for layout in layouts:
        groups, chunk = _build(*layout)
        dp, per_dp = groups.dp.size, GBS // groups.dp.size
        lo = (groups.dp.rank if dp > 1 else 0) * per_dp
        kw = dict(num_microbatches=per_dp // MBS, seq_length=SEQ, micro_batch_size=MBS, hidden_size=32,
                  forward_step_fn=_cp_step, loss_fn=_cp_loss, schedule_name="1f1b" if layout[2] > 1 else None,
                  dtype=torch.float64)
        losses, grads = [], None
        for step in _data():
            chunk.zero_grad_buffer()
            data = (context_parallel_batch(b, groups.cp) for b in _micro_batches(step, lo, lo + per_dp,
                                                                                 groups.backend.device()))
            out = forward_backward(model_chunks=[chunk], data_iterator=data, groups=groups, **kw)
            finalize_model_grads([chunk], groups)
            losses.append(out["loss"])
            grads = grads or {k: v.clone() for k, v in gather_full_state(chunk.module, groups, grads=True).items()}
            with torch.no_grad():
                for p in chunk.module.parameters():
                    p.add_(p.main_grad, alpha=-LR)
        results[layout] = (losses, grads, gather_full_state(chunk.module, groups))
    results.update(loop_worker(root))  # cp2 x dp2: optimizer states over dp x cp
    return results


def loop_worker(root: str) -> dict:
    """The training loop at tp2 x cp2 (sequence parallel) and cp2 x dp2 (distributed optimizer) on this
    worker's backend."""
    from omnitron.backends import get_backend

    torch.set_num_threads(1)
    name = get_backend().name
    return {"loop": _train(_train_args(root, "--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                                       "--sequence-parallel"), 4, name, torch.float64),
            "loop_zero": _train(_train_args(root + "/zero", "--context-parallel-size", "2",
                                            "--use-distributed-optimizer"), 4, name, torch.float64)}


@pytest.mark.slow
@requires_sim()
def test_context_parallel_training_on_sim_matches_one_process_on_cpu(tmp_path):
    with reference_kernels():
        loop_ref = _train(_train_args(str(tmp_path / "one")), 1, dtype=torch.float64)
    for res in run_distributed(loop_worker, 4, str(tmp_path / "sim"), backend="sim", env=REFERENCE_KERNELS):
        for run in ("loop", "loop_zero"):
            assert res[run][0] == pytest.approx(loop_ref[0], rel=TOL), (run, res[run], loop_ref)
            assert res[run][1] == pytest.approx(loop_ref[1],
                                                rel=TOL) and len(loop_ref[1]) == 3  # + the final validation


def test_gpt_context_parallel_matches_one_process(tmp_path):
    with reference_kernels():
        refs = {family: reference(family) for family in ("llama", "gpt2")}
        loop_ref = _train(_train_args(str(tmp_path / "one")), 1, dtype=torch.float64)
    per_rank = run_distributed(gpt_worker, 4, LAYOUTS, str(tmp_path / "cp"), env=REFERENCE_KERNELS)
    for res in per_rank:
        for run in ("loop", "loop_zero"):
            assert res[run][0] == pytest.approx(loop_ref[0], rel=TOL), (run, res[run], loop_ref)
            assert res[run][1] == pytest.approx(loop_ref[1],
                                                rel=TOL) and len(loop_ref[1]) == 3  # + the final validation
    for layout in LAYOUTS:
        ref_losses, ref_grads, ref_weights = refs[layout[-1]]
        grads, weights = {}, {}
        for res in per_rank:
            losses, g, w = res[layout]
            assert losses == pytest.approx(ref_losses, rel=TOL), (layout, losses, ref_losses)
            grads.update(g)
            weights.update(w)
        assert grads.keys() == ref_grads.keys() == weights.keys(), layout
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=TOL, atol=TOL / 10,
                                       msg=lambda s: f"{layout} grad {name}: {s}")
            torch.testing.assert_close(weights[name], ref_weights[name], rtol=TOL, atol=TOL / 10,
                                       msg=lambda s: f"{layout} weight {name}: {s}")
