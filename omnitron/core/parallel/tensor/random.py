"""Dropout RNG for tensor parallelism, and activation recomputation that replays it exactly.

Two streams exist on each rank:

* the device's default generator, seeded by the training loop identically on every tensor-parallel
  rank (``seed + 100 * pp_rank``): dropout on tensors that are REPLICATED over tp (hidden states
  without sequence parallelism) draws from it, so every tp rank drops the same elements;
* the tracker's ``"model-parallel"`` stream, seeded ``seed + 2718 + 100 * pp_rank + tp_rank``:
  dropout on tensors that are SPLIT over tp (attention probabilities of local heads, sequence
  shards under sequence parallelism) draws from it, so shards drop independent elements.

Recomputation (:func:`checkpoint`) snapshots both streams before the forward and replays the
recomputed forward from the snapshot, so results are identical to no recomputation.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

MODEL_PARALLEL = "model-parallel"
"""Name of the tracker stream that differs across tensor-parallel ranks."""


class RNGTracker:
    """Named generator states swapped in and out of the device's default generator.

    ``backend`` supplies ``get_rng_state`` / ``set_rng_state`` / ``manual_seed`` (any device).
    ``tp_size``: the tensor-parallel size; at 1 nothing is split over ranks, so code being compiled
    (``--torch-compile``) skips the fork, whose generator-state swap dynamo cannot trace.
    """

    def __init__(self, backend, tp_size: int | None = None) -> None:
        self.backend, self.tp_size = backend, tp_size
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed`` (the default generator is left untouched)."""
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = self.backend.get_rng_state()
        self.backend.manual_seed(seed)
        self.states[name] = self.backend.get_rng_state()
        self.backend.set_rng_state(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every stream's state (for checkpoints and recomputation)."""
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Restore states from :meth:`get_states`."""
        self.states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL) -> Iterator[None]:
        """Run the enclosed code drawing from stream ``name``; the default generator is restored after."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added (known: {sorted(self.states)})")
        if self.tp_size == 1 and torch.compiler.is_compiling():
            yield  # the compiled graph draws from the default generator: no cross-rank masks to decorrelate
            return
        saved = self.backend.get_rng_state()
        self.backend.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self.backend.get_rng_state()
            self.backend.set_rng_state(saved)


    def draw_seed(self, device, name: str = MODEL_PARALLEL) -> int:
        """A seed from stream ``name`` without a host sync: a hash of the stream's host-side generator state,
        then one draw on ``device`` to advance the stream (so each call gets a new seed, and a recomputation
        replayed from the same states gets the same one)."""
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added (known: {sorted(self.states)})")
        digest = hashlib.blake2b(self.states[name].cpu().numpy().tobytes(), digest_size=8).digest()
        with self.fork(name):
            torch.empty(1, device=device).uniform_()
        return int.from_bytes(digest, "little") % 2**62


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> int:
    """Seed of the tracker stream for one (tp, pp) position (Megatron's offsets)."""
    return seed + 2718 + 100 * pp_rank + tp_rank


def default_seed(seed: int, pp_rank: int) -> int:
    """Seed of the default generator: the same on every tp rank of a pipeline stage."""
    return seed + 100 * pp_rank


def checkpoint(fn: Callable, tracker: RNGTracker | None, *args, **kwargs):
    """``fn(*args, **kwargs)`` without keeping its activations; backward recomputes them.

    The recomputation starts from the RNG states the first forward saw (default generator and
    every tracker stream) and restores the current states afterwards, so dropout masks match.
    While ``torch.compile`` traces (selective recomputation inside a compiled layer), torch's checkpoint is
    traced into the graph instead (the generator swaps, which dynamo cannot trace, are skipped): the
    backward's dropout masks are the forward's (tested with aot_eager and inductor).
    """
    if torch.compiler.is_compiling():
        return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)
    backend = tracker.backend if tracker is not None else None
    snap_default = backend.get_rng_state() if backend is not None else torch.get_rng_state()
    snap_tracker = tracker.get_states() if tracker is not None else None
    calls = [0]

    def run(*a, **kw):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a, **kw)
        # recomputation: replay from the snapshot, then put the live states back
        live_default = backend.get_rng_state() if backend is not None else torch.get_rng_state()
        live_tracker = tracker.get_states() if tracker is not None else None
        (backend.set_rng_state if backend is not None else torch.set_rng_state)(snap_default)
        if tracker is not None:
            tracker.set_states(snap_tracker)
        try:
            return fn(*a, **kw)
        finally:
            (backend.set_rng_state if backend is not None else torch.set_rng_state)(live_default)
            if tracker is not None:
                tracker.set_states(live_tracker)

    return torch_checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
