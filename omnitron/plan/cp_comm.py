"""One layer's context-parallel attention on one rank, per micro-batch, for each ``--cp-comm-type`` the engine runs
(:mod:`omnitron.core.transformer.cp_attention`): its collectives, its attention blocks, the element-wise work
beside them. The speed model prices these (:func:`omnitron.plan.speed._layer_routed`).

``x`` is the rank's :class:`~omnitron.plan.work.Local` (heads and key/value groups after tp, ``s / cp`` rows in the
load-balanced split: chunks ``r`` and ``2cp - 1 - r`` of ``c = s / 2cp`` rows each).

- ``p2p``, the ring (:mod:`omnitron.core.parallel.context.ring`): :func:`omnitron.plan.work.cp_ring`'s hops,
  :func:`~omnitron.plan.work.cp_blocks`' blocks and their merges.
- ``a2a``, Ulysses (:mod:`omnitron.core.parallel.context.ulysses`): forward, all-to-alls of q, k, v (heads for
  sequence; key/value heads that cp does not divide are repeated per query head first) and of the output back;
  backward the same four. One causal block over the whole sequence with ``1 / cp`` of the heads. The reorders
  (``index_select`` of q, k, v and of the output) are copy passes.
- ``allgather`` (Llama 3's): forward all-gathers of K and V (whole sequence), backward reduce-scatters of their
  gradients. Each of the rank's two chunks runs a full block against every earlier chunk's keys and a causal
  block against its own (:func:`omnitron.core.parallel.context.ulysses.allgather_tasks`); rank 1's blocks (every
  rank does the same FLOPs; all but rank 0 in four blocks). Merges where a chunk has two blocks; the
  gathered key / value gradients are accumulated (adds) and reordered (copies).
- ``a2a+p2p`` with ``--hierarchical-context-parallel-sizes A P`` (:mod:`omnitron.core.parallel.context.hierarchical`):
  the a2a's four all-to-alls over ``A`` consecutive cp ranks, then the ring over ``P`` of them on ``1 / A`` of the
  heads and super-chunks of ``A`` chunks (its hops on the ``cp_p2p`` group, stride ``tp A``).

Collectives are ``(op, bytes, ranks, group)``: nccl-tests' sizes (all-gather and reduce-scatter: the whole
gathered tensor; all-to-all: one rank's buffer) and the group whose stride places them
(:func:`omnitron.plan.machine.strides`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from omnitron.plan import work


@dataclass
class CpWork:
    """One layer's cp attention on one rank (module docstring)."""

    fwd: list[tuple[str, int, int, str]] = field(default_factory=list)
    bwd: list[tuple[str, int, int, str]] = field(default_factory=list)
    blocks: list[tuple[float, bool]] = field(default_factory=list)
    """(FLOPs forward + backward in the bench's count, causal) of each attention block."""
    ew_f: list[tuple[str, int]] = field(default_factory=list)
    ew_b: list[tuple[str, int]] = field(default_factory=list)


def check_one_type(pc) -> None:
    """The planner prices one ``--cp-comm-type`` for every layer: a per-layer list is refused in one line."""
    from omnitron.core.config.parallel import ConfigError

    if not isinstance(pc.cp_comm_type, str):
        raise ConfigError(f"the planner prices one --cp-comm-type for every layer, not the per-layer list "
                          f"{' '.join(pc.cp_comm_type)}: price each type apart (--cp-comm-type "
                          f"{pc.cp_comm_type[0]}, ...)")


def a2a_size(pc) -> int:
    """The all-to-all's size of a layout's ``--cp-comm-type`` (``pc``: its ParallelConfig): cp under ``a2a``, A of
    ``a2a+p2p``'s ``--hierarchical-context-parallel-sizes A P``, else 1."""
    if pc.cp_comm_type == "a2a":
        return pc.context_parallel_size
    sizes = pc.cp_a2a_p2p_sizes
    return int(sizes[0]) if sizes else 1


