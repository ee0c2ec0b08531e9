"""The pipeline's vocabulary: actions, per-rank schedule tables and virtual-stage placement.

Shared by the schedule builders (:mod:`.schedules`, :mod:`.vshape`), the simulator and the runtime;
see :mod:`.schedules` for the notation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from omnitron.core.config.parallel import ConfigError


def virtual_stage(rank: int, chunk: int, pp: int, style: str = "loop") -> int:
    """Virtual stage index of ``chunk`` on pipeline ``rank`` (see the module docstring)."""
    if style == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def place_stage(stage: int, pp: int, style: str = "loop") -> tuple[int, int]:
    """(rank, chunk) holding virtual ``stage``: the inverse of :func:`virtual_stage`."""
    if style == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


@dataclass(frozen=True)
class Action:
    """One unit of work on one pipeline rank."""

    chunk: int
    """Model chunk index on this rank (0 unless interleaved)."""
    kind: str
    """``F`` forward, ``B`` backward (input-gradient only when a matching ``W`` exists), ``W`` weight-gradient."""
    microbatch: int

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``"1B3"`` -> Action(1, "B", 3)."""
        for kind in "FBW":
            if kind in text:
                chunk, mb = text.split(kind)
                return cls(int(chunk), kind, int(mb))
        raise ValueError(f"not an action: {text!r} (expected e.g. '0F3')")


@dataclass(frozen=True)
class Schedule:
    """A complete per-rank action table for one step."""

    name: str
    pp: int
    vp: int
    num_microbatches: int
    tables: dict[int, tuple[Action, ...]]
    style: str = "loop"
    """Chunk placement: ``loop`` (stage ``c * pp + r``) or ``v`` (stages ``r`` and ``2 pp - 1 - r``)."""
    pairs: dict[int, frozenset[int]] = field(default_factory=dict)
    """Per rank, the table indices ``i`` whose forward runs overlapped with the backward at ``i + 1``
    (DualPipe's pair): the receives of both are posted before the forward computes, the forward's send is in
    flight while the backward computes (``runtime.py``); the simulation starts the pair once both inputs are in."""
    combined: bool = False
    """The pairs run as one action (``combined.py``, the MoE all-to-all overlap): the forward's output leaves with
    the backward's, at the pair's end."""

    def __post_init__(self) -> None:
        for r, firsts in self.pairs.items():
            table = self.tables[r]
            for i in firsts:
                if not (i + 1 < len(table) and table[i].kind == "F" and table[i + 1].kind == "B"):
                    raise ValueError(f"{self.name}: rank {r} pairs step {i} with step {i + 1}, which are not a "
                                     f"forward then a backward")

    def paired(self, rank: int, index: int) -> bool:
        """Whether action ``index`` of ``rank`` is the forward of an overlapped pair."""
        return index in self.pairs.get(rank, ())

    def forwards_only(self) -> "Schedule":
        """The same order without backward work (validation, ``forward_only``): no gradient messages, no pairs."""
        return replace(self, tables={r: tuple(a for a in t if a.kind == "F") for r, t in self.tables.items()},
                       pairs={}, combined=False)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage index of ``chunk`` on ``rank``."""
        return virtual_stage(rank, chunk, self.pp, self.style)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding virtual ``stage``."""
        return place_stage(stage, self.pp, self.style)

    def split_backward(self, rank: int) -> set[tuple[int, int]]:
        """(chunk, microbatch) pairs whose backward is split into B (input grad) and W."""
        return {(a.chunk, a.microbatch) for a in self.tables[rank] if a.kind == "W"}

    def format(self) -> str:
        """The step-by-rank grid (one column per rank), for logs and error messages; ``&1B3``: the backward
        overlapped with the forward above it."""
        steps = max(len(t) for t in self.tables.values())
        lines = [f"{self.name} pp={self.pp} vp={self.vp} m={self.num_microbatches}",
                 "step " + " ".join(f"{'r' + str(r):>6}" for r in range(self.pp))]
        for i in range(steps):
            cells = [("&" if self.paired(r, i - 1) else "") + str(self.tables[r][i]) if i < len(self.tables[r])
                     else "" for r in range(self.pp)]
            lines.append(f"{i:>4} " + " ".join(f"{c:>6}" for c in cells))
        return "\n".join(lines)


def _check(pp: int, m: int) -> None:
    if pp < 1:
        raise ConfigError(f"--pipeline-model-parallel-size must be >= 1, got {pp}")
    if m < 1:
        raise ConfigError(f"number of micro-batches must be >= 1, got {m}; raise --global-batch-size")


def zb_stage_cost(stage: int, kind: str) -> float:
    """Relative cost of an action on a virtual stage, as the ZB-H1 builder assumes: F = B = W = 1,
    an unsplit backward ``BW`` = 2; on stage 0 there is no input gradient to compute, so its B is
    free and its W does the whole backward (2)."""
    if stage == 0 and kind in ("B", "W"):
        return 0.0 if kind == "B" else 2.0
    return 2.0 if kind == "BW" else 1.0
