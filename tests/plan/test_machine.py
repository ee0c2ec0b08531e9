"""The hierarchical machine (omnitron/plan/machine.py): collectives across two nodes cost what their formulas give
from the two link bandwidths (worked by hand below), a tp group inside a node moves nothing between nodes, the
layout's rank order (tp-cp-ep-dp-pp) decides which groups cross nodes, and pipeline messages are priced on the
link they cross."""
from __future__ import annotations

import math

import pytest

from omnitron.plan.machine import Machine, span, strides
from omnitron.plan.profile import Links

GB = 1e9
# intra-node 100 GB/s, NIC 10 GB/s per device, both reached in full; no latency (so the hand sums are exact)
LINKS = Links("switch", 100 * GB, 1.0, 0.0, "nic", 10 * GB, 1.0, 0.0, 100 * GB)


def test_all_reduce_over_two_nodes_by_hand():
    """dp16 on two 8-device nodes, 1 GB all-reduce.
    ring: busbw = min(100, 8 nodes' NICs x 10 = 80) GB/s; 2 x 15/16 x 1 GB / 80 GB/s = 23.4375 ms.
    hierarchical: intra reduce-scatter + all-gather 2 x 7/8 x 1 GB / 100 GB/s = 17.5 ms, plus the inter-node
    all-reduce of 1/8 GB on each device's NIC 2 x 1/2 x 0.125 GB / 10 GB/s = 12.5 ms: 30 ms. Ring wins."""
    m, sp = Machine(LINKS, 8), span(16, 1, 8)
    assert (sp.local, sp.nodes) == (8, 2)
    assert math.isclose(m.ring("all_reduce", GB, sp), 23.4375e-3)
    assert math.isclose(m.hierarchical("all_reduce", GB, sp), 30e-3)
    t, algo = m.collective("all_reduce", GB, sp)
    assert algo == "ring" and math.isclose(t, 23.4375e-3)


def test_hierarchical_wins_when_the_nodes_links_are_slow():
    """With a 40 GB/s intra-node link the ring is capped at 40 GB/s: 2 x 15/16 / 40 = 46.875 ms; hierarchical:
    2 x 7/8 / 40 = 43.75 ms + 12.5 ms = 56.25 ms, still more. With 4 devices per node over 4 nodes and a 50 GB/s
    intra link: ring min(50, 4 x 10) = 40 GB/s, 2 x 15/16 / 40 = 46.875 ms; hierarchical 2 x 3/4 / 50 = 30 ms +
    2 x 3/4 x 0.25 / 10 = 37.5 ms: 67.5 ms. A one-device-per-node group (stride 8) is on the NICs only:
    2 x 1/2 x 1 GB / 10 GB/s = 100 ms."""
    slow = Links("switch", 40 * GB, 1.0, 0.0, "nic", 10 * GB, 1.0, 0.0, 40 * GB)
    m = Machine(slow, 8)
    assert math.isclose(m.ring("all_reduce", GB, span(16, 1, 8)), 46.875e-3)
    assert math.isclose(m.hierarchical("all_reduce", GB, span(16, 1, 8)), 56.25e-3)
    m4 = Machine(Links("switch", 50 * GB, 1.0, 0.0, "nic", 10 * GB, 1.0, 0.0, 50 * GB), 4)
    assert math.isclose(m4.ring("all_reduce", GB, span(16, 1, 4)), 46.875e-3)
    assert math.isclose(m4.hierarchical("all_reduce", GB, span(16, 1, 4)), 67.5e-3)
    assert math.isclose(Machine(LINKS, 8).collective("all_reduce", GB, span(2, 8, 8))[0], 100e-3)


def test_all_gather_over_two_nodes_by_hand():
    """1 GB gathered over 16 devices on two nodes: ring 15/16 x 1 GB / 80 GB/s = 11.71875 ms; hierarchical
    1/2 x 0.125 GB / 10 GB/s + 7/8 x 1 GB / 100 GB/s = 6.25 + 8.75 = 15 ms."""
    m, sp = Machine(LINKS, 8), span(16, 1, 8)
    assert math.isclose(m.collective("all_gather", GB, sp)[0], 11.71875e-3)
    assert math.isclose(m.hierarchical("all_gather", GB, sp), 15e-3)


def test_tp8_inside_a_node_moves_nothing_between_nodes():
    """tp8 (stride 1) on 8-device nodes spans one node: no NIC bytes, and its all-reduce is the intra-node ring
    2 x 7/8 x 1 GB / 100 GB/s = 17.5 ms."""
    m = Machine(LINKS, 8)
    sp = span(8, strides(8, 1, 16, 4)["tp"], 8)
    assert sp.nodes == 1 and m.inter_node_bytes("all_reduce", GB, sp) == 0.0
    assert math.isclose(m.collective("all_reduce", GB, sp)[0], 17.5e-3)
    wide = span(16, 1, 8)  # tp16 would cross
    assert wide.nodes == 2 and m.inter_node_bytes("all_reduce", GB, wide) > 0


