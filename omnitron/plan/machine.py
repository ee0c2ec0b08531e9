"""A hierarchical machine: nodes of ``gpus_per_node`` devices, an intra-node link (NVLink / NVSwitch, xGMI, MTLink)
and one NIC per device between nodes (rail-optimised: device ``i`` of every node on rail ``i``), and the
collectives priced per algorithm across the levels a group spans.

Which devices a group holds follows the layout's rank order, Megatron's ``tp-cp-ep-dp-pp`` (tensor-parallel ranks
adjacent): a group's members are ``base + stride * i`` with ``stride`` the product of the sizes before its
dimension (:func:`strides`). Its :class:`Span` is the devices it has per node (``local``) and the nodes it spans.
So tp8 on 8-device nodes stays inside a node, while its dp group (stride 8) has one device on each node.

Prices (seconds; ``S`` bytes as nccl-tests counts them: the buffer for all-reduce, the gathered output for
all-gather, the input for reduce-scatter; ``B_i``, ``B_n`` the achieved intra-node and NIC bandwidth per device,
``a_i``, ``a_n`` per-step latencies, ``n = local x nodes``):

- **ring** (one ring over all ``n``): ``f S / B + steps x a``, ``f`` the bus factor (all-reduce ``2 (n-1)/n``,
  all-gather / reduce-scatter ``(n-1)/n``); ``B = B_i`` inside a node, else ``min(B_i, local x B_n)`` (NCCL runs
  one ring per NIC, so a node's ``local`` NICs carry its ring edges in parallel); ``a = a_n`` once the ring leaves
  the node.
- **direct** (all-to-all: no ring, every member sends ``S / n`` to each other one): ``(local-1)/n S`` over the
  intra-node link and ``(n-local)/n S`` through the device's own NIC at once, ``max((local-1)/n S / B_i,
  (n-local)/n S / B_n) + (n-1) a``: across nodes the NICs carry every byte that leaves the node, about ``local``
  times what a ring's edges would (inside a node the same as the ring's formula).
- **hierarchical** (``local > 1``, ``nodes > 1``): all-reduce = reduce-scatter inside the node, all-reduce of
  ``S / local`` across nodes on each device's own NIC, all-gather inside:
  ``2 (local-1)/local S / B_i + 2 (nodes-1)/nodes (S/local) / B_n``; all-gather and reduce-scatter the
  one-level halves of that.
- **tree** (all-reduce across nodes): the ring's bandwidth term with ``2 log2(nodes)`` inter-node steps, NCCL's
  double binary tree (it wins on latency only).

- **nvls** (all-reduce, where the profile's switch reduces: NVLink SHARP, ``nvls_efficiency`` ``e``): each
  device writes its buffer into the switch, which sums the ``local`` copies and multicasts the sum back, so a
  device's link carries ``(local-1)/local S`` out and as much in at once (full duplex), half the ring's
  ``2 (local-1)/local S`` each way: ``(local-1)/local S / (e B_link) + 2 a_i`` (two steps: the reduction and the
  multicast; ``B_link`` the datasheet's ``intra_gbs``, which ``e`` is measured against). Across nodes (NCCL's
  NVLS-tree) the hierarchical all-reduce's two intra-node halves are that one NVLS pass; the NICs' part is
  unchanged. All-gather and reduce-scatter move the same bytes either way and stay ring / hierarchical.

The cheapest algorithm is taken (NCCL's tuner picks per size too). Point-to-point: ``S / B + a`` on the link it
crosses (the intra-node ``p2p_gbs`` share, or the NIC). In-network reductions between nodes (SHARP on
InfiniBand switches, CollNet) are not modelled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

ORDER = ("tp", "cp", "ep", "dp", "pp")
"""Megatron's default rank order (``--rank-order`` is not an omnitron flag): tp fastest-varying."""


@dataclass(frozen=True)
class Span:
    """Where one group's ranks lie: ``local`` of them on each node, over ``nodes`` nodes."""

    size: int
    local: int
    nodes: int


@lru_cache(maxsize=4096)
def span(size: int, stride: int, gpus_per_node: int) -> Span:
    """The :class:`Span` of the group ``{stride * i : i < size}`` (the group holding rank 0; with sizes dividing
    one another every group of the dimension lies alike)."""
    per: dict[int, int] = {}
    for i in range(size):
        node = (stride * i) // gpus_per_node
        per[node] = per.get(node, 0) + 1
    return Span(size, max(per.values()), len(per))


def strides(tp: int, cp: int, dp: int, pp: int, ep: int = 1, etp: int = 1) -> dict[str, int]:
    """Stride of each group in the rank order ``tp-cp-ep-dp-pp``: the dense grid is tp-cp-dp-pp (experts
    re-partition its ranks: etp-ep-edp), ``dp`` the gradient group dp x cp (contiguous after tp), ``emb`` the
    first and last pipeline stage (the tied embedding's gradient)."""
    return {"tp": 1, "cp": tp, "dp": tp, "pp": tp * cp * dp, "ep": etp, "edp": etp * ep,
            "emb": max(1, (pp - 1) * tp * cp * dp)}


