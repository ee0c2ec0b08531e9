"""Per-tensor scaling state: the delayed recipe's amax history and the current-scaling rule.

Definitions (the tests check these step by step):

* **tensorwise** (current scaling): ``amax`` is this tensor's amax, reduced (MAX) over the amax
  groups; ``scale = fp8_max / 2**margin / amax`` (1 when amax is 0); ``q = fp8(x * scale)``.
* **delayed**: each tensor role keeps ``amax_history`` (length L, newest first) and ``scale``.
  Use ``t`` quantizes with the scale in force, ``q_t = fp8(x_t * scale_t)``; then the observed amax
  ``a_t`` (reduced over the amax groups) is pushed: ``history <- [a_t, history[:-1]]``, and
  ``scale_{t+1} = fp8_max / 2**margin / A`` with ``A = max(history)`` (``max``) or ``history[0]``
  (``most_recent``); a zero or non-finite ``A`` keeps the previous scale. History starts at zeros.
  The very first use has no history: it is scaled from its own amax, as tensorwise would
  (NOTE: Transformer Engine uses scale 1 there, which flushes small gradients to zero on step 1).
  The push of ``a_t`` is applied lazily, at the start of use ``t+1`` (:meth:`DelayedScaling.flush`),
  so a forward recomputed during backward (activation checkpointing) still finds the scale its
  original forward used and re-quantizes bit for bit. All of it stays on the device (no host syncs).
  Reduction (:class:`AmaxReducer`, shared by every FP8 linear of a model): a use records its local
  ``a_t`` unreduced; the first flush that needs a recorded amax MAX-reduces every one recorded so far, of
  every layer and role, as one stacked tensor: one all-reduce per amax group per flush point (in a step:
  once per micro-batch's backward, whatever the layer count) instead of one per operand per call. The max
  of a stack is the stack of the maxes, so the scales are those of reducing each amax alone.
* **delayed, per step** (:class:`AmaxReducer` with ``per_step``; what training uses; Transformer Engine's global
  amax reduction packs the same way but runs when each training micro-batch's forward leaves its FP8 context and
  after each micro-batch's backward, NOTE: so with gradient accumulation its input and output-gradient scales move
  within a step where these do not; its weight role agrees, as Megatron quantizes the weight in the first
  micro-batch only: tests/fp8/test_delayed_vs_transformer_engine.py): within an optimizer step every use quantizes
  with the scale in force and only max-accumulates its local amax into its role's step-amax buffer (in place, no
  collective);
  :meth:`AmaxReducer.step`, called once at the step's end, stacks every registered role's step amax, MAX-reduces
  the stack in one all-reduce over the amax reduction group (tensor x context x data parallel) and pushes the
  history of each role used this step once: ``a_step = max over ranks and the step's uses``,
  ``history <- [a_step, history[:-1]]``, scale as above in Transformer Engine's arithmetic (:func:`delayed_scale`);
  a role whose ``a_step`` is 0 (an empty expert, an all-zero gradient) keeps its history and scale, as TE's fused
  update leaves a zero amax unrolled. An evaluation's forwards (no backward) observe too and fold into the next
  step's push, as TE's no-grad forwards leave their amaxes for the next training forward's reduction. Until the
  first :meth:`~AmaxReducer.step` there is no
  history: every use of the first step is scaled from this rank's own local amax, with no collective, so step 1
  issues the same one packed reduction as every later step. NOTE: in step 1 only, the ranks of the amax group may
  therefore quantize with different scales (a tensor-parallel shard by its own amax, not the whole tensor's);
  each GEMM still dequantizes with the scales it quantized with, so the result is exact FP8 math, only not
  bit-identical to one process. From the end of step 1 every rank holds the reduced history and scale.
  Written for the compiler (``--torch-compile``): the scale and history change only at the step boundary,
  outside the compiled layers, and a use's only state change is the in-place max into a buffer, which dynamo
  traces (in the forward and in the backward). So a forward recomputed during the backward quantizes as its
  original did without asking autograd whether it runs a backward (the step's scale is the same; the first
  step's scale a function of the same input), re-observing an amax changes nothing (``max(a, a) = a``), and
  the only Python state a layer reads is :attr:`AmaxReducer.primed`: one graph for the first step, one after.
"""
from __future__ import annotations

from typing import Sequence

import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.kernels.reference.fp8 import fp8_amax_history_push, scale_from_amax


def reduce_amax(amax: torch.Tensor, groups: Sequence, collectives) -> torch.Tensor:
    """MAX-reduce ``amax`` over each group (``Group`` objects; size-1 groups cost nothing): in place, or into a
    new tensor through torch's functional all-reduce while dynamo traces (which records it into the graph)."""
    if collectives is None:
        return amax
    from torch.distributed import ReduceOp

    for g in groups:
        if g is not None and getattr(g, "handle", None) is not None and g.size > 1:
            if torch.compiler.is_compiling():
                import torch.distributed._functional_collectives as funcol

                amax = funcol.all_reduce(amax, "max", g.handle)
            else:
                collectives.all_reduce(amax, op=ReduceOp.MAX, group=g.handle)
    return amax


