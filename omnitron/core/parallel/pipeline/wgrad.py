"""Split a stage's backward into an input-gradient pass (B) and a weight-gradient pass (W).

B runs ``autograd.grad(output, input)`` with the graph retained; the engine then skips every
node that only leads to weights. Before it runs, a pre-hook is put on each *boundary* node: a
node on the input path with an edge into a weight-only part of the graph (e.g. a matmul's
backward, whose weight side B skips). The hooks keep the gradients flowing into those nodes.
W later back-propagates each kept gradient from its boundary node to that node's own
weights only (``torch.autograd.backward(GradientEdge, inputs=weights)``): the weight GEMMs,
not a second full backward, and the data-parallel hooks fire as usual.

When the graph does not split cleanly (a weight reachable from two boundaries, or also from
the input path) :func:`backward_input` returns a plan that makes W a plain backward to the
weights over the retained graph, which is always correct; its B then runs under
:func:`~omnitron.core.parallel.tensor.cross_entropy.backward_reruns`, so a loss keeps its logits for that second pass.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from omnitron.core.parallel.split_backward import holds_operands, mark
from omnitron.core.parallel.tensor.cross_entropy import backward_reruns


def _reach(root, targets: set) -> tuple[dict, list]:
    """For every node under ``root``: the subset of ``targets`` (leaf nodes) it reaches; and the
    nodes root-first (reverse post-order: deterministic, a valid backward order)."""
    memo: dict = {}
    order, stack, seen = [], [root], {root}
    while stack:  # iterative DFS post-order (graphs can be deep)
        node = stack[-1]
        pushed = False
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
                pushed = True
                break
        if not pushed:
            stack.pop()
            order.append(node)
    for node in order:
        got = {node} & targets
        for nxt, _ in node.next_functions:
            if nxt is not None:
                got |= memo[nxt]
        memo[node] = frozenset(got)
    return memo, order[::-1]


class WeightGradPlan:
    """What W needs: boundary nodes, their kept gradients and their weights (or a fallback)."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None, params: list) -> None:
        self.out, self.grad, self.params = out, grad, params
        self.boundaries: list[tuple[object, list[torch.nn.Parameter]]] = []
        self.kept: dict[object, tuple] = {}
        self.fallback = True

    def run(self) -> None:
        """Accumulate the weight gradients into ``.grad`` (firing post-accumulate hooks)."""
        if self.fallback:
            torch.autograd.backward(self.out, self.grad, inputs=self.params)
        else:
            for node, weights in self.boundaries:
                grads = self.kept.get(node)
                if grads is None:
                    continue
                edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
                if edges:
                    mark(node, "weight")  # a custom function's input gradient is B's (split_backward.py)
                    try:
                        torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=weights,
                                                retain_graph=True)
                    finally:
                        mark(node, None)
        self.out = self.grad = None
        self.kept.clear()


def backward_input(out: torch.Tensor | GradientEdge, grad: torch.Tensor | None, hidden: torch.Tensor | None,
                   params: list[torch.nn.Parameter]) -> tuple[torch.Tensor | None, WeightGradPlan]:
    """B: the gradient w.r.t. ``hidden`` now; returns it and the plan W runs later. ``out``: the chunk output
    or, once sent, its autograd edge (runtime.py's ``graph_root``). ``hidden`` None (virtual stage 0): no input
    gradient; W does the whole backward. Between the two, the plan holds the retained graph, ``grad`` and the
    gradients kept at the boundaries (what the memory plan's held W inputs price, omnitron/plan/transients.py)."""
    plan = WeightGradPlan(out, grad, params)
    if hidden is None:
        return None, plan
    root = out.node if isinstance(out, GradientEdge) else out.grad_fn
    leaves = {get_gradient_edge(p).node: p for p in params}
    input_leaf = get_gradient_edge(hidden).node
    handles = []
    if root is not None:
        reach, order = _reach(root, set(leaves) | {input_leaf})
        on_input = {n for n, r in reach.items() if input_leaf in r}
        index = {leaf: i for i, leaf in enumerate(leaves)}
        owner: dict = {}
        clean = True
        # NOTE: a fixed order (never set order, which follows memory addresses): W fires the
        # data-parallel hooks in this order, and every replica must start its buckets alike
        for node in (n for n in order if n in on_input):
            weight_side, input_side = set(), set()
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                (input_side if nxt in on_input else weight_side).update(reach[nxt] - {input_leaf})
            if not weight_side:
                continue
            if weight_side & input_side or any(leaf in owner for leaf in weight_side):
                clean = False
                break
            owner.update({leaf: node for leaf in weight_side})
            plan.boundaries.append((node, [leaves[leaf] for leaf in sorted(weight_side, key=index.get)]))
        if clean:
            plan.fallback = False
            for node, _ in plan.boundaries:
                handles.append(node.register_prehook(lambda g, node=node: plan.kept.__setitem__(node, g)))
                mark(node, "input")  # a custom function's weight gradient is W's (split_backward.py)
    try:
        # a fallback W re-runs the whole backward: the loss must not write its gradient over the logits in B
        with backward_reruns() if plan.fallback else contextlib.nullcontext():
            (g_in,) = torch.autograd.grad(out, hidden, grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        for node, _ in plan.boundaries:
            mark(node, None)
    if not plan.fallback:  # W starts from the boundaries: the received gradient and the nodes above them can go
        plan.out = plan.grad = None
        for node, kept in plan.kept.items():
            if holds_operands(node):  # B handed W what it reads (split_backward.py): a stand-in for the gradient
                plan.kept[node] = tuple(None if g is None else g.new_zeros(()).expand(g.shape) for g in kept)
    return g_in, plan
