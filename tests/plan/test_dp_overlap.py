"""The data-parallel communication the pipeline hides (omnitron/plan/dp_overlap.py), worked by hand on small
timelines, and through the speed model with the distributed optimizer."""
from __future__ import annotations

import math
import random

from omnitron.core.parallel.pipeline.actions import Action
from omnitron.core.parallel.pipeline.simulate import Timeline
from omnitron.plan import dp_overlap


def _span(s, e, text):
    return (s, e, Action.parse(text))


def test_one_chunk_by_hand():
    """One chunk: forward [0, F], backward [F, 3F], L layers; reduction R ready in L pieces over the backward, the
    last piece at 3F; gather G needed layer by layer from 0. With random F, R, G, L:
    tail = max over k of the queue's end, worked as the recurrence; gather delay = max_j (G (j+1)/L - F j/L)."""
    rng = random.Random()
    F, R, G, L = rng.uniform(0.5, 2), rng.uniform(0.1, 5), rng.uniform(0.1, 5), rng.randint(1, 6)
    tl = Timeline(spans={0: [_span(0, F, "0F0"), _span(F, 3 * F, "0B0")]})
    marks = dp_overlap.chunk_marks(tl.spans[0], 1)
    assert all(map(math.isclose, marks[0], (0, F, 3 * F, 2 * F)))  # e - s in floating point
    t = 0.0
    for j in range(L):  # piece j ready at F + 2F (j + 1) / L
        t = max(t, F + 2 * F * (j + 1) / L) + R / L
    assert math.isclose(dp_overlap.reduce_tail(marks, [1.0], R, 3 * F, L), max(0.0, t - 3 * F))
    late = max(G * (j + 1) / L - F * j / L for j in range(L))
    assert math.isclose(dp_overlap.gather_delay(marks, [1.0], G, L), max(0.0, late))
    # a reduction shorter than the backward's last piece's share hides all but that piece
    assert math.isclose(dp_overlap.reduce_tail(marks, [1.0], F / 10, 3 * F, 2), F / 20)


def test_interleaved_cooldown_hides_the_later_chunks_reduction():
    """Two chunks on one rank: chunk 1's last backward ends at 5 (1 long), chunk 0's at 8 (1 long), rank ends at 8.
    Reduction 2 split 1 / 1, one piece each: chunk 1's runs 5-6, chunk 0's 8-9: tail 1 (half of the reduction),
    where one chunk holding it all would leave 2 (its whole reduction after its last backward)."""
    spans = [_span(0, 1, "0F0"), _span(1, 2, "1F0"), _span(4, 5, "1B0"), _span(7, 8, "0B0")]
    marks = dp_overlap.chunk_marks(spans, 2)
    assert [m[2:] for m in marks] == [(8, 1), (5, 1)]
    assert math.isclose(dp_overlap.reduce_tail(marks, [0.5, 0.5], 2.0, 8, 1), 1.0)
    assert math.isclose(dp_overlap.reduce_tail([(0, 1, 8, 1)], [1.0], 2.0, 8, 1), 2.0)


def test_exposed_is_the_latest_rank_beyond_the_makespan():
    """Two ranks: rank 0 ends at 6, rank 1 at 5; rank 1's tail 2 (one piece after its last backward) ends at 7
    while rank 0's 0.5 ends at 6.5: the step's exposed time is 1 beyond the makespan 6. Under ``dp`` the gather
    is added whole to its rank; under ``all`` only its lateness (rank 0 needs chunk 0 at 0: its first piece)."""
    tl = Timeline(spans={0: [_span(0, 1, "0F0"), _span(5, 6, "0B0")], 1: [_span(1, 2, "0F0"), _span(3, 5, "0B0")]})
    ranks = {0: (0.5, 0.0, [1.0], 1), 1: (2.0, 0.0, [1.0], 1)}
    assert math.isclose(dp_overlap.exposed(tl, ranks, "dp"), 1.0)
    ranks = {0: (0.0, 0.3, [1.0], 1), 1: (0.0, 0.0, [1.0], 1)}
    assert math.isclose(dp_overlap.exposed(tl, ranks, "dp"), 0.3)
    assert math.isclose(dp_overlap.exposed(tl, ranks, "all"), 0.3)  # one piece, needed at 0
    ranks = {0: (0.0, 0.3, [1.0], 3), 1: (0.0, 0.0, [1.0], 3)}
    assert math.isclose(dp_overlap.exposed(tl, ranks, "all"), 0.1)  # the first layer's third