@pytest.mark.parametrize("tp,cp,dp,pp,gpn,crossing", [
    (8, 1, 4, 2, 8, {"dp", "pp"}),        # tp fills the node: every other group crosses
    (2, 1, 4, 2, 8, {"pp"}),              # tp2 x dp4 fill the node: only pp crosses
    (1, 1, 8, 2, 8, {"pp"}),
    (4, 2, 2, 2, 8, {"dp", "pp"}),        # cp (stride 4) stays inside; dp x cp (stride 4, size 4) crosses
    (2, 2, 2, 4, 16, {"pp"}),
])
def test_rank_order_decides_which_groups_cross_nodes(tp, cp, dp, pp, gpn, crossing):
    """Groups of the tp-cp-ep-dp-pp order: tp stride 1, cp stride tp, the dp x cp gradient group stride tp,
    pp stride tp x cp x dp."""
    st = strides(tp, cp, dp, pp)
    size = {"tp": tp, "cp": cp, "dp": dp * cp, "pp": pp}
    got = {g for g, n in size.items() if n > 1 and span(n, st[g], gpn).nodes > 1}
    assert got == crossing


def test_pipeline_message_priced_on_the_link_it_crosses():
    """A 100 MB activation: between stages on one node at the intra-node share (1 ms at 100 GB/s), across
    nodes on the NIC (10 ms at 10 GB/s); through DeviceRates, pp2 inside a node (tp1 dp4 on 8 devices) vs.
    pp2 across nodes (tp8)."""
    from types import SimpleNamespace

    from omnitron.plan.device_rates import DeviceRates

    m = Machine(LINKS, 8)
    assert math.isclose(m.p2p(100e6, False), 1e-3) and math.isclose(m.p2p(100e6, True), 10e-3)
    prof = SimpleNamespace(links=LINKS)
    r = DeviceRates(prof, 8)
    r.sizes = strides(1, 1, 4, 2)
    assert math.isclose(r.comm_s("p2p", 100e6, 2, group="pp"), 1e-3)
    r.sizes = strides(8, 1, 1, 2)
    assert math.isclose(r.comm_s("p2p", 100e6, 2, group="pp"), 10e-3)


def test_nvls_all_reduce_by_hand():
    """NVLink SHARP on a switch that reduces (links 100 GB/s a direction, rings reach 0.8 of it, NVLS 0.5; 5 us
    a step inside the node). tp8, 1 GB all-reduce: ring 2 x 7/8 x 1 GB / 80 GB/s + 14 x 5 us = 21.945 ms; NVLS
    sends 7/8 GB into the switch while the sum comes back: 7/8 x 1 GB / 50 GB/s + 2 x 5 us = 17.51 ms, chosen.
    All-gather moves the same bytes either way: no NVLS. A switch without it (efficiency 0) keeps the ring."""
    nv = Links("switch", 100 * GB, 0.8, 5e-6, "nic", 25 * GB, 1.0, 0.0, 100 * GB, nvls_eff=0.5)
    m, sp = Machine(nv, 8), span(8, 1, 8)
    assert math.isclose(m.ring("all_reduce", GB, sp), 21.875e-3 + 70e-6)
    assert math.isclose(m.nvls("all_reduce", GB, sp), 17.5e-3 + 10e-6)
    assert m.collective("all_reduce", GB, sp) == (pytest.approx(17.51e-3), "nvls")
    assert m.nvls("all_gather", GB, sp) == math.inf and m.collective("all_gather", GB, sp)[1] == "ring"
    plain = Machine(Links("switch", 100 * GB, 0.8, 5e-6, "nic", 25 * GB, 1.0, 0.0, 100 * GB), 8)
    assert plain.nvls("all_reduce", GB, sp) == math.inf and plain.collective("all_reduce", GB, sp)[1] == "ring"