def cp_work(x: work.Local, elem: int, comm: str = "p2p", a2a: int = 1) -> CpWork:
    """:class:`CpWork` of ``--cp-comm-type comm`` (``a2a``: its all-to-all's size, :func:`a2a_size`; the ring runs
    over cp / a2a). Nothing at cp 1. The heads' divisibility is the engine's to refuse (the model config)."""
    if x.cp == 1:
        return CpWork(blocks=work.cp_blocks(x))
    if comm == "allgather":
        return _allgather(x, elem)
    a = a2a if comm in ("a2a", "a2a+p2p") else 1
    if a == 1:
        return _ring(x, elem, "cp")
    kv = x.groups if x.groups % a == 0 else x.heads  # repeated per query head where a does not divide them
    q = x.batch * x.heads * (x.seq // x.cp) * x.head_dim
    k = x.batch * kv * (x.seq // x.cp) * x.head_dim
    swaps = [("all_to_all", n * elem, a, "cp") for n in (q, k, k, q)]
    rest = replace(x, cp=x.cp // a, heads=x.heads // a, groups=kv // a)  # the ring (or one block) after the swap
    inner = _ring(rest, elem, "cp_p2p") if rest.cp > 1 else CpWork(blocks=work.cp_blocks(rest))
    copies_f, copies_b = [("copy", n) for n in (q, k, k, q)], [("copy", n) for n in (q, q, k, k)]
    return CpWork(swaps + inner.fwd, swaps + inner.bwd, inner.blocks, copies_f + inner.ew_f, copies_b + inner.ew_b)


def _ring(x: work.Local, elem: int, group: str) -> CpWork:
    hops_f, hops_b = work.cp_ring(x, elem)
    ew_f, ew_b = work.cp_ring_elementwise(x)
    return CpWork([("p2p", n, x.cp, group) for n in hops_f], [("p2p", n, x.cp, group) for n in hops_b],
                  work.cp_blocks(x), ew_f, ew_b)


def allgather_blocks(x: work.Local, rank: int) -> list[tuple[float, bool]]:
    """The blocks of cp rank ``rank`` under ``allgather``: per chunk, a full block against every earlier chunk's
    keys (none for chunk 0), then its own chunk's causal block; FLOPs as :func:`omnitron.plan.work.cp_blocks`."""
    c = x.seq // (2 * x.cp)
    unit = 3 * 4.0 * x.batch * x.heads * c * c * x.head_dim  # one c x c block, unmasked
    out = []
    for chunk in (rank, 2 * x.cp - 1 - rank):
        if chunk > 0:
            out.append((unit * chunk, False))
        out.append((unit * 0.5, True))
    return out


def _allgather(x: work.Local, elem: int) -> CpWork:
    kv = x.batch * x.groups * x.seq * x.head_dim  # one of K, V gathered over the whole sequence
    blocks = allgather_blocks(x, 1)  # every rank but 0 runs four blocks (the same FLOPs as rank 0's three)
    q_chunk = x.batch * x.heads * (x.seq // (2 * x.cp)) * x.head_dim
    merges = len(blocks) - 2  # a chunk with two blocks merges them once
    return CpWork([("all_gather", kv * elem, x.cp, "cp")] * 2, [("reduce_scatter", kv * elem, x.cp, "cp")] * 2,
                  blocks, [("ring_merge", q_chunk)] * merges + [("copy", kv)] * 2,
                  [("add", q_chunk)] * merges + [("add", kv), ("copy", kv)] * 2)


def saved_extra(settings, cfg) -> float:
    """Bytes one layer saves for backward per micro-batch beyond what the activation probes measure (one process on
    the rank's ``s / cp`` tokens: the ring's saved local keys and values among them), as the engine's paths save:

    - ``allgather``: the attention blocks keep the gathered keys and values, ``2 b (g / tp) (s - s / cp) d``
      elements more, and the gather's row order (int64, ``s``);
    - ``a2a``: the same elements over the whole sequence for ``1 / cp`` of the heads, but key / value heads that cp
      does not divide are repeated per query head first (``2 b (s / cp) d (a / tp - g / tp)`` more), and the
      reorder's two orders (int64, ``s`` each);
    - ``a2a+p2p``: the same over its a2a size A (heads repeated where A does not divide them; the two orders of
      its ``A s / cp`` rows)."""
    from omnitron.core.transformer.shapes import head_dim, query_groups

    pc = settings.parallel
    cp, tp, comm, a = pc.context_parallel_size, pc.tensor_model_parallel_size, pc.cp_comm_type, a2a_size(pc)
    if cp == 1 or comm == "p2p":
        return 0.0
    s, b, d, elem = cfg.seq_length, settings.training.micro_batch_size, head_dim(cfg), cfg.params_dtype.itemsize
    groups, heads = max(1, query_groups(cfg) // tp), cfg.num_attention_heads // tp
    if comm == "allgather":
        return 2.0 * b * groups * (s - s // cp) * d * elem + 8 * s
    repeat = 2.0 * b * (s // cp) * d * (heads - groups) * elem if groups % a else 0.0
    return repeat + (16 * a * (s // cp) if a > 1 else 0)