def _tiny(extra: dict | None = None):
    """Settings of gpt2_tiny at dp2 with the distributed optimizer (``extra``: more flags), and its model config."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import model_config

    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "dp2", "global_batch_size": 8, "use_distributed_optimizer": True, **(extra or {})})
    return s, model_config(s)


def _tails(B: float, red: float, pieces: int) -> float:
    """Seconds a reduction of ``red`` ready in ``pieces`` equal parts over a last backward of ``B`` runs past it."""
    t = 0.0
    for j in range(pieces):
        t = max(t, B * (j + 1) / pieces) + red / pieces
    return max(0.0, t - B)


def test_speed_model_hides_the_gather_behind_the_forward_only_under_all(tmp_path, constant_rates):
    """Through :func:`predict` (pp 1, dp 2, the distributed optimizer, slow links, buckets of 1000 elements: more
    than the layers, so one piece a layer): under ``dp`` the exposed time is the gather whole plus the reduction's
    tail; ``all`` hides the gather behind the forward but its first layer's share, so it is shorter; ``none`` adds
    both whole. Each against :func:`dp_parts` of the same layout and the one-chunk formulas of the first test."""
    from omnitron.plan.speed import _stage_costs, dp_parts, predict

    rates = constant_rates(tmp_path, 0.5, 5.0)
    s, cfg = _tiny({"bucket_size": 1000})
    L = cfg.num_layers
    red, gat, experts = dp_parts(s, cfg, rates, 0, [False] * L)
    assert red > 0 and gat > 0 and experts == 0
    none, dp, every = (predict(s, rates, o) for o in ("none", "dp", "all"))
    assert math.isclose(none.dp, red + gat)
    F, B = (c.total(k, "dp") for c in [_stage_costs(s, rates, "dp")[2][0]] for k in ("F", "B"))
    assert math.isclose(dp.dp, gat + _tails(B, red, L), rel_tol=1e-9)
    F, B = (c.total(k, "all") for c in [_stage_costs(s, rates, "all")[2][0]] for k in ("F", "B"))
    late = max(0.0, max(gat * (j + 1) / L - F * j / L for j in range(L)))
    assert math.isclose(every.dp, late + _tails(B, red, L), rel_tol=1e-9)
    assert every.dp < dp.dp < none.dp


def test_one_bucket_is_reduced_after_the_backward(tmp_path, constant_rates):
    """gpt2_tiny's gradients at the default bucket size (40M elements): the data-parallel wrapper's buffer
    (:class:`GradBuffer`, built here over the model's parameters in backward order as the wrapper builds it, the
    tied embedding apart) has every bucket holding a gradient of the first layer or the embedding, the last the
    backward makes, so no reduction starts before the backward ends: under ``dp`` the reduction and the gather are
    exposed whole, as under ``none``; under ``all`` the gather still waits whole (the first layer needs the one
    bucket). Before 2026-12-07 the plan readied the reduction a layer at a time (one piece a layer) and hid all
    but the last layer's share (here 1/2 of it)."""
    import torch

    from omnitron.core.parallel.data.buffers import GradBuffer
    from omnitron.core.parallel.data.config import bucket_elements
    from omnitron.plan.speed import dp_parts, predict
    from omnitron.plan.state import skeleton

    rates = constant_rates(tmp_path, 0.5, 5.0)
    s, cfg = _tiny()
    (chunk,) = skeleton(cfg, s.parallel, 0)
    named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad][::-1]  # backward order
    tied = {id(p) for p in chunk.shared_embedding_parameters()}
    buf = GradBuffer([p for _, p in named], torch.float32, bucket_elements(s.ddp, 2, overlap=True), 2,
                    frozenset(tied))
    names = {id(p): n for n, p in named}
    last = ("embedding", "decoder.layers.0.")
    assert buf.buckets and all(any(names[id(p)].startswith(last) for p in b.params) for b in buf.buckets), \
        [[names[id(p)] for p in b.params] for b in buf.buckets]
    L = cfg.num_layers
    red, gat, _ = dp_parts(s, cfg, rates, 0, [False] * L)
    none, dp, every = (predict(s, rates, o) for o in ("none", "dp", "all"))
    assert math.isclose(dp.dp, red + gat, rel_tol=1e-9) and math.isclose(none.dp, red + gat, rel_tol=1e-9)
    assert math.isclose(every.dp, gat + red, rel_tol=1e-9)


def test_expert_gradients_are_reduced_after_the_backward(tmp_path, constant_rates):
    """An MoE model at dp2 (ep 1: the experts' gradients reduced over an expert-data-parallel group of 2), buckets
    of 1000 elements (one piece a layer for the dense gradients): the wrapper starts no expert bucket early (an
    expert without tokens on a rank fires no hook there; ``ddp.py`` reduces them in ``finish_grad_sync``), so the
    experts' reduction runs after the rank's last backward, behind the dense gradients' tail: under ``dp`` the
    exposed time is the gather, the dense tail and the experts' reduction whole. Before 2026-12-07 the plan hid the
    experts' reduction with the dense one, a layer at a time."""
    from omnitron.plan.speed import _stage_costs, dp_parts, predict

    rates = constant_rates(tmp_path, 0.5, 0.01)  # links fast enough that the dense reduction hides in part
    s, cfg = _tiny({"bucket_size": 1000, "num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01})
    L = cfg.num_layers
    red, gat, experts = dp_parts(s, cfg, rates, 0, [True] * L)
    B = _stage_costs(s, rates, "dp")[2][0].total("B", "dp")
    assert red > 0 and gat > 0 and experts > 0 and _tails(B, red + experts, L) < red + experts  # the case
    dp = predict(s, rates, "dp")
    assert math.isclose(dp.dp, gat + _tails(B, red, L) + experts, rel_tol=1e-9)