def test_nvls_across_two_nodes_by_hand():
    """dp16 on two 8-device nodes, 1 GB, NICs 25 GB/s, no latency. ring: min(80, 8 x 25) = 80 GB/s,
    2 x 15/16 / 80 = 23.4375 ms. hierarchical: 2 x 7/8 / 80 = 21.875 ms + the NICs' all-reduce of 1/8 GB,
    2 x 1/2 x 0.125 / 25 = 5 ms: 26.875 ms. NVLS-tree: the intra-node halves as one NVLS pass, 7/8 / 50 =
    17.5 ms + 5 ms = 22.5 ms: chosen, with 0.125 GB on each NIC. One device per node (stride 8): no NVLS."""
    nv = Links("switch", 100 * GB, 0.8, 0.0, "nic", 25 * GB, 1.0, 0.0, 100 * GB, nvls_eff=0.5)
    m, sp = Machine(nv, 8), span(16, 1, 8)
    assert math.isclose(m.ring("all_reduce", GB, sp), 23.4375e-3)
    assert math.isclose(m.hierarchical("all_reduce", GB, sp), 26.875e-3)
    assert math.isclose(m.nvls("all_reduce", GB, sp), 22.5e-3)
    assert m.collective("all_reduce", GB, sp)[1] == "nvls"
    assert math.isclose(m.inter_node_bytes("all_reduce", GB, sp), 0.125 * GB)
    assert m.nvls("all_reduce", GB, span(2, 8, 8)) == math.inf


@pytest.mark.parametrize("name,algo", [("h100-sxm", "nvls"), ("h200", "nvls"), ("b200", "nvls"),
                                       ("a100-80gb-sxm", "ring"), ("mi300x", "ring")])
def test_profiles_price_tp8_all_reduce_with_nvls_where_the_switch_reduces(name, algo):
    """A 1 GiB tp8 all-reduce inside one node through the profile: NVLS on NVSwitch 3 / 4 (H100, H200, B200),
    rings elsewhere. On H100 the NVLS bus bandwidth nccl-tests would report (S x 2 (n-1)/n / t) is within the
    470-490 GB/s the profile cites, and the ring's at its 360 (0.8 x 450) less 42 us of steps: above 350. At 8 GiB
    (the size where all_reduce_perf peaks) H200's is within 470-490 (nccl-tests issue 272: 475 GB/s, 8 x H200,
    NCCL 2.20.3) and B200's within 805-850 (nccl issue 1807: "830+" on 8 x B200 with NCCL 2.27.1, less 3% for the
    reading of "+" and the NCCL version; a GB200 NVL72 rack, the same switch generation, peaked at 847). Where the
    NIC is NDR 400 Gb/s, a two-node all-reduce with one device a node reports 46-48 GB/s, what an NCCL maintainer
    says NDR should give per NIC (nccl-tests issue 290)."""
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.profile import load

    prof = load(name)
    r = DeviceRates(prof, 8)
    r.sizes = strides(8, 1, 4, 1)
    S = 2**30
    t = r.comm_s("all_reduce", S, 8, group="tp")
    assert r.machine.collective("all_reduce", S, span(8, 1, 8)) == (t, algo)
    if name == "h100-sxm":
        assert 470e9 <= S * 2 * 7 / 8 / t <= 490e9
        assert 350e9 <= S * 2 * 7 / 8 / r.machine.ring("all_reduce", S, span(8, 1, 8)) <= 370e9
    big = 8 * S
    busbw = big * 2 * 7 / 8 / r.comm_s("all_reduce", big, 8, group="tp")
    published = {"h200": (470e9, 490e9), "b200": (805e9, 850e9)}
    if name in published:
        lo, hi = published[name]
        assert lo <= busbw <= hi, busbw
    if name in ("h100-sxm", "h200", "b200"):  # NDR InfiniBand: "46-48GB/s per NIC" (nccl-tests issue 290)
        t = r.machine.collective("all_reduce", big, span(2, 8, 8))[0]
        assert 46e9 <= big * 2 * 1 / 2 / t <= 48e9


def test_all_to_all_over_two_nodes_by_hand():
    """1 GB a device all-to-all over 16 devices on two nodes: each device sends 1/16 GB to each other; 7/16 GB over
    the 100 GB/s switch (4.375 ms) and 8/16 GB through its 10 GB/s NIC (50 ms) at once: 50 ms, against the ring
    formula's 15/16 GB / 80 GB/s = 11.72 ms (no ring carries an all-to-all). Inside one node, the ring's
    formula: 7/8 GB / 100 GB/s = 8.75 ms. One device per node (stride 8): the NIC alone, 1/2 GB / 10 GB/s."""
    m = Machine(LINKS, 8)
    assert m.collective("all_to_all", GB, span(16, 1, 8)) == (pytest.approx(50e-3, rel=1e-12), "direct")
    assert math.isclose(m.collective("all_to_all", GB, span(8, 1, 8))[0], 8.75e-3)
    assert math.isclose(m.collective("all_to_all", GB, span(2, 8, 8))[0], 50e-3)
    assert math.isclose(m.collective("all_to_all", GB, span(64, 1, 8))[0], 56 / 64 / 10)  # 8 nodes: 56/64 leave