ALGORITHMS = ("ring", "hierarchical", "tree", "nvls")

_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
          "all_to_all": lambda n: n - 1, "broadcast": lambda n: n - 1}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (the bytes each device moves per byte of ``S``)."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    return (n - 1) / n


class Machine:
    """Prices collectives and point-to-point messages on ``links`` (:class:`omnitron.plan.profile.Links`) with
    ``gpus_per_node`` devices per node (module docstring)."""

    def __init__(self, links, gpus_per_node: int):
        self.links, self.gpn = links, gpus_per_node
        self.b_i = links.intra_bw * links.intra_eff
        self.b_n = links.nic_bw * links.nic_eff
        self.b_p2p = links.p2p_bw * links.intra_eff

    def ring(self, op: str, nbytes: float, sp: Span) -> float:
        if sp.nodes == 1:
            bw, lat = self.b_i, self.links.intra_latency
        else:
            bw = self.b_n if sp.local == 1 else min(self.b_i, sp.local * self.b_n)
            lat = self.links.inter_latency
        return bus_factor(op, sp.size) * nbytes / bw + _STEPS[op](sp.size) * lat

    def direct(self, nbytes: float, sp: Span) -> float:
        """All-to-all of ``nbytes`` per device (module docstring)."""
        n = sp.size
        intra = (sp.local - 1) / n * nbytes / self.b_i
        if sp.nodes == 1:
            return intra + (n - 1) * self.links.intra_latency
        return max(intra, (n - sp.local) / n * nbytes / self.b_n) + (n - 1) * self.links.inter_latency

    def hierarchical(self, op: str, nbytes: float, sp: Span) -> float:
        if sp.local == 1 or sp.nodes == 1 or op not in ("all_reduce", "all_gather", "reduce_scatter"):
            return math.inf
        k = 2 if op == "all_reduce" else 1
        intra = k * ((sp.local - 1) / sp.local * nbytes / self.b_i + (sp.local - 1) * self.links.intra_latency)
        return intra + self._across_nodes(op, nbytes, sp)

    def _across_nodes(self, op: str, nbytes: float, sp: Span) -> float:
        """The inter-node part of a hierarchical ``op``: each device's ``1 / local`` share over its own NIC."""
        k = 2 if op == "all_reduce" else 1
        per_nic = (sp.nodes - 1) / sp.nodes * nbytes / sp.local / self.b_n
        return k * (per_nic + (sp.nodes - 1) * self.links.inter_latency)

    def nvls(self, op: str, nbytes: float, sp: Span) -> float:
        """NVLink SHARP all-reduce (module docstring); inf where the switch does not reduce or the group has one
        device per node."""
        eff = self.links.nvls_eff
        if op != "all_reduce" or eff <= 0 or sp.local == 1:
            return math.inf
        intra = (sp.local - 1) / sp.local * nbytes / (self.links.intra_bw * eff) + 2 * self.links.intra_latency
        return intra + (self._across_nodes(op, nbytes, sp) if sp.nodes > 1 else 0.0)

    def tree(self, op: str, nbytes: float, sp: Span) -> float:
        if op != "all_reduce" or sp.nodes == 1:
            return math.inf
        bw = self.b_n if sp.local == 1 else min(self.b_i, sp.local * self.b_n)
        lat = 2 * math.ceil(math.log2(sp.nodes)) * self.links.inter_latency + 2 * (sp.local - 1) * \
            self.links.intra_latency
        return bus_factor(op, sp.size) * nbytes / bw + lat

    def collective(self, op: str, nbytes: float, sp: Span) -> tuple[float, str]:
        """(seconds, algorithm) of the cheapest algorithm for ``op`` of ``nbytes`` over the group ``sp``."""
        if sp.size <= 1 or nbytes <= 0:
            return 0.0, "none"
        if op == "all_to_all":
            return self.direct(nbytes, sp), "direct"
        return min((getattr(self, a)(op, nbytes, sp), a) for a in ALGORITHMS)

    def p2p(self, nbytes: float, crosses_nodes: bool) -> float:
        """One message of ``nbytes`` between two devices, on the NIC or inside the node."""
        if nbytes <= 0:
            return 0.0
        if crosses_nodes:
            return nbytes / self.b_n + self.links.inter_latency
        return nbytes / self.b_p2p + self.links.intra_latency

    def inter_node_bytes(self, op: str, nbytes: float, sp: Span) -> float:
        """Bytes each device sends over its NIC in the chosen algorithm (0 inside one node)."""
        if sp.nodes == 1 or sp.size <= 1:
            return 0.0
        _, algo = self.collective(op, nbytes, sp)
        if algo in ("hierarchical", "nvls"):
            return (2 if op == "all_reduce" else 1) * (sp.nodes - 1) / sp.nodes * nbytes / sp.local
        return bus_factor(op, sp.size) * nbytes / max(1, sp.local)