class AmaxReducer:
    """Delayed scaling's recorded amaxes over one set of amax groups, MAX-reduced together when a use first
    needs one of them (module docstring). Every rank of the groups records the same uses in the same order,
    so the stacked tensors line up; no host sync."""

    def __init__(self, groups: Sequence, collectives, *, per_step: bool = False) -> None:
        self.groups, self.collectives = tuple(groups), collectives
        self.waiting: list[_Recorded] = []
        self.reductions = 0
        """Batched reductions issued (each: one all-reduce per group of size > 1)."""
        self.per_step = per_step
        """Roles accumulate their step amax and :meth:`step` reduces and pushes them (module docstring)."""
        self.states: list[DelayedScaling] = []
        """Per-step mode: every role sharing this reducer, in model order (the same on every rank of the group:
        the stacked step amaxes line up whichever roles a step used)."""
        self.primed = False
        """Per-step mode: whether a step has pushed the histories (before, every use scales from its own amax)."""

    def register(self, state: "DelayedScaling") -> None:
        """Add ``state`` to the roles :meth:`step` reduces and pushes (per-step mode)."""
        self.states.append(state)

    def observe(self, state: "DelayedScaling", amax: torch.Tensor) -> None:
        """Max-accumulate a use's local ``amax`` into ``state``'s step-amax buffer, in place (per-step mode; on
        the device, traceable: no Python state changes)."""
        state.step_amax.copy_(torch.maximum(state.step_amax, amax.float()))

    def step(self) -> None:
        """End of an optimizer step: every registered role's step amax MAX-reduced in one packed collective per
        group (one group: the amax reduction group), then the history of each role used this step pushed once;
        the step amaxes reset. No host sync: an unused role (step amax still -1 on every rank) keeps its state
        through ``where``. The roles are pushed together (:func:`push_packed`), not one by one."""
        if not self.states:
            return
        devices = {s.step_amax.device for s in self.states}  # a role never used yet is still where it was made
        device = next((d for d in devices if d.type != "cpu"), next(iter(devices)))
        for s in self.states:
            s.to(device)
        packed = reduce_amax(torch.stack([s.step_amax for s in self.states]), self.groups, self.collectives)
        rows = packed.unbind(0)
        kinds: dict[tuple, list[int]] = {}
        for i, s in enumerate(self.states):
            kinds.setdefault((s.fmt, s.history_len, s.algo, s.margin), []).append(i)
        for idx in kinds.values():  # one kind per format in a model (its recipe fixes length, algorithm, margin)
            push_packed([self.states[i] for i in idx], torch.stack([rows[i] for i in idx]))
        self.primed = True
        self.reductions += 1

    def add(self, amax: torch.Tensor) -> "_Recorded":
        """Hold ``amax`` (a local 0-d float32) until the next :meth:`reduce`."""
        rec = _Recorded(amax, self)
        self.waiting.append(rec)
        return rec

    def reduce(self) -> None:
        """MAX-reduce every held amax in one stacked collective per group; each holder then has its result."""
        if not self.waiting:
            return
        waiting, self.waiting = self.waiting, []
        stacked = reduce_amax(torch.stack([r.value for r in waiting]), self.groups, self.collectives)
        for r, v in zip(waiting, stacked.unbind(0)):
            r.value, r.reducer = v, None
        self.reductions += 1


def push_packed(states: list["DelayedScaling"], amax: torch.Tensor) -> None:
    """Per-step push of roles of one kind (format, history length, algorithm, margin) at once; ``amax`` [R]: their
    reduced step amaxes in ``states``' order. Each role whose amax is positive (or NaN, which poisons the history
    as a pushed NaN does) gets :meth:`DelayedScaling.push`'s update with :func:`delayed_scale`; the others keep
    their history and scale: -1 ("unused") and 0 alike, as Transformer Engine's fused update leaves a zero amax
    unrolled (an empty expert, an all-zero gradient), chosen on the device without a host sync. About 15
    operations and four foreach copies for all roles instead of about 15 operations a role. The results are copied
    into the roles' tensors in place: at a step's end no backward still holds the old ones."""
    s0 = states[0]
    history = torch.stack([s.amax_history for s in states])  # [R, L]
    scale, scale_inv = torch.stack([s.scale for s in states]), torch.stack([s.scale_inv for s in states])
    new = torch.cat([amax.clamp(min=0.0)[:, None], history[:, :-1]], dim=1)  # newest first
    summary = new.amax(dim=1) if s0.algo == "max" else new[:, 0]
    new_scale = delayed_scale(summary, s0.fmt, s0.margin, scale)
    used = ~(amax <= 0)
    new_inv = torch.where(used, new_scale.reciprocal(), scale_inv)
    new, new_scale = torch.where(used[:, None], new, history), torch.where(used, new_scale, scale)
    torch._foreach_copy_([s.amax_history for s in states], list(new.unbind(0)))
    torch._foreach_copy_([s.scale for s in states], list(new_scale.unbind(0)))
    torch._foreach_copy_([s.scale_inv for s in states], list(new_inv.unbind(0)))
    unused = torch.full((), -1.0, device=amax.device)
    torch._foreach_copy_([s.step_amax for s in states], [unused] * len(states))
    for s in states:
        s.uses += 1


