"""The FP8 linear executor: ``executor(x, weight, bias) -> y`` with FP8 GEMMs forward and backward.

A linear layer (column/row parallel, output layer, or a plain ``nn.Linear`` patched by
:func:`enable_fp8`) calls ``self.fp8(x, self.weight, bias)`` in place of ``F.linear`` at its
local GEMM. Three GEMMs run in FP8 with fp32 accumulation:

* forward ``y = x @ w.T``       x, w in e4m3
* data-grad ``dx = g @ w``      g in e5m2 (``hybrid``) or e4m3, w as saved from the forward
* weight-grad ``dw = g.T @ x``

Casts saturate in both formats (a delayed scale that is stale for a growing gradient clips it at
57344 instead of turning it into inf, as Transformer Engine's satfinite casts do). Outputs come back in ``x``'s dtype
(``dw`` in the weight's dtype); master weights are never replaced. Tensor-parallel communication stays in the layer:
this executor sees local shards only, and MAX-reduces per-tensor amaxes over the amax groups so every shard uses the
scale of the whole.
"""
from __future__ import annotations

import math
import weakref
from typing import Sequence

import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8.config import BLOCK_ACT, BLOCK_WEIGHT, FP8Config
from omnitron.core.precision.fp8.gathered import FP8GatheredWeight
from omnitron.core.parallel.split_backward import computes_input, computes_weight, defers_weight, stash, take
from omnitron.core.precision.fp8.scaling import AmaxReducer, DelayedScaling, reduce_amax
from omnitron.backends.fp8 import scale_from_amax
from omnitron.core.capture import in_graph

ROLES = ("input", "weight", "grad_output")


