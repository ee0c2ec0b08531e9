"""The MoE layer's memory term (:mod:`omnitron.plan.moe_activations`) worked by hand: the formula on fixed probe rates,
and the probe rates against the tensors the engine's router and SwiGLU experts save (counted from the code path).
The models against measured bytes are in test_activations.py, test_tp_activations.py and test_transients.py."""
from __future__ import annotations

import json

import pytest
import torch

from omnitron.core.models.gpt.presets import llama_tiny


def _cfg(**kw):
    return llama_tiny(hidden_size=16, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=24, num_experts=4,
                      moe_router_topk=2, **kw)


@pytest.fixture
def fixed_rates(monkeypatch):
    import omnitron.plan.moe_activations as M

    def rates(cfg, tp, etp):  # the shared expert's rate is 0 without one, as the probe's
        return M.MoERates(rho=10, rho0=3, expert=7, shared=5 if cfg.moe_shared_expert_intermediate_size else 0,
                          dense=11)

    monkeypatch.setattr(M, "moe_rates", rates)


def test_layer_extra_tp2_sp_ep2_etp2_by_hand(fixed_rates):
    """h 16, fp32 (e 4), E 4, k 2, shared 8; s 8, b 2 (T 16), tp2 + SP, ep2, etp2. Balanced: 8 rows an expert,
    A = 4 x 8 / 2 = 16 dispatched, R_e = 2 A = 32 at the experts, the router on T / 2 = 8 tokens.
    router 10 x 8 + 3 x 2 = 86; pairs, weights, mul and index_add inputs 16 (16 + 4 + 2 x 16 x 4) = 2368;
    expert rows 32 (16 x 4 + 7) = 2272; ep permutations 16 x 16 = 256; etp permutations 16 x 32 = 512;
    shared 16 x 5 = 80; inputs under SP: the norm output's shard 8 x 16 x 4 = 512 (one storage: the router's and
    the shared fc1's, which saves its input shard since 2026-12-05; before, its all-gathered 16 x 16 x 4 = 1024
    more); minus the dense MLP: its fc1's input shard 8 x 16 x 4 = 512 and 16 x 11 = 176: 5398. Backward's etp
    all-gather: 2 x 32 x 16 x 4 = 4096."""
    from omnitron.plan.moe_activations import moe_exchange_transient, moe_layer_extra

    cfg = _cfg(moe_shared_expert_intermediate_size=8)
    assert moe_layer_extra(cfg, 8, 2, tp=2, sp=True, ep=2, etp=2) == 5398
    assert moe_exchange_transient(cfg, 8, 2, tp=2, sp=True, ep=2, etp=2) == 4096
    assert moe_exchange_transient(cfg, 8, 2, tp=2, sp=True, ep=2, etp=1) == 0


@pytest.mark.parametrize("router_dtype", [None, "fp32"])
def test_layer_extra_bf16_capacity_bias_by_hand(fixed_rates, router_dtype):
    """bf16 (e 2), fc biases, no shared expert, capacity factor 0.5: each expert keeps ceil(0.5 x 16 x 2 / 4) = 4
    of its 8 rows, A = R_e = 16; tp1, ep1. router 10 x 16 + 3 x 2 = 166; pairs etc. 16 (16 + 2 + 2 x 16 x 2) =
    1312; rows 16 (16 x 2 + 7) = 624; bias index 8 x 16 = 128; minus the dense MLP 16 (16 x 2 + 11) = 688: 1542.
    The norm output: a router in the model's dtype (the default) keeps it, 16 x 16 x 2 = 512 more: 2054; with
    --moe-router-dtype fp32 the router keeps its float32 copy instead (in its rate) and nothing keeps the norm
    output (no shared expert): 1542."""
    from omnitron.plan.moe_activations import moe_layer_extra

    cfg = _cfg(params_dtype=torch.bfloat16, add_bias_linear=True, moe_expert_capacity_factor=0.5,
               moe_router_dtype=router_dtype)
    assert moe_layer_extra(cfg, 8, 2, tp=1, sp=False, ep=1, etp=1) == (1542 if router_dtype else 2054)