def delayed_scale(amax: torch.Tensor, fmt: str, margin: int, previous: torch.Tensor) -> torch.Tensor:
    """Transformer Engine's delayed-scaling scale (common/recipe/delayed_scaling.cu, ``kernel_bulk``): its
    current-scaling arithmetic, :func:`~omnitron.kernels.reference.fp8.scale_from_amax` (one correctly rounded
    float32 division, the largest float32 where it overflows), and ``previous`` where ``amax`` is 0, inf or NaN."""
    return scale_from_amax(amax, fmt, margin, previous=previous)


class _Recorded:
    """One use's amax: local until its reducer's next reduction (``reducer`` is None once reduced)."""

    def __init__(self, value: torch.Tensor, reducer: AmaxReducer) -> None:
        self.value, self.reducer = value, reducer

    def result(self) -> torch.Tensor:
        """The reduced amax (reducing every held one first if it is not yet)."""
        if self.reducer is not None:
            self.reducer.reduce()
        return self.value


class DelayedScaling:
    """The amax history and scale of one tensor role (input, weight or grad_output) of one linear."""

    def __init__(self, fmt: str, history_len: int, algo: str, margin: int, device=None) -> None:
        """``device``: where the layer's tensors will be (its backend's): made there, the state is never moved
        inside a compiled layer (a move there is a mutation dynamo refuses: one graph break per role)."""
        self.fmt, self.history_len, self.algo, self.margin = fmt, history_len, algo, margin
        self.amax_history = torch.zeros(history_len, device=device)
        self.scale = torch.ones((), device=device)
        self.scale_inv = torch.ones((), device=device)
        """``1 / scale``, kept beside it (the GEMMs take it; computed once per update, not per use)."""
        self.uses = 0
        """Amaxes pushed so far (host-side count; 0 means "no history yet")."""
        self.pending: torch.Tensor | None = None
        """The last use's amax, pushed at the start of the next use."""
        self.step_amax = torch.full((), -1.0, device=device)
        """Per-step mode: the max of this step's local amaxes (-1: no use yet), pushed by :meth:`AmaxReducer.step`;
        a buffer updated in place (a compiled layer mutates it)."""

    def to(self, device: torch.device) -> "DelayedScaling":
        """Move the state to ``device`` (done on first use, where the tensors live)."""
        if self.scale.device != device:
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)
            self.scale_inv = self.scale_inv.to(device)
            self.step_amax = self.step_amax.to(device)
        return self

    def set_scale(self, scale: torch.Tensor) -> None:
        """Use ``scale`` from now on (the first use, scaled from its own amax)."""
        self.scale, self.scale_inv = scale, scale.reciprocal()

    def push(self, amax: torch.Tensor, update=None) -> None:
        """Record an (already group-reduced) amax and compute the scale for the next use.

        ``update``: an implementation of the ``fp8_amax_history_push`` kernel op (a backend's kernel
        table entry fuses the whole update into one launch); the reference when None. The new
        history, scale and reciprocal are new tensors: a backward may still hold the old ones."""
        update = update or fp8_amax_history_push
        self.amax_history, self.scale, self.scale_inv = update(
            self.amax_history, amax.to(self.amax_history.device, torch.float32), self.scale, self.fmt,
            self.margin, self.algo)
        self.uses += 1


    def record(self, amax: torch.Tensor, reducer: AmaxReducer | None = None) -> None:
        """Keep this use's amax, pushed when the next use begins: group-reduced already, or local and reduced by
        ``reducer`` with every other recorded one when first needed (per-step reducers observe instead)."""
        self.pending = amax if reducer is None else reducer.add(amax)

    def flush(self, update=None) -> None:
        """Push the pending amax, if any (start of a use; before saving)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.push(pending.result() if isinstance(pending, _Recorded) else pending, update)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """History, scale, push count, and (per-step mode) the step amax observed since the last push: an
        evaluation between two steps observes its forwards' amaxes, which the next step's push folds in, so a run
        saved after an evaluation resumes with them (the uninterrupted run's next push)."""
        self.flush()  # the next use would push it first anyway: saving it pushed resumes identically
        return {"amax_history": self.amax_history.detach().cpu().clone(), "scale": self.scale.detach().cpu().clone(),
                "uses": torch.tensor(self.uses), "step_amax": self.step_amax.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        hist = state["amax_history"]
        if hist.numel() != self.history_len:
            raise ConfigError(f"checkpoint amax history has length {hist.numel()} but --fp8-amax-history-len is "
                              f"{self.history_len}; resume with the same --fp8-amax-history-len")
        device = self.scale.device
        self.amax_history = hist.detach().float().clone().to(device)
        self.set_scale(state["scale"].detach().float().clone().reshape(()).to(device))
        self.uses = int(state["uses"])
        self.pending = None
        # a checkpoint written before the step amax was saved: none observed (-1), as after a push
        step_amax = state.get("step_amax", torch.tensor(-1.0))
        self.step_amax = step_amax.detach().float().clone().reshape(()).to(device)
