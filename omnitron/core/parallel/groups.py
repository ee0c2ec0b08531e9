"""``ParallelGroups``: the one topology object, built once and passed to everything that communicates."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from omnitron.core.config.parallel import ParallelConfig, data_parallel_size
from omnitron.core.parallel.grid import describe, rank_grid


@dataclass(frozen=True)
class Group:
    """This rank's view of one process group."""

    name: str
    ranks: tuple[int, ...]
    """World ranks in the group, ascending (the group-local rank is the index)."""
    handle: object | None
    """The torch ProcessGroup; None when the group has one member (no communication needed)."""
    collectives: object | None = field(default=None, compare=False, repr=False)
    """The backend's :class:`~omnitron.backends.collectives.Collectives` the group was built with: every
    collective on it goes through them (None for a one-member group)."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        """This process's index inside the group."""
        return self.ranks.index(_world_rank())

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def global_rank(self, local: int) -> int:
        """World rank of group member ``local``."""
        return self.ranks[local]


def _world_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class ParallelGroups:
    """Every group a module, optimizer or schedule needs, for this rank.

    Attributes ``tp, cp, dp, pp, dp_cp, tp_cp, mp, tp_pp_cp, embedding, ep, etp, edp`` are
    :class:`Group` objects (the same names as :func:`omnitron.core.parallel.grid.rank_grid`).
    """

    config: ParallelConfig
    world_size: int
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)
    collectives: object | None = None
    backend: object | None = None
    """The backend the groups were built with (device, kernels, RNG, collectives): what the modules built
    over these groups run on unless given another (see :func:`resolve_backend`)."""

    def __getattr__(self, name: str) -> Group:
        groups = self.__dict__.get("groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(name)

    @property
    def dp_size(self) -> int:
        return data_parallel_size(self.config, self.world_size)

    @property
    def is_pipeline_first(self) -> bool:
        return self.pp.is_first

    @property
    def is_pipeline_last(self) -> bool:
        return self.pp.is_last

    def describe(self) -> str:
        return describe(self.config, self.world_size)

    @classmethod
    def build(cls, config: ParallelConfig, collectives=None, *, backend=None) -> "ParallelGroups":
        """Create every group over the initialised world (all ranks call this together), through
        ``collectives`` (default: ``backend.collectives``); ``backend`` is kept for the modules.

        Without an initialised process group, builds the single-process layout (every group of
        size 1), so the same model code runs unchanged in one process.
        """
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if collectives is None and backend is not None:
            collectives = backend.collectives
        if collectives is None and world > 1:
            raise ValueError("ParallelGroups.build: pass the backend (backend=...) or its collectives; the groups "
                             "communicate through them")
        grid = rank_grid(config, world)  # validates sizes before any group exists
        # NOTE: every rank creates every group, in the same order (torch requires it): the ranks agree on the
        # whole list first (one line naming the group and the ranks where they do not, within the job's timeout)
        specs = [(name, members) for name, members_list in grid.items() for members in members_list
                 if len(members) > 1]
        handles = iter(collectives.new_groups(specs) if specs else [])
        groups: dict[str, Group] = {}
        for name, members_list in grid.items():
            mine = None
            for members in members_list:
                handle = next(handles) if len(members) > 1 else None
                if rank in members:
                    mine = Group(name, tuple(members), handle, collectives if handle is not None else None)
            if mine is None:
                # NOTE: middle pipeline stages belong to no embedding group: give them a group of
                # one (no communication), so ``groups.embedding.size > 1`` means "tied copies here"
                mine = Group(name, (rank,), None)
            groups[name] = mine
        return cls(config=config, world_size=world, rank=rank, groups=groups, collectives=collectives,
                   backend=backend)

    @classmethod
    def single(cls, config: ParallelConfig | None = None, *, backend=None) -> "ParallelGroups":
        """The one-process layout (no process group needed), for modules on ``backend``."""
        config = config or ParallelConfig()
        grid = rank_grid(config, 1)
        groups = {name: Group(name, tuple(members[0]), None) for name, members in grid.items()}
        return cls(config=config, world_size=1, rank=0, groups=groups, backend=backend)


def resolve_backend(backend, groups: ParallelGroups | None):
    """The backend a module built over ``groups`` runs on: ``backend`` when given, else the one the groups
    were built with, else the host CPU backend (a model built in one process naming none: tests, tools).
    NOTE: never ``$OMNITRON_BACKEND``: only the entry points read the environment."""
    if backend is not None:
        return backend
    if groups is not None and groups.backend is not None:
        return groups.backend
    return host_backend()


@functools.lru_cache(maxsize=1)
def host_backend():
    """The host CPU backend (one instance per process): host-memory work that names no backend."""
    from omnitron.backends.cpu import CPUBackend

    return CPUBackend()
