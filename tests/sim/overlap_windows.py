"""Worker for tests/sim/test_sim_plan_overlap.py: which of a real step's collectives have compute issued while they
are in flight (between the call that issues one and the wait that ends it), on the sim device."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "matmul"}
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_gather_in_place", "all_gather_list", "broadcast",
       "all_to_all", "batch_p2p")


class _Gemms(TorchDispatchMode):
    """Appends one ``("gemm",)`` entry to ``log`` for every GEMM or attention kernel issued (in the threads that
    carry the mode)."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in GEMMS or "attention" in name:
            self.log.append(("gemm",))
        return func(*args, **(kwargs or {}))


class _Waited:
    """A collective's handle that notes its wait in the log (other attributes: the handle's)."""

    def __init__(self, handle, log: list, i: int) -> None:
        self._handle, self._log, self._i = handle, log, i

    def wait(self, *a, **k):
        self._log.append(("wait", self._i))
        return self._handle.wait(*a, **k)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def _patched(coll, names: dict, log: list) -> None:
    """Instance attributes over ``coll``'s collectives that log each call's issue (and its handles' waits)."""
    for op in OPS:
        if not hasattr(coll, op):
            continue
        fn = getattr(coll, op)

        def call(*a, _fn=fn, _op=op, **k):
            group = names.get(id(k.get("group")), "other")
            kinds = [o[0] for o in (a[0] if a else k["ops"])] if _op == "batch_p2p" else [_op]  # one per handle
            first = sum(1 for e in log if e[0] == "issue")
            for j, kind in enumerate(kinds):
                log.append(("issue", first + j, kind if torch.is_grad_enabled() else kind + "@bwd", group))
            out = _fn(*a, **k)
            if out is None:  # synchronous: done when the call returns
                log.append(("wait", first))
                return out
            if isinstance(out, list):
                return [_Waited(h, log, first + j) for j, h in enumerate(out)]
            return _Waited(out, log, first)
        setattr(coll, op, call)


def windows(argv: list[str], world: int) -> list[tuple[str, str, int]]:
    """``(op, group, GEMMs issued while in flight)`` of every collective of this rank's second training step (the
    first one warms the optimizer), in issue order."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import train_step

    s = parse_settings(argv, world)
    be = get_backend()
    c = build_components(s, be)
    it = data_iterator(c, c.train_data, 0)
    train_step(c, it)
    log: list = []
    names = {id(g.handle): name for name, g in c.groups.groups.items() if g.handle is not None}
    seen = set()
    for g in c.groups.groups.values():
        if g.collectives is not None and id(g.collectives) not in seen:
            seen.add(id(g.collectives))
            _patched(g.collectives, names, log)
    from omnitron.core.transformer.moe import overlap

    main = overlap._Backward._main

    def counted(self):  # a combined pair's backward runs in a thread of its own: count its GEMMs there too
        with _Gemms(log):
            main(self)
    overlap._Backward._main = counted
    try:
        with _Gemms(log):
            train_step(c, it)
    finally:
        overlap._Backward._main = main
    out, start, waited = [], {}, {}
    for pos, e in enumerate(log):
        if e[0] == "issue":
            start[e[1]] = (pos, e[2], e[3])
        elif e[0] == "wait" and e[1] not in waited:
            waited[e[1]] = pos
    for i, (pos, op, group) in sorted(start.items()):
        end = waited.get(i, len(log))
        out.append((op, group, sum(1 for e in log[pos:end] if e[0] == "gemm")))
    return out