@pytest.mark.host_only("the probe's rates are the cpu kernel table's saved tensors, which the planner models; on "
                       "sim the fused activation kernel saves a third more per expert row (issue 34)")
@pytest.mark.parametrize("dtype,router_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, "fp32")])
def test_probe_rates_are_the_saved_tensors(dtype, router_dtype):
    """The probes against the code path's tensors, counted by hand: the softmax router with a load-balancing loss
    saves per token the [E] float32 scores of the loss, the top-k's int64 indices and float32 probabilities (the
    softmax's output; a bf16 router casts them after), plus, with --moe-router-dtype fp32 in bf16, its float32 input
    copy [h]; per micro-batch the loss's [E] counts and token count (plus, fp32 in bf16, the float32 copy of the
    [E, h] weight); a SwiGLU expert of width w saves per row its fc1 output [2 w] (the activation's input) and the
    activation's [w] (fc2's input)."""
    from omnitron.plan.moe_activations import moe_rates

    h, E, k, w, e = 128, 8, 2, 352, dtype.itemsize
    cfg = llama_tiny(num_experts=E, moe_router_topk=k, moe_aux_loss_coeff=0.01, params_dtype=dtype,
                     moe_shared_expert_intermediate_size=64, moe_router_dtype=router_dtype)
    r = moe_rates(cfg, 2, 2)
    copy = e != 4 and router_dtype == "fp32"
    assert r.rho == 4 * E + 12 * k + copy * 4 * h
    assert r.rho0 == 4 * E + 4 + copy * 4 * E * h
    assert r.expert == 3 * (w // 2) * e and r.dense == 3 * (w // 2) * e and r.shared == 3 * (64 // 2) * e


def test_busiest_ep_rank_bytes_by_hand(fixed_rates):
    """Routing histogram (1/2, 1/4, 1/8, 1/8) (counts 4:2:1:1 times a random n), fp32 h 16, E 4, k 2, s 8, b 2 (T 16,
    T k = 32), tp1, ep2: expert rows c = 16, 8, 4, 4 of each rank's micro-batch; ep rank 0 holds experts 0-1 and
    receives both ranks' rows for them, R = 2 (16 + 8) = 48 (rank 1: 16; balanced 32); each rank dispatches A = 32.
    router 10 x 16 + 3 x 2 = 166; pairs etc. 32 (16 + 4 + 2 x 16 x 4) = 4736; expert rows R (16 x 4 + 7) = 71 R;
    ep permutations 16 R; the norm output (fp32) 16 x 16 x 4 = 1024; minus the dense MLP 16 (64 + 11) = 1200:
    4726 + 87 R = 8902 (rank 0), 6118 (rank 1), 7510 (balanced, their mean). Capacity factor 1.0 (cap 8): c = 8,
    8, 4, 4, A = 24, R = 32 on rank 0: 166 + 24 x 148 + 87 x 32 - 176 = 6326; padded to it: A = 32, R = 32 on both
    ranks: the balanced 7510. etp2 (tp1): every local expert's rows gathered over 2 etp ranks, R_e = 2 R = 96 on
    rank 0, the backward's buffers 2 x 96 x 16 x 4 = 12288."""
    import random

    from omnitron.plan.moe_activations import moe_exchange_transient, moe_layer_extra

    n = random.randint(1, 9)
    share = tuple(v / (8 * n) for v in (4 * n, 2 * n, n, n))
    cfg = _cfg()
    assert [moe_layer_extra(cfg, 8, 2, 1, False, 2, 1, share, r) for r in (0, 1)] == [8902, 6118]
    assert moe_layer_extra(cfg, 8, 2, 1, False, 2, 1, share) == 8902  # the busiest when none is named
    assert moe_layer_extra(cfg, 8, 2, 1, False, 2, 1) == 7510
    capped = _cfg(moe_expert_capacity_factor=1.0)
    assert moe_layer_extra(capped, 8, 2, 1, False, 2, 1, share, 0) == 6326
    padded = _cfg(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert [moe_layer_extra(padded, 8, 2, 1, False, 2, 1, share, r) for r in (0, 1)] == [7510, 7510]
    assert moe_exchange_transient(cfg, 8, 2, 1, False, 2, 2, share, 0) == 12288


def test_estimate_prices_each_stage_on_its_busiest_ep_rank(fixed_rates, tmp_path):
    """A two-layer MoE model (fp32 h 64, s 32, b 2: T k = 128), ep2, pp1, histogram rows (4:2:1:1, flat): layer 0
    puts R = 2 (64 + 32) = 192 rows on ep rank 0 (balanced 128), layer 1 balanced; rank 0's activations exceed the
    balanced stage's by 64 (64 x 4 + 7 + 16 + 8) = 18368 bytes (rows, their MLP rate, the ep permutations and
    the fc2 biases' index: GPT's linears have biases; transients off). Rows reversed (1:1:2:4), rank 1 is the
    busiest by as much; flat rows price balanced. Three rows for two MoE layers (two 4:2:1:1, one flat): every
    layer at the rows' mean, 2/3 of the excess each (the bytes are linear in the rows)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate
    from omnitron.plan.routing import read_expert_load

    from tests.plan.test_moe_speed import _args

    s = parse_settings(_args(str(tmp_path), ["--expert-model-parallel-size", "2"]), 2)
    plain = estimate(s, transients=False)[0]
    for rows, rank in (([4, 2, 1, 1], 0), ([1, 1, 2, 4], 1)):
        path = tmp_path / "load.json"
        path.write_text(json.dumps({"tokens_per_expert": [rows, [1, 1, 1, 1]]}))
        got = estimate(s, transients=False, load=read_expert_load(str(path)))[0]
        assert (got.ep_rank, got.activations - plain.activations, got.balanced) == (rank, 18368, plain.total)
        assert got.total - plain.total == 18368
    path.write_text(json.dumps({"tokens_per_expert": [[4, 2, 1, 1], [8, 4, 2, 2], [1, 1, 1, 1]]}))  # 3 rows, 2 layers
    got = estimate(s, transients=False, load=read_expert_load(str(path)))[0]
    assert got.activations - plain.activations == round(2 * 2 * 18368 / 3)  # each layer at the rows' mean


def test_experts_backward_on_the_busiest_rank_by_hand():
    """The local experts' backward above what their forward left (omnitron/plan/moe_backward.py), fp32 h 16, SwiGLU
    f 24, no biases, worked from the code path: each expert saved its fc1 output ``[n, 2f]`` and activation ``[n, f]``,
    and the concatenated output ``[R, h]`` is held. Backward takes the output gradient ``[R, h]``, then the experts
    last to first; expert ``j``, after the later ones (each left ``(h - 3f) n_i``: its input gradient held, its saved
    tensors freed; their sum ``D``), peaks at the most of: fc2's weight gradient ``h f`` with the activation's
    gradient ``f n`` (m1), the fc1 output's gradient ``2f n`` once the activation's saved output is freed (m2), or
    fc1's weight gradient ``2 f h`` with the input gradient ``h n`` once the saved fc1 output and the activation's
    gradient are freed (m3): ``R h + D + max(h f + f n, 2 f n, 2 f h + (h - f) n)``.
    Rows (E 4, k 2, s 8, b 2, ep2, as test_busiest_ep_rank_bytes_by_hand): balanced 16, 16 (R 32): the last expert's
    m1 = m2 = 512 + 768 = 1280 elements, 5120 bytes. Histogram (1/8, 1/8, 1/4, 1/2): ep rank 1 holds rows 16, 32
    (R 48): m2 = 768 + 1536 = 2304, 9216 bytes, 4096 over balanced; rank 0 (8, 8; R 16): m3 = 256 + 768 - 64 = 960,
    under balanced: 0. Reversed (1/2, 1/4, 1/8, 1/8): rank 0 holds 32, 16: the last expert (16 rows) m1 = 768 + 768
    = 1536 (the first, D = -56 x 16, less), 6144 bytes: 1024 over; the hot expert's rows count less when it runs
    after the others have freed their saved tensors. At balanced routing nothing is added."""
    from omnitron.plan.moe_backward import backward_peak, skew_bytes

    cfg = _cfg()
    assert [backward_peak(cfg, rows, 16, 24) for rows in ([16, 16], [16, 32], [8, 8], [32, 16])] == \
        [5120, 9216, 3840, 6144]
    assert [skew_bytes(cfg, 8, 2, 1, False, 2, 1, (0.125, 0.125, 0.25, 0.5), r) for r in (0, 1)] == [0, 4096]
    assert [skew_bytes(cfg, 8, 2, 1, False, 2, 1, (0.5, 0.25, 0.125, 0.125), r) for r in (0, 1)] == [1024, 0]
    assert skew_bytes(cfg, 8, 2, 1, False, 2, 1, None, 0) == 0


def test_experts_backward_replay_equals_their_log_at_other_sizes():
    """The replay from the small probes (hidden 16, width 16, 8 rows an expert) at random rows per expert, hidden and
    width, bf16 with biases: the same peak as the experts' own log at those sizes (exact: every storage is linear in
    the rows and a monomial in the widths)."""
    import random

    from omnitron.plan.moe_backward import _BACKWARD, _events, backward_peak

    cfg = _cfg(params_dtype=torch.bfloat16, add_bias_linear=True)
    rows = [random.randint(0, 40) for _ in range(3)]
    h, f = random.choice([32, 48, 64]), random.choice([24, 40, 72])
    log = _events(cfg, h, f, rows)
    mark = log.index((_BACKWARD, 0))
    assert backward_peak(cfg, rows, h, f) == pytest.approx(_most_after(log, mark) - _live(log[:mark]), rel=1e-12,
                                                           abs=0), (rows, h, f)


def _live(events) -> float:
    live = 0.0
    for op, n in events:
        live += -events[n][1] if op is None else (n if not op.startswith("<") else 0)
    return live


def _most_after(events, mark: int) -> float:
    live, top = 0.0, 0.0
    for i, (op, n) in enumerate(events):
        live += -events[n][1] if op is None else (n if not op.startswith("<") else 0)
        if i >= mark:
            top = max(top, live)
    return top


@pytest.mark.parametrize("what", ["recompute", "mtp"])
def test_rematerialised_chunk_and_mtp_depths_on_the_busiest_ep_rank(fixed_rates, tmp_path, what):
    """test_estimate_prices_each_stage_on_its_busiest_ep_rank's model and histogram (layer 0 at 4:2:1:1, 18368
    bytes over balanced on ep rank 0; layer 1 flat), transients off. Full recomputation of one layer (block): layer 0
    keeps its input only, so the activations are balanced, and the rematerialised chunk is the stage's heaviest MoE
    layer at the rank's rows: 18368 over. One multi-token prediction depth: its MoE layer at the mean of the last
    chunk's rows (the histogram has none of its own), (18368 + 0) / 2 = 9184 over, beside layer 0's 18368."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate
    from omnitron.plan.routing import read_expert_load

    from tests.plan.test_moe_speed import _args

    extra = (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
             if what == "recompute" else ["--mtp-num-layers", "1", "--position-embedding-type", "rope"])
    s = parse_settings(_args(str(tmp_path), ["--expert-model-parallel-size", "2", *extra]), 2)
    plain = estimate(s, transients=False)[0]
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"tokens_per_expert": [[4, 2, 1, 1], [1, 1, 1, 1]]}))
    got = estimate(s, transients=False, load=read_expert_load(str(path)))[0]
    want = (0, 18368) if what == "recompute" else (18368 + 9184, 0)
    assert (got.ep_rank, got.activations - plain.activations, got.recompute - plain.recompute) == (0, *want)
    assert got.balanced == plain.total
