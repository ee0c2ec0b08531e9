"""How much of a step's data-parallel communication the pipeline's own work hides, rank by rank.

The data-parallel wrapper (:mod:`omnitron.core.parallel.data.ddp`, as Megatron's) reduces each model chunk's gradient
buckets during that chunk's last backward (``--overlap-grad-reduce``: a bucket starts when its last gradient is
ready, the chunk's ``is_last_microbatch`` set by the pipeline runtime), one collective after another on the
data-parallel communicator; with the distributed optimizer the parameters are all-gathered after the optimizer
step and each layer waits only for its own buckets in the next step's forward (``--overlap-param-gather``). So:

- **reduction**: chunk ``c``'s share of the rank's reduction (its part of the backward work) becomes ready in
  ``n`` equal pieces over its last backward (one per layer, the backward running from the last layer to the
  first), which ends at ``e_c`` on the pipeline's timeline; the pieces are reduced in order of readiness, each
  after the previous one. What runs past the rank's last action is exposed: with interleaved chunks the later
  chunks' reductions hide behind the earlier chunks' remaining backwards (the cool-down), with one chunk only
  the last layers' share behind its own last backward.
- **gather** (``all`` only): the parameters of chunk 0, then 1, ..., in ``n`` pieces each, start at the step's
  beginning; piece ``j`` of chunk ``c`` is needed when chunk ``c``'s first forward reaches its layer ``j``
  (``s_c + f_c j / n``). The largest lateness delays the rank's first forward work by that much. Under ``dp`` the
  gather is exposed whole (it cannot run behind the backward: it follows the optimizer step).

The step ends at the latest rank's last action plus its exposed time; what exceeds the pipeline's makespan is
the step's exposed data-parallel time. First-order: a delay at the start is not fed back through the pipeline's
dependencies, and the ranks' collectives are taken not to contend (each dp group is its own rank set).
"""
from __future__ import annotations


def chunk_marks(spans, chunks: int) -> list[tuple[float, float, float, float]]:
    """Per chunk ``(start of its first forward, that forward's seconds, end of its last backward, that backward's
    seconds)`` from one rank's timeline ``spans`` (``(start, end, action)``; a ``W`` action ends a split
    backward)."""
    first, last = {}, {}
    for s, e, a in spans:
        if a.kind == "F" and a.chunk not in first:
            first[a.chunk] = (s, e - s)
        if a.kind in ("B", "W") and (a.chunk not in last or e >= last[a.chunk][0]):
            last[a.chunk] = (e, e - s)
    return [(*first[c], *last[c]) for c in range(chunks)]


def reduce_tail(marks, shares, reduce_s: float, end: float, pieces: int) -> float:
    """Seconds the rank's gradient reduction (``reduce_s`` in all, chunk ``c`` its ``shares[c]``) runs past
    ``end``, each chunk's share ready in ``pieces`` parts over its last backward (module docstring)."""
    ready = []
    for (_, _, e, d), w in zip(marks, shares):
        ready += [(e - d + d * (j + 1) / pieces, reduce_s * w / pieces) for j in range(pieces)]
    t = 0.0
    for at, size in sorted(ready):
        t = max(t, at) + size
    return max(0.0, t - end)


def gather_delay(marks, shares, gather_s: float, pieces: int) -> float:
    """Seconds the rank's first forward work waits for its parameters' all-gather (``gather_s`` in all), issued at
    the step's start in chunk order, each chunk in ``pieces`` parts needed as its first forward reaches them."""
    t, late = 0.0, 0.0
    for (s, f, _, _), w in zip(marks, shares):
        for j in range(pieces):
            t += gather_s * w / pieces
            late = max(late, t - (s + f * j / pieces))
    return late


def exposed(tl, ranks: dict[int, tuple[float, float, list[float], int]], overlap: str) -> float:
    """The step's exposed data-parallel seconds beyond ``tl``'s makespan: ``ranks`` maps each pipeline rank to
    ``(reduction seconds, gather seconds, each chunk's share, layers per chunk)``."""
    makespan, worst = tl.makespan, 0.0
    for r, (red, gat, shares, layers) in ranks.items():
        spans = tl.spans[r]
        if not spans:
            continue
        end = spans[-1][1]
        marks = chunk_marks(spans, len(shares))
        pieces = max(1, layers)
        delay = gather_delay(marks, shares, gat, pieces) if overlap == "all" else gat
        worst = max(worst, end + delay + reduce_tail(marks, shares, red, end, pieces))
    return max(0.0, worst - makespan)
