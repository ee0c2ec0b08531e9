"""A model of NCCL's rule for a communicator's point-to-point groups, to replay logged ``batch_isend_irecv`` groups.

Each rank's groups on a communicator run one after another, as on one stream; an operation completes when it and
its partner are both in the group at the head of their rank's stream; a group completes when all its operations
have; the k-th send from rank a to rank b pairs with the k-th receive on b from a (NCCL ignores tags). Every
payload is taken as too large for NCCL's buffers (the worst case: a send waits for its receive), so a program that
finishes here finishes on NCCL at any size. The reference for tests/backends/test_strict_nccl_groups.py (strict
mode's own groups) and tests/sim/test_sim_group_order.py (sim's run-time checks: csrc/sim/group_order.cpp per pair,
csrc/sim/cycle.cpp across three or more ranks, and the tags compared in csrc/sim/pair_order.cpp).
"""
from __future__ import annotations


def _locate(logs: list) -> tuple[dict, list]:
    """Each operation's pairing key ``(sender, receiver, k)`` -> {rank: (group index, op index, tag)}."""
    where, count = {}, {}
    for r, groups in enumerate(logs):
        for g, ops in enumerate(groups):
            for o, (kind, peer, tag) in enumerate(ops):
                pair = (r, peer) if kind == "send" else (peer, r)
                k = count[(r, kind, pair)] = count.get((r, kind, pair), -1) + 1
                where.setdefault((*pair, k), {})[r] = (g, o, tag)
    return where, count


def replay(logs: list) -> str | None:
    """Replay the groups of every rank (``logs[rank] = [[(kind, peer, tag)]]``) under NCCL's rule; None when
    every group completed, else a description of the stuck heads or of a mispairing."""
    where, _ = _locate(logs)
    for key, ends in where.items():
        if len(ends) != 2:
            return f"transfer {key} has no partner: {ends}"
        (ra, (_, _, ta)), (rb, (_, _, tb)) = ends.items()
        if ta != tb:
            return f"transfer {key}: NCCL pairs tag {ta} on rank {ra} with tag {tb} on rank {rb}"
    partner = {}
    for key, ends in where.items():
        (ra, a), (rb, b) = ends.items()
        partner[(ra, a[0], a[1])], partner[(rb, b[0], b[1])] = (rb, b[0], b[1]), (ra, a[0], a[1])
    head, done = [0] * len(logs), set()
    progress = True
    while progress:
        progress = False
        for r, groups in enumerate(logs):
            if head[r] == len(groups):
                continue
            g = head[r]
            for o in range(len(groups[g])):
                q, gq, oq = partner[(r, g, o)]
                if (r, g, o) not in done and head[q] == gq:
                    done |= {(r, g, o), (q, gq, oq)}
                    progress = True
            if all((r, g, o) in done for o in range(len(groups[g]))):
                head[r] += 1
                progress = True
    stuck = [f"rank {r} at group {head[r]} {logs[r][head[r]]}" for r in range(len(logs)) if head[r] < len(logs[r])]
    return "deadlock: " + "; ".join(stuck) if stuck else None