class FP8Linear:
    """Callable FP8 GEMM for one linear layer; holds that layer's scaling state.

    ``amax_groups``: ``Group`` objects over which per-tensor amaxes are MAX-reduced (the tensor-
    parallel group, plus context/data-parallel ones for ``delayed``); ``collectives`` carries them.
    ``reducer``: under ``delayed``, the :class:`AmaxReducer` (over the same groups) this layer's recorded
    amaxes are reduced by, batched with every other layer sharing it; None reduces each amax when taken.
    """

    def __init__(self, recipe: FP8Config, provider, *, amax_groups: Sequence = (), collectives=None,
                 name: str = "", reducer: AmaxReducer | None = None, role_groups: dict | None = None) -> None:
        self.recipe, self.provider, self.name = recipe, provider, name
        self.amax_groups, self.collectives, self.reducer = tuple(amax_groups), collectives, reducer
        self.role_groups = dict(role_groups or {})
        """tensorwise: per role, the groups its amax is reduced over instead of ``amax_groups`` (those its operand
        differs over: :func:`~omnitron.core.precision.fp8.enable.tensorwise_role_groups`)."""
        self.states: dict[str, DelayedScaling] = {}
        self._wcache: tuple | None = None
        """(weak ref to the weight, its (data_ptr, _version, dtype, shape, stride, delayed update count), FP8 form)."""
        self.static: tuple | None = None
        """The weight's FP8 form in tensors kept for the run and rewritten in place by :meth:`refresh_static` (a
        compiled or captured layer reads them instead of quantizing in its graph); None: quantize in the graph."""
        self._delayed, self.per_tensor = recipe.fp8_recipe == "delayed", recipe.per_tensor
        self.margin = recipe.scale_margin  # --fp8-margin under delayed only (config.py)
        self.fwd_fmt, self.bwd_fmt = recipe.forward_format, recipe.backward_format
        """The recipe's constants, read once here rather than through its properties on every call."""
        self._groups = {r: self.role_groups.get(r, self.amax_groups) for r in ROLES}
        self._per_step = reducer is not None and reducer.per_step
        self._ops: tuple = (None, None, None, None)
        """(kernel table, its cast_transpose_from_amax, cast_transpose_amax, amax_history_push dispatchers):
        resolved here (in eager: inside a compiled layer, a first resolution would be a traced attribute write,
        guarded, and the next call would recompile) and again only when the backend's table is replaced
        (``testing.parity``)."""
        if getattr(provider, "backend", None) is not None:
            self.kernel_ops()
        if self._delayed:
            fmt = {"input": recipe.forward_format, "weight": recipe.forward_format,
                   "grad_output": recipe.backward_format}
            backend = getattr(provider, "backend", None)
            device = backend.current_device() if backend is not None else None
            self.states = {r: DelayedScaling(fmt[r], recipe.fp8_amax_history_len, recipe.fp8_amax_compute_algo,
                                             recipe.fp8_margin, device) for r in ROLES}
            if reducer is not None and reducer.per_step:
                for state in self.states.values():
                    reducer.register(state)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dev = x.device.type
        if not torch.is_autocast_enabled(dev):  # the common case: no context to enter and leave on every call
            return _FP8LinearFn.apply(x, weight, bias, self)
        x = x.to(torch.get_autocast_dtype(dev))  # same output dtype as F.linear under autocast
        with torch.autocast(dev, enabled=False):  # the emulation must accumulate in fp32, not autocast's dtype
            return _FP8LinearFn.apply(x, weight, bias, self)

    def kernel_ops(self) -> tuple:
        """(cast_transpose_from_amax, cast_transpose_amax, amax_history_push) of the backend's kernel table,
        looked up once per table instead of through the table's ``__getattr__`` on every quantization."""
        table = self.provider.backend.kernels
        if table is not self._ops[0]:
            self._ops = (table, table.get("fp8_cast_transpose_from_amax"), table.get("fp8_cast_transpose_amax"),
                         table.get("fp8_amax_history_push"))
        return self._ops[1:]

    def __repr__(self) -> str:
        r = self.recipe
        return f"FP8Linear({self.name or '?'}, recipe={r.fp8_recipe}, format={r.fp8_format}, path={self.provider.path})"

    # ---- per-tensor quantization --------------------------------------------------------
    def quantize(self, role: str, x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(``q = fp8(x * scale)``, ``q.t()`` contiguous, ``scale_inv``) under the per-tensor recipe,
        updating the role's state. Current scaling (tensorwise) reduces the amax over the amax groups,
        then one fused kernel (``fp8_cast_transpose_from_amax``) derives the scale and casts; delayed
        scaling casts with the scale in force (``fp8_cast_transpose_amax``). Both saturate."""
        from_amax, cast, _ = self.kernel_ops()
        if self._delayed:
            return self._quantize_delayed(self.states[role].to(x.device), role, x, fmt, cast)
        amax = _amax(x)
        if self.collectives is not None:
            amax = reduce_amax(amax, self._groups[role], self.collectives)
        return from_amax(x, amax, fmt, self.margin)

    def quantize_weight(self, weight: torch.Tensor) -> tuple:
        """The weight's FP8 form: ``(q, q.t(), scale_inv)`` (per-tensor) or ``(q, scale_inv)`` (block-wise).

        Quantized once per weight value: reused while ``weight`` is the same tensor with the same
        ``data_ptr`` and ``_version`` (in-place updates bump it), i.e. across the micro-batches of one
        optimizer step and in activation recomputation. Exact, since tensorwise and block-wise scales are
        functions of the weight alone; every tensor-parallel rank hits or misses alike (same updates),
        so the amax all-reduce is skipped in step. Under ``delayed`` only when updated once per step (training:
        the reducer's ``per_step``), keyed also by the weight role's update count: within a step its scale is
        fixed and re-observing the same amax changes nothing (``max(a, a) = a``), so the cached form is the one
        a new quantization would give; used per use (standalone), each use moves the history. NOTE: writes that
        bypass the version counter (``p.data.copy_``, custom kernels) must call
        ``torch.autograd.graph.increment_version(p)``, as the optimizer does.
        """
        if isinstance(weight, FP8GatheredWeight):  # FSDP2 all-gathered it in FP8, scale precomputed (fp8/fsdp.py)
            return weight.operands()
        if in_graph() and self.static is not None:  # refreshed before the layer ran (static_weights.py)
            return self.static
        # inference tensors keep no version counter; a compiled or captured layer without static operands
        # quantizes in its graph (fused, no cache: nothing Python runs on a graph's replay)
        if (self._delayed and not self._per_step) or in_graph() or weight.is_inference():
            return self._quantize_weight_now(weight)
        key = (weight.data_ptr(), weight._version, weight.dtype, tuple(weight.shape), weight.stride(),
               self.states["weight"].uses if self._delayed else 0)
        c = self._wcache
        if c is not None and c[0]() is weight and c[1] == key:
            return c[2]
        out = self._quantize_weight_now(weight)
        self._wcache = (weakref.ref(weight), key, out)
        return out

    def _quantize_weight_now(self, weight: torch.Tensor) -> tuple:
        if self.per_tensor:
            return self.quantize("weight", weight, self.fwd_fmt)
        return self.provider.quantize_blocks(weight, self.fwd_fmt, BLOCK_WEIGHT, self.margin)

    @property
    def caches_weight(self) -> bool:
        """Whether one quantization serves every use within an optimizer step (all but ``delayed`` updated per use)."""
        return not (self._delayed and not self._per_step)

    def refresh_static(self, weight: torch.Tensor) -> None:
        """Eager, before a compiled or captured layer runs: make :attr:`static` this weight's FP8 form. The first
        call adopts the cached form's tensors; a later one that finds the weight changed (the cache's key: an
        optimizer step, a load) quantizes it and copies into them in place, so a graph holding their addresses
        reads the new values and a compiled graph finds tensors of the same shapes (no recompilation)."""
        with torch.no_grad():  # as inside the autograd function: the FP8 form is no function of the weight's graph
            fresh = self.quantize_weight(weight)
            if fresh is self.static:
                return
            if self.static is None:
                self.static = fresh
                return
            for dst, src in zip(self.static, fresh):
                dst.copy_(src)
        c = self._wcache
        if c is not None and c[2] is fresh:
            self._wcache = (c[0], c[1], self.static)  # the fresh copies go

    def drop_weight_cache(self) -> None:
        """Forget the cached FP8 weight (frees its memory; the next call re-quantizes)."""
        self._wcache = None

    def _quantize_delayed(self, state: DelayedScaling, role: str, x: torch.Tensor, fmt: str, cast):
        if self._per_step:
            return self._quantize_per_step(state, x, fmt, cast)
        # a forward run while autograd executes a backward is an activation recomputation:
        # reuse the scale in force (the original forward's) and record nothing
        if role != "grad_output" and torch._C._current_graph_task_id() != -1:
            q, qt, _ = cast(x, state.scale, fmt)
            return q, qt, state.scale_inv
        state.flush(self.kernel_ops()[2])
        if state.uses == 0:  # no history yet: this first use is scaled from its own amax
            amax = reduce_amax(_amax(x), self.amax_groups, self.collectives)
            state.set_scale(scale_from_amax(amax, fmt, self.margin))
            q, qt, _ = cast(x, state.scale, fmt)
            state.record(amax)
        else:
            q, qt, amax = cast(x, state.scale, fmt)
            if self.reducer is None:
                state.record(reduce_amax(amax, self.amax_groups, self.collectives))
            else:  # reduced with every layer's when the next use needs it (scaling.py)
                state.record(amax, self.reducer)
        return q, qt, state.scale_inv

    def _quantize_per_step(self, state: DelayedScaling, x: torch.Tensor, fmt: str, cast):
        """Delayed scaling, one update per optimizer step (scaling.py): the scale in force (the first step: this
        use's own local amax, no collective: the step's end reduces it with the rest) and the local amax
        max-accumulated in place. Nothing else changes, so a recomputed forward quantizes as its original and the
        path traces into a compiled layer's graph."""
        if self.reducer.primed:
            q, qt, amax = cast(x, state.scale, fmt)
            self.reducer.observe(state, amax)
            return q, qt, state.scale_inv
        amax = _amax(x)
        self.reducer.observe(state, amax)
        return self.kernel_ops()[0](x, amax, fmt, self.margin)

    # ---- checkpoint state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Amax histories and scales per role (empty for the stateless recipes)."""
        return {role: s.state_dict() for role, s in self.states.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.states):
            raise ConfigError(f"--fp8-recipe {self.recipe.fp8_recipe}: the checkpoint's FP8 state for {self.name!r} "
                              f"holds roles {sorted(state)} where this recipe keeps {sorted(self.states)} (it was "
                              "written under another --fp8-recipe); resume with the checkpoint's --fp8-recipe")
        for role, s in state.items():
            self.states[role].load_state_dict(s)
        self.drop_weight_cache()  # its key counts updates, and a loaded state may repeat a count with another scale
        if self.reducer is not None and self.reducer.per_step and any(s.uses for s in self.states.values()):
            self.reducer.primed = True  # a history to scale from: the resumed step quantizes as the uninterrupted one


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar in one reduction (no |x| temporary; exact; NaN propagates).
    Called inside the autograd function, where grad mode is off: no ``detach`` (one dispatch less).
    An empty ``x`` (an MoE expert that got no tokens) has amax 0, so it still joins the reduction."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, math.inf, dtype=torch.float32)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[tokens, features]``; a 2-D ``t`` as it is (no view to dispatch)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class _FP8LinearFn(torch.autograd.Function):
    """forward: ``x @ w.T + b`` with FP8 operands; backward: data- and weight-grad GEMMs in FP8."""

    @staticmethod
    def forward(ctx, x, weight, bias, ex: FP8Linear):
        prov = ex.provider
        x2 = _flat(x)  # [tokens, in]
        if ex.per_tensor:
            qx, qx_t, sx = ex.quantize("input", x2, ex.fwd_fmt)
            qw, qw_t, sw = ex.quantize_weight(weight)
            y = prov.scaled_mm(qx, qw.t(), sx, sw, out_dtype=x.dtype)  # [tokens, out]
            # the backward GEMMs read the transposed copies: [in, tokens] and [in, out], both FP8
            ctx.save_for_backward(qx_t, sx, qw_t, sw)
        else:
            qx, sx = prov.quantize_blocks(x2, ex.fwd_fmt, BLOCK_ACT, ex.margin)
            qw, sw = ex.quantize_weight(weight)
            y = prov.blockwise_mm(qx, sx, BLOCK_ACT, qw.t(), sw.t(), BLOCK_WEIGHT[::-1], out_dtype=x.dtype)
            # NOTE: the weight-grad GEMM contracts over tokens, so x is re-tiled along tokens there;
            # keep it wide (re-quantizing an FP8 copy would round twice).
            ctx.save_for_backward(x2, qw, sw)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.ex, ctx.x_shape, ctx.x_dtype, ctx.w_dtype = ex, x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        if y.dtype != x.dtype:  # the GEMMs return x's dtype already; a bias of another dtype promotes
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        if not torch.is_autocast_enabled(gy.device.type):  # as in FP8Linear.__call__: no context when off
            return _FP8LinearFn._backward(ctx, gy)
        with torch.autocast(gy.device.type, enabled=False):
            return _FP8LinearFn._backward(ctx, gy)

    @staticmethod
    def _backward(ctx, gy):
        # B / W of a split backward compute one side each (split_backward.py); B quantizes the output gradient
        # once and hands W the form its GEMM reads (and the bias gradient), as one unsplit backward quantizes it
        need_dx = ctx.needs_input_grad[0] and computes_input(ctx)
        need_dw, need_db = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        ops = take(ctx)  # W after B: B's grad_output operands and bias gradient
        saved = ctx.saved_tensors  # unpacked once: a checkpointed forward's saved tensors unpack only once
        dx = None
        if ops is None:
            g2 = _flat(gy)  # [tokens, out]
            dx, g_w = _grad_output_gemms(ctx, saved, g2, need_dx, need_dw)
            ops = (g_w, g2.sum(0, dtype=torch.float32).to(ctx.w_dtype) if need_db else None)
            if defers_weight(ctx):  # B: W takes them
                if need_dw or need_db:
                    stash(ctx, ops)
                ops = (None, None)
        if dx is not None and len(ctx.x_shape) != 2:
            dx = dx.reshape(ctx.x_shape)
        g_w, db = ops
        return dx, None if g_w is None else _wgrad(ctx, saved, g_w), db, None


def _grad_output_gemms(ctx, saved: tuple, g2: torch.Tensor, need_dx: bool, need_w: bool) -> tuple:
    """(the data gradient where ``need_dx``, the weight-gradient GEMM's grad_output operands where ``need_w``):
    per-tensor ``(q(g)^T, scale_inv)`` from the one quantization the data gradient uses too; block-wise
    ``(q(g^T), scales)`` tiled along tokens."""
    ex = ctx.ex
    prov = ex.provider
    dx = g_w = None
    if ex.per_tensor:
        _, _, qw_t, sw = saved
        qg, qg_t, sg = ex.quantize("grad_output", g2, ex.bwd_fmt)
        if need_dx:  # [tokens, out] @ [out, in]
            dx = prov.scaled_mm(qg, qw_t.t(), sg, sw, out_dtype=ctx.x_dtype)
        if need_w:
            g_w = (qg_t, sg)
    else:
        _, qw, sw = saved
        if need_dx:
            qg, sg = prov.quantize_blocks(g2, ex.bwd_fmt, BLOCK_ACT, ex.margin)
            dx = prov.blockwise_mm(qg, sg, BLOCK_ACT, qw, sw, BLOCK_WEIGHT, out_dtype=ctx.x_dtype)
        if need_w:
            g_w = prov.quantize_blocks(g2.t(), ex.bwd_fmt, BLOCK_ACT, ex.margin)  # tiles along tokens
    return dx, g_w


def _wgrad(ctx, saved: tuple, g_w: tuple) -> torch.Tensor:
    """The weight gradient ``g^T x`` from the grad_output operands of :func:`_grad_output_gemms`, rounded once from
    the fp32 accumulator to the weight dtype."""
    ex = ctx.ex
    prov = ex.provider
    if ex.per_tensor:
        qx_t, sx, _, _ = saved
        qg_t, sg = g_w  # [out, tokens] @ [tokens, in]
        return prov.scaled_mm(qg_t, qx_t.t(), sg, sx, out_dtype=ctx.w_dtype)
    x2 = saved[0]
    qgt, sgt = g_w
    qxt, sxt = prov.quantize_blocks(x2, ex.fwd_fmt, BLOCK_ACT[::-1], ex.margin)
    return prov.blockwise_mm(qgt, sgt, BLOCK_ACT, qxt, sxt, BLOCK_ACT[::-1], out_dtype=ctx.w_dtype)
