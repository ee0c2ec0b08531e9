"""The rank grid as a pure function: which world ranks form each process group.

Dense order is tp-cp-dp-pp (tensor ranks adjacent, so they share a node):
``rank = tp + TP * (cp + CP * (dp + DP * pp))``. Experts re-partition the same tp*cp*dp ranks
of each pipeline stage as etp-ep-edp (``etp * ep * edp = tp * cp * dp``), so expert parallelism
never multiplies the world size.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from omnitron.core.config.parallel import ParallelConfig, data_parallel_size


@dataclass(frozen=True)
class Coord:
    """One rank's position in the dense grid."""

    tp: int
    cp: int
    dp: int
    pp: int


def _groups(sizes: dict[str, int], vary: tuple[str, ...]) -> list[list[int]]:
    """All groups that vary the named dims (fastest first) and fix the others, for a grid whose
    dims are listed fastest first in ``sizes``."""
    names = list(sizes)
    strides, acc = {}, 1
    for n in names:
        strides[n] = acc
        acc *= sizes[n]
    fixed = [n for n in names if n not in vary]
    out = []
    for fixed_vals in itertools.product(*(range(sizes[n]) for n in reversed(fixed))):
        base = sum(v * strides[n] for n, v in zip(reversed(fixed), fixed_vals))
        members = []
        for vals in itertools.product(*(range(sizes[n]) for n in reversed(vary))):
            members.append(base + sum(v * strides[n] for n, v in zip(reversed(vary), vals)))
        out.append(sorted(members))
    return sorted(out)


def dense_groups(cfg: ParallelConfig, world_size: int, vary: tuple[str, ...]) -> list[list[int]]:
    """Groups of the dense grid (dims ``tp, cp, dp, pp``) that vary the dims ``vary``: a group
    :func:`rank_grid` does not build for everyone (FP8's amax reduction group: ``("tp", "cp", "dp")``)."""
    dense = {"tp": cfg.tensor_model_parallel_size, "cp": cfg.context_parallel_size,
             "dp": data_parallel_size(cfg, world_size), "pp": cfg.pipeline_model_parallel_size}
    return _groups(dense, vary)


def rank_grid(cfg: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Every process group as lists of world ranks, keyed by name.

    Keys: ``tp, cp, dp, pp, dp_cp, tp_cp, mp`` (tp x pp, Megatron's model-parallel group),
    ``tp_pp_cp`` (one model replica), ``embedding`` (first and last stage of each pipeline),
    ``ep, etp, edp`` (expert layout); with ``--cp-comm-type a2a+p2p`` (sizes ``A x P``) also ``cp_a2a``
    (``A`` consecutive ranks of each cp group: the all-to-all) and ``cp_p2p`` (the ranks ``A`` apart in each
    cp group: the ring), so every rank creates every sub-group, in the same order.
    """
    dp = data_parallel_size(cfg, world_size)
    dense = {"tp": cfg.tensor_model_parallel_size, "cp": cfg.context_parallel_size, "dp": dp,
             "pp": cfg.pipeline_model_parallel_size}
    grid = {
        "tp": _groups(dense, ("tp",)),
        "cp": _groups(dense, ("cp",)),
        "dp": _groups(dense, ("dp",)),
        "pp": _groups(dense, ("pp",)),
        "dp_cp": _groups(dense, ("cp", "dp")),
        "tp_cp": _groups(dense, ("tp", "cp")),
        "mp": _groups(dense, ("tp", "pp")),
        "tp_pp_cp": _groups(dense, ("tp", "cp", "pp")),
    }
    grid["embedding"] = sorted(sorted({g[0], g[-1]}) for g in grid["pp"])
    inner = dense["tp"] * dense["cp"] * dp
    ep, etp = cfg.expert_model_parallel_size, cfg.etp
    expert = {"etp": etp, "ep": ep, "edp": inner // (etp * ep), "pp": dense["pp"]}
    for name in ("etp", "ep", "edp"):
        grid[name] = _groups(expert, (name,))
    hier = cfg.cp_a2a_p2p_sizes
    if hier is not None:
        a, p = hier
        grid["cp_a2a"] = sorted(m[j * a:(j + 1) * a] for m in grid["cp"] for j in range(p))
        grid["cp_p2p"] = sorted(m[j::a] for m in grid["cp"] for j in range(a))
    return grid


def coord_of(cfg: ParallelConfig, world_size: int, rank: int) -> Coord:
    """Dense grid coordinates of ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of {world_size}")
    tp, cp = cfg.tensor_model_parallel_size, cfg.context_parallel_size
    dp = data_parallel_size(cfg, world_size)
    return Coord(tp=rank % tp, cp=(rank // tp) % cp, dp=(rank // (tp * cp)) % dp, pp=rank // (tp * cp * dp))


def describe(cfg: ParallelConfig, world_size: int) -> str:
    """One line with every size, for logs."""
    dp = data_parallel_size(cfg, world_size)
    return (f"world={world_size} tp={cfg.tensor_model_parallel_size} cp={cfg.context_parallel_size} dp={dp} "
            f"pp={cfg.pipeline_model_parallel_size} vpp={cfg.virtual_pipeline_model_parallel_size or 1} "
            f"ep={cfg.expert_model_parallel_size} etp={cfg.etp} sp={cfg.sequence_parallel}")
