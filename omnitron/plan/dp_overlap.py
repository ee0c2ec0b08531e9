"""How much of a step's data-parallel communication the pipeline's own work hides, rank by rank.

The data-parallel wrapper (:mod:`omnitron.core.parallel.data.ddp`, as Megatron's) reduces each model chunk's gradient
buckets during that chunk's last backward (``--overlap-grad-reduce``: a bucket starts when its last gradient is
ready, the chunk's ``is_last_microbatch`` set by the pipeline runtime), one collective after another on the
data-parallel communicator; with the distributed optimizer the parameters are all-gathered after the optimizer
step and each layer waits only for its own buckets in the next step's forward (``--overlap-param-gather``). So:

- **reduction**: chunk ``c``'s share of the rank's reduction (its part of the backward work) becomes ready in
  ``n`` equal pieces over its last backward (one per layer, the backward running from the last layer to the
  first, but no more than its gradient buckets: a bucket is reduced once its last gradient is ready, so a chunk
  whose gradients fill one bucket reduces it whole after its backward), which ends at ``e_c`` on the pipeline's
  timeline; the expert gradients' buckets are not started early (their hooks fire on the ranks whose experts got
  tokens only, so the wrapper reduces them when the step's backward is done, ``finish_grad_sync``): they are
  ready at the rank's last action; the pieces are reduced in order of readiness, each
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


def _each(pieces, chunks: int) -> list[int]:
    """``pieces`` per chunk: a list as given, or one count for every chunk."""
    return list(pieces) if isinstance(pieces, (list, tuple)) else [pieces] * chunks


def reduce_tail(marks, shares, reduce_s: float, end: float, pieces, late: float = 0.0) -> float:
    """Seconds the rank's gradient reduction (``reduce_s`` in all, chunk ``c`` its ``shares[c]``) runs past
    ``end``, each chunk's share ready in ``pieces`` parts (per chunk, or one count for all) over its last backward,
    and ``late`` seconds more (the expert gradients' buckets) ready at ``end`` (module docstring)."""
    ready = [(end, late)] if late else []
    for (_, _, e, d), w, n in zip(marks, shares, _each(pieces, len(marks))):
        ready += [(e - d + d * (j + 1) / n, reduce_s * w / n) for j in range(n)]
    t = 0.0
    for at, size in sorted(ready):
        t = max(t, at) + size
    return max(0.0, t - end)


def gather_delay(marks, shares, gather_s: float, pieces) -> float:
    """Seconds the rank's first forward work waits for its parameters' all-gather (``gather_s`` in all), issued at
    the step's start in chunk order, each chunk in ``pieces`` parts (per chunk, or one count for all) needed as its
    first forward reaches them."""
    t, late = 0.0, 0.0
    for (s, f, _, _), w, n in zip(marks, shares, _each(pieces, len(marks))):
        for j in range(n):
            t += gather_s * w / n
            late = max(late, t - (s + f * j / n))
    return late


def exposed(tl, ranks: dict[int, tuple], overlap: str) -> float:
    """The step's exposed data-parallel seconds beyond ``tl``'s makespan: ``ranks`` maps each pipeline rank to
    ``(reduction seconds, gather seconds, each chunk's share, each chunk's pieces[, the reduction's seconds that
    start at the rank's end])`` (the pieces: one count for every chunk, or a list)."""
    makespan, worst = tl.makespan, 0.0
    for r, (red, gat, shares, pieces, *late) in ranks.items():
        spans = tl.spans[r]
        if not spans:
            continue
        end = spans[-1][1]
        marks = chunk_marks(spans, len(shares))
        pieces = [max(1, n) for n in _each(pieces, len(shares))]
        delay = gather_delay(marks, shares, gat, pieces) if overlap in ("all", "megatron") else gat
        worst = max(worst, end + delay + reduce_tail(marks, shares, red, end, pieces, sum(late)))
    return max(0.0, worst - makespan)
