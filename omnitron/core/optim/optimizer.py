"""Mixed-precision optimizer: fp32 master weights and state, AdamW (fused kernel) or SGD.

One step: gather each parameter's gradient (``param.main_grad`` from the data-parallel wrapper,
else ``.grad``) as fp32, unscale it (fp16), skip the step if any rank saw inf/nan, clip by the
global norm, update the fp32 masters, copy them back into the bf16/fp16 model parameters.
A float64 model is its own master: its gradients, masters, optimizer states (moments stored at
fp32 become float64), gradient norm and clip factor stay float64 (:func:`master_dtype`), so a
float64 run is float64 end to end (DESIGN's ~1e-12 parity with one process).
Weight decay never touches biases and norm weights (every 1-D parameter). With ``--decoupled-lr``
the input embedding and output layer (``param.is_embedding_or_output_parameter``, set by the
models as in Megatron-Core) step with the decoupled rate the schedule gives for them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim.clip import clip_coefficient, global_count_zeros, global_grad_norm
from omnitron.core.optim.moments import (absmax, join_master, master_finite, new_scale, new_scales, split_master,
                                         state_dtype, store, unscaled)

MOMENT_CHUNK = 1 << 24
"""Elements per step of moments below fp32 and of masters kept as remainders, through fp32 copies (64 MiB each)."""
MOMENTS = ("exp_avg", "exp_avg_sq")


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a ``dtype`` parameter's master, gradient copy and full-precision optimizer state: float64 for
    float64 (a float64 run stays float64), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def keeps_master(dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` parameter has a separate master (bf16 / fp16); fp32 and float64 ones are their own."""
    return master_dtype(dtype) != dtype


@dataclass
class StepResult:
    """What one optimizer step did, for logging."""

    skipped: bool
    grad_norm: float | None
    """Global gradient norm before clipping (None when the step was skipped)."""
    lr: float
    loss_scale: float | None
    num_zeros_in_grad: int | None = None
    """Gradient elements exactly zero, each counted once (only when the step was asked to count)."""


def _decays(name: str, param: torch.nn.Parameter, qk_layernorm: bool = False) -> bool:
    """Biases and norm weights (all 1-D tensors) are not decayed; with ``qk_layernorm``
    (--apply-wd-to-qk-layernorm) the query and key norms' weights and biases are (Megatron's rule in
    ``get_standard_config_overrides``, by the same parameter names)."""
    if qk_layernorm and ("q_layernorm." in name or "k_layernorm." in name):
        return True
    return param.ndim > 1 and not name.endswith(".bias")


def _decoupled(param: torch.nn.Parameter) -> bool:
    """The input embedding and output layer: the parameters --decoupled-lr applies to."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


class MixedPrecisionOptimizer:
    """Owns fp32 masters for low-precision params; fp32 and float64 params are their own masters.

    ``named_params``: (name, param) pairs of every local model chunk, in a fixed order (names
    key the state dict, so a checkpoint loads into the same layout). ``duplicates``: params
    not counted in the global grad norm (the pipeline's copy of a tied embedding).
    """

    def __init__(self, named_params, config: OptimizerConfig, groups, *, backend, loss_scaler=None,
                 duplicates=()) -> None:
        self.config, self.groups, self.backend = config, groups, backend
        self.loss_scaler = loss_scaler
        self.names: list[str] = []
        self.params: list[torch.nn.Parameter] = []
        for name, p in named_params:
            if p.requires_grad:
                self.names.append(name)
                self.params.append(p)
        self.duplicates = {id(p) for p in duplicates}
        self.step_count = 0
        self.weight_decay = config.weight_decay
        """The decay of the latest step (the schedule's with --weight-decay-incr-style; 1-D parameters get none)."""
        self.copy_timer = "optimizer-copy-main-to-model-params"
        """The timer name of :meth:`_copy_to_model` (``--timing-log-level 1``)."""
        self.remainders: list[torch.Tensor | None] = []
        """Per master: the int16 low halves of a bf16 parameter's fp32 master (``store_param_remainders``; the
        master is then the parameter itself, :mod:`omnitron.core.optim.moments`), else None."""
        self._build_masters()
        if len(self.remainders) != len(self.masters):  # optimizers that build their masters otherwise keep none
            self.remainders = [None] * len(self.masters)
        self.state = self._zero_state()
        self.scales = new_scales(self.state)
        """fp16 moments' per-tensor scales (:mod:`omnitron.core.optim.moments`), by state key."""
        self._scratch_bufs: dict[int, torch.Tensor] = {}

    def _build_masters(self) -> None:
        """``masters`` (fp32; fp32 and float64 parameters are their own) and their ``decay`` flags, one per
        parameter."""
        self.decay = [_decays(n, p, self.config.apply_wd_to_qk_layernorm) for n, p in zip(self.names, self.params)]
        self.decoupled = [_decoupled(p) for p in self.params]
        self.masters = []
        for p in self.params:
            self._add_master(p.detach())

    def _add_master(self, param: torch.Tensor) -> None:
        """Append the master of ``param`` (a parameter or its owned flat slice): the tensor itself when fp32 or
        float64; with ``store_param_remainders`` a bf16 one itself too, beside zero remainders (the master is the
        parameter's value, as TE starts it); else an fp32 copy."""
        if self.config.store_param_remainders and param.dtype == torch.bfloat16:
            if not param.is_contiguous():
                raise ValueError(f"a parameter of shape {tuple(param.shape)} is not contiguous; master remainders "
                                 f"(store_param_remainders) pair it element for element with its int16 remainder")
            self.masters.append(param)
            self.remainders.append(torch.zeros(param.numel(), dtype=torch.int16, device=param.device))  # flat
        else:
            self.masters.append(param.to(master_dtype(param.dtype)))  # fp32 / float64: the parameter; else a copy
            self.remainders.append(None)

    def _zero_state(self) -> dict[str, list[torch.Tensor]]:
        """Fresh optimizer states shaped like the masters: Adam's two moments, or SGD's momentum; a moment stored at
        fp32 takes its master's dtype (float64 for a float64 model)."""
        state: dict[str, list[torch.Tensor]] = {}
        if self.config.optimizer in ("adam", "adamw", "onebit_adam", "muon"):  # Muon: exp_avg is its momentum
            for key in ("exp_avg", "exp_avg_sq"):
                dt = state_dtype(self.config, key)
                if dt != torch.float32 and any(m.dtype == torch.float64 for m in self.masters):
                    raise ValueError(f"--{key.replace('_', '-')}-dtype below fp32 with float64 parameters: the "
                                     f"moments of a float64 model are float64; drop --{key.replace('_', '-')}-dtype")
                state[key] = [torch.zeros_like(m, dtype=master_dtype(m.dtype) if dt == torch.float32 else dt)
                              for m in self.masters]
        elif self.config.optimizer == "sgd" and self.config.sgd_momentum:
            state["momentum"] = [torch.zeros_like(m) for m in self.masters]
        return state

    # ---- gradients ----------------------------------------------------------------------
    def _scratch(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like ``like`` (a master: fp32 or float64) for gradient ``i``: made on first use and reused
        every step (the step scales its gradients in place, so a caller refills it each time)."""
        buf = self._scratch_bufs.get(i)
        dt = master_dtype(like.dtype)
        if buf is None or buf.shape != like.shape or buf.device != like.device or buf.dtype != dt:
            buf = self._scratch_bufs[i] = torch.empty(like.shape, dtype=dt, device=like.device)
        return buf

    def _fp32_grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient in its master's dtype (fp32; float64 for a float64 model): ``main_grad`` or
        ``.grad`` itself when of that dtype, else a reused buffer (zeros for a parameter without a gradient, the
        converted gradient for a low-precision one)."""
        out = []
        for i, (p, m) in enumerate(zip(self.params, self.masters)):
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is None:
                out.append(self._scratch(i, m).zero_())
            else:
                out.append(self._scratch(i, m).copy_(g) if g.dtype != master_dtype(m.dtype) else g.detach())
        return out

    def _found_inf(self, grads: list[torch.Tensor]) -> bool:
        """Any inf/nan on any rank of the replica (one device sync, one all-reduce)."""
        if grads:
            flag = torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float().reshape(1)
        else:
            flag = torch.zeros(1, dtype=torch.float32)
        for group in self._replica_groups():
            if group.handle is not None:
                self.backend.collectives.all_reduce(flag, op=ReduceOp.MAX, group=group.handle)
        return bool(flag.item() > 0)

    def _replica_groups(self) -> tuple:
        """Groups whose ranks together hold every gradient element (each replica holds all of them;
        MoE experts are spread over ``groups.ep``, and ranks that differ only in edp hold the same ones)."""
        return (self.groups.tp_pp_cp, self.groups.ep)

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """Global L2 norm of ``grads`` (aligned with ``self.params``), equal to the single-process norm."""
        return global_grad_norm(self.params, grads, self.groups, self.backend.collectives, self.backend.kernels,
                                self.duplicates, dtype=self._norm_dtype())

    def _norm_dtype(self) -> torch.dtype:
        """float64 when the model is float64 (every rank of the model decides alike), else fp32: the dtype the
        gradient norm's squares are summed and reduced in."""
        return torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32

    def _clip_coefficient(self, norm: float) -> float:
        """The factor this step's gradients are multiplied by (``--clip-grad`` against the global norm)."""
        return clip_coefficient(norm, self.config.clip_grad)

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        """Zero elements of ``grads`` (aligned with ``self.params``), counted as the norm counts them."""
        return global_count_zeros(self.params, grads, self.groups, self.backend.collectives, self.duplicates)

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy model parameters into the fp32 masters (after loading weights into the model)."""
        for p, m in zip(self.params, self.masters):
            if m.data_ptr() != p.data_ptr():
                m.copy_(p)
        self._zero_remainders()

    def _zero_remainders(self) -> None:
        """Masters kept as remainders become their parameters' values (after the parameters were loaded)."""
        for r in self.remainders:
            if r is not None:
                r.zero_()

    def saved_masters(self) -> list[torch.Tensor]:
        """The fp32 masters as checkpoints hold them: each master, or for one kept as a remainder its fp32 value
        joined from the parameter (a new tensor)."""
        return [m if r is None else join_master(m.view(-1), r).view(m.shape)
                for m, r in zip(self.masters, self.remainders)]

    def masters_finite(self) -> list[torch.Tensor]:
        """Per master, whether all its fp32 values are finite (a 0-dim bool tensor, no host sync): a master kept as
        a remainder is read joined, a chunk at a time (its bf16 parameter alone is no witness: a finite master near
        fp32's largest rounds to an inf parameter)."""
        return [torch.isfinite(m).all() if r is None else master_finite(m.view(-1), r, MOMENT_CHUNK)
                for m, r in zip(self.masters, self.remainders)]

    def set_master(self, j: int, x: torch.Tensor) -> None:
        """Master ``j`` := fp32 ``x`` (its shape or flat): copied, or split into the parameter and its remainder
        (the parameter changes: the distributed optimizer's callers gather the parameters afterwards)."""
        m, r = self.masters[j], self.remainders[j]
        if r is None:
            m.copy_(x.reshape(m.shape))
        else:
            split_master(x.reshape(-1).to(torch.float32, copy=True), m.view(-1), r)

    def load_saved_masters(self, masters: list[torch.Tensor]) -> None:
        """Store :meth:`saved_masters`' tensors (filled from a checkpoint) back: the remainders' are split into the
        parameters and remainders (then, under the distributed optimizer, the parameters gathered); the others were
        the masters themselves."""
        for j, x in enumerate(masters):
            if self.remainders[j] is not None:
                self.set_master(j, x)
        self._after_master_load()

    def _after_master_load(self) -> None:
        """Nothing: every rank holds its parameters whole."""

    def grad_reduction_over_dp(self) -> bool:
        """Whether the data-parallel wrapper averages this step's gradients over dp x cp (always, here;
        1-bit Adam's compressed stage reduces the momentum instead)."""
        return True

    def zero_grad(self) -> None:
        """Drop ``.grad`` (the data-parallel wrapper zeroes its own ``main_grad`` buffers)."""
        for p in self.params:
            p.grad = None

    # ---- the step -----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, lr: float, *, count_zeros: bool = False, timers=None, check_norm=None,
             decoupled_lr: float | None = None, weight_decay: float | None = None) -> StepResult:
        """Unscale, skip on overflow, clip, update the fp32 masters, copy them into the model (in that order).

        ``decoupled_lr``: the rate of the embedding and output layer (None: ``lr`` for every parameter).
        ``weight_decay``: this step's decay of the decayed parameters (None: --weight-decay).

        ``count_zeros``: also count the zero gradient elements (after unscaling, before clipping).
        ``timers``: the run's :class:`~omnitron.core.training.timers.Timers` (times the copy into the model).
        ``check_norm``: called with the global gradient norm before anything is changed, also on a loss-scale
        overflow (before the scaler's update); raising there leaves weights, optimizer and scaler state as they were
        (--check-for-nan-in-loss-and-grad)."""
        grads = self._fp32_grads()
        scale = self.loss_scaler.scale if self.loss_scaler is not None else None
        if self.loss_scaler is not None:
            _scale_(grads, 1.0 / scale)  # NOTE: in place: the step consumes the gradients
            found_inf = self._found_inf(grads)
            if found_inf and check_norm is not None:
                # NOTE: as Megatron, whose check of the gradients (on with a constant scale) runs before its scaler
                # sees them: the check stops the run, a skip needs it off. found_inf is the replica's: all ranks
                # come here and take the norm's collectives together.
                check_norm(self._grad_norm(grads))
            self.loss_scaler.update(found_inf)
            if found_inf:
                return StepResult(True, None, lr, scale)
        norm = self._grad_norm(grads)
        if check_norm is not None:
            check_norm(norm)
        zeros = self._count_zeros(grads) if count_zeros else None
        coef = self._clip_coefficient(norm)
        if not coef >= 1.0:  # NOTE: also NaN (a NaN norm must not leave the gradients unclipped)
            _scale_(grads, coef)
        self.step_count += 1
        self.weight_decay = self.config.weight_decay if weight_decay is None else weight_decay
        rates = [decoupled_lr if d and decoupled_lr is not None else lr for d in self.decoupled]
        if "exp_avg" in self.state:
            self._adamw(grads, rates)
        else:
            self._sgd(grads, rates)
        copy = timers(self.copy_timer) if timers is not None else None
        if copy is not None:
            copy.start()
        self._copy_to_model()
        if copy is not None:
            copy.stop()
        for p in self.params:
            # .data writes and fused kernels bypass the version counter: bump it so caches keyed on it
            # (the FP8 executor's quantized weights) see the update
            torch.autograd.graph.increment_version(p)
        return StepResult(False, norm, lr, scale, zeros)

    def _copy_to_model(self) -> None:
        """Write the updated fp32 masters into the (bf16/fp16) model parameters."""
        for p, m in zip(self.params, self.masters):
            if keeps_master(p.dtype) and m.data_ptr() != p.data_ptr():  # remainders: the step wrote p itself
                p.data.copy_(m)

    def _adamw(self, grads: list[torch.Tensor], rates: list[float], only: list[int] | None = None) -> None:
        """One fused AdamW launch per (weight decay, rate) group for the masters that step in fp32 directly, and
        :meth:`_adamw_low` for each of the others; ``rates``: each master's learning rate; ``only``: the masters to
        step (default: all)."""
        c = self.config
        keys = {i: (self.decay[i], rates[i]) for i in (range(len(self.masters)) if only is None else only)}
        for decay, lr in dict.fromkeys(keys.values()):
            idx = [i for i, key in keys.items() if key == (decay, lr)]
            step = functools.partial(self.backend.kernels.adamw_step, step=self.step_count, lr=lr,
                                     beta1=c.adam_beta1, beta2=c.adam_beta2, eps=c.adam_eps,
                                     weight_decay=self.weight_decay if decay else 0.0)
            fused = [i for i in idx if not self._steps_low_at(i)]
            for i in idx:
                if self._steps_low_at(i):
                    self._adamw_low(i, grads[i], step)
            if fused:
                step([self.masters[i] for i in fused], [grads[i] for i in fused],
                     [self.state["exp_avg"][i] for i in fused], [self.state["exp_avg_sq"][i] for i in fused])

    def _steps_low(self) -> bool:
        """Whether Adam steps any master through :meth:`_adamw_low` (a moment below fp32, or a master kept as a
        remainder)."""
        return any(self._steps_low_at(i) for i in range(len(self.masters)))

    def _steps_low_at(self, i: int) -> bool:
        """Whether Adam steps master ``i`` through :meth:`_adamw_low`: moments below fp32 (all masters), or this
        master kept as a remainder. The others (fp32 moments and master) go through the fused launch."""
        return (self.config.optimizer in ("adam", "adamw")
                and (any(state_dtype(self.config, k) != torch.float32 for k in MOMENTS)
                     or self.remainders[i] is not None))

    def _adamw_low(self, i: int, grad: torch.Tensor, step) -> None:
        """Master ``i``'s step with moments below fp32 or a master kept as a remainder, through fp32 copies of at
        most ``MOMENT_CHUNK`` elements (the step is elementwise: the whole tensor's numbers, a bounded temporary).
        An fp16 moment's new scale is the whole updated moment's absmax: a first pass steps copies chunk by chunk
        and keeps the running absmax (the max of the chunks' is the whole's, exactly), the second steps for real
        and stores every chunk with that scale."""
        p, m, v, r = self.masters[i], self.state["exp_avg"][i], self.state["exp_avg_sq"][i], self.remainders[i]
        if not all(t.is_contiguous() for t in (p, grad, m, v)):  # never with remainders (checked when built)
            m32, v32 = self.moment("exp_avg", i), self.moment("exp_avg_sq", i)
            step([p], [grad], [m32], [v32])
            self.put("exp_avg", i, m32)
            self.put("exp_avg_sq", i, v32)
            return
        flat = [t.view(-1) for t in (p, grad, m, v)]
        old = [self.scales[k][i] if k in self.scales else None for k in MOMENTS]
        fresh = old
        if any(s is not None for s in old) and p.numel():
            amax = [None, None]
            for a in range(0, p.numel(), MOMENT_CHUNK):
                got = _chunk_step([t[a:a + MOMENT_CHUNK] for t in flat], None if r is None else r[a:a + MOMENT_CHUNK],
                                  step, old, None)
                amax = [g if x is None else torch.maximum(x, g) for x, g in zip(amax, got)]
            fresh = [None if s is None else torch.empty_like(s) for s in old]
            for f, x in zip(fresh, amax):
                if f is not None:
                    new_scale(x, f)
        for a in range(0, p.numel(), MOMENT_CHUNK):
            _chunk_step([t[a:a + MOMENT_CHUNK] for t in flat], None if r is None else r[a:a + MOMENT_CHUNK], step,
                        old, fresh)
        for s, f in zip(old, fresh):
            if s is not None:
                s.copy_(f)

    def compute_dtype(self, key: str, i: int) -> torch.dtype:
        """The dtype state ``key`` of master ``i`` is read and stepped in: fp32 for one stored below fp32, else its
        own (fp32, or float64 for a float64 model: a float64 checkpoint's state loads unrounded)."""
        dt = self.state[key][i].dtype
        return torch.float32 if dt in (torch.bfloat16, torch.float16) else dt

    def moment(self, key: str, i: int) -> torch.Tensor:
        """State ``key`` of master ``i`` as fp32 (unscaled; the tensor itself when stored in fp32)."""
        return unscaled(self.state[key][i], self.scales[key][i] if key in self.scales else None)

    def put(self, key: str, i: int, x: torch.Tensor) -> None:
        """Store fp32 ``x`` (consumed) as state ``key`` of master ``i``, in its dtype (TE's rounding and scaling)."""
        store(self.state[key][i], x, self.scales[key][i] if key in self.scales else None)

    def saved_state(self) -> dict[str, list[torch.Tensor]]:
        """The state as checkpoints hold it: fp16 moments unscaled, as fp32 (TE's state_dict); others as stored."""
        return {k: [self.moment(k, i) for i in range(len(v))] if k in self.scales else v
                for k, v in self.state.items()}

    def load_saved_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Store :meth:`saved_state`'s tensors (filled from a checkpoint) back: fp16 moments are scaled afresh;
        the others were the state itself."""
        for k in self.scales:
            for i, x in enumerate(state[k]):
                self.put(k, i, x)

    def _sgd(self, grads: list[torch.Tensor], rates: list[float]) -> None:
        """torch.optim.SGD's rule: g += wd * p; buf = mu * buf + g; p -= lr * buf."""
        c = self.config
        bufs = self.state.get("momentum")
        for i, (m, g, lr) in enumerate(zip(self.masters, grads, rates)):
            if self.weight_decay and self.decay[i]:
                g = g.add(m, alpha=self.weight_decay)
            if bufs is not None:
                buf = bufs[i]
                if self.step_count == 1:
                    buf.copy_(g)
                else:
                    buf.mul_(c.sgd_momentum).add_(g)
                g = buf
            m.add_(g, alpha=-lr)

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Tensors keyed by parameter name; fp32 masters only for low-precision params (a float64 model's states
        are saved float64)."""
        out = {"step": self.step_count, "optimizer": self.config.optimizer, "tensors": {}}
        state, masters = self.saved_state(), self.saved_masters()
        for i, name in enumerate(self.names):
            entry = {k: v[i] for k, v in state.items() if self.keeps(k, i)}
            if keeps_master(self.params[i].dtype):
                entry["master"] = masters[i]
            out["tensors"][name] = entry
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    def keeps(self, key: str, i: int) -> bool:
        """Whether state ``key`` is kept (and checkpointed) for parameter ``i`` (Muon keeps no ``exp_avg_sq``
        for its matrices)."""
        return True

    def state_bytes(self) -> int:
        """Bytes of storage this rank holds for masters, optimizer states and fp16 moments' scales (masters that
        are the model's own fp32 parameters excluded): measured on the tensors' storages, for memory reports."""
        params = {p.untyped_storage().data_ptr() for p in self.params}
        seen: dict[int, int] = {}
        kept = [*self.masters, *(r for r in self.remainders if r is not None)]
        for t in [*kept, *(t for bufs in [*self.state.values(), *self.scales.values()] for t in bufs)]:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def _check_loadable(self, state: dict) -> None:
        """Raise a clear error when ``state`` was saved for another optimizer or model."""
        if state["optimizer"] != self.config.optimizer:
            raise ValueError(f"checkpoint optimizer {state['optimizer']!r} differs from --optimizer "
                             f"{self.config.optimizer!r}; pass the same --optimizer or use --no-load-optim")
        missing = sorted(set(self.names) - set(state["tensors"]))
        if missing:
            raise ValueError(f"checkpoint optimizer state lacks parameters {missing[:3]}...; the model differs")

    def load_state_dict(self, state: dict) -> None:
        self._check_loadable(state)
        with torch.no_grad():
            for i, name in enumerate(self.names):
                entry = state["tensors"][name]
                for key in self.state:
                    if self.keeps(key, i):
                        self.put(key, i, entry[key].to(self.compute_dtype(key, i), copy=True))
                if "master" in entry:
                    self.set_master(i, entry["master"])
        self.load_counters(state)

    def rank_state_dict(self) -> dict | None:
        """State that differs between data-parallel replicas (None here: every replica holds the same);
        checkpoints keep it per rank."""
        return None

    def load_rank_state_dict(self, saved: dict | None) -> None:
        """Restore :meth:`rank_state_dict` (None: the checkpoint has none for this rank and layout)."""

    def load_counters(self, state: dict) -> None:
        """The step count and the loss scaler's state."""
        self.step_count = int(state["step"])
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


class ShardedOverDataParallel:
    """Mixin for optimizers whose ranks own disjoint parts of every gradient over ``groups.dp_cp`` (the
    distributed optimizer's slices, FSDP2's shards): the inf check, the norm and the zero count run over
    the whole world (dp_cp x mp) with each part counted once. ``_owners()``: the parameter of each gradient."""

    def _owners(self) -> list[torch.nn.Parameter]:
        raise NotImplementedError

    def _replica_groups(self) -> tuple:
        # NOTE: dp_cp x tp_pp_cp is the whole world: every part is checked
        return (self.groups.dp_cp, self.groups.tp_pp_cp)

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        # NOTE: dense parts are disjoint over dp_cp and expert slices over edp; dp_cp x mp is the world
        return global_grad_norm(self._owners(), grads, self.groups, self.backend.collectives, self.backend.kernels,
                                self.duplicates, reduce_over=(self.groups.dp_cp, self.groups.mp),
                                device=self.backend.current_device(), dtype=self._norm_dtype())

    def _count_zeros(self, grads: list[torch.Tensor]) -> int:
        return global_count_zeros(self._owners(), grads, self.groups, self.backend.collectives, self.duplicates,
                                  reduce_over=(self.groups.dp_cp, self.groups.mp), device=self.backend.current_device())


def _scale_(grads: list[torch.Tensor], coef: float) -> None:
    """Multiply ``grads`` by ``coef`` in place (the loss scaler's unscaling, the clip), each element computed in fp32
    and rounded once to its dtype, as Megatron's multi_tensor_scale with an fp32 factor scales bf16 main grads. The
    factor goes as an fp32 tensor: CPU's ``_foreach_mul_`` rounds a Python number to a bf16 list's dtype first, a
    second rounding (up to 2^-8) of every scaled gradient. Float64 gradients (a float64 model) get the factor in
    float64: an fp32 one would scale every one of them by a factor off by up to 2^-24."""
    if grads:
        wide = any(g.dtype == torch.float64 for g in grads)
        factor = torch.full((), coef, dtype=torch.float64 if wide else torch.float32, device=grads[0].device)
        torch._foreach_mul_(grads, factor)


def _chunk_step(pieces: list[torch.Tensor], rem: torch.Tensor | None, step, old: list, fresh: list | None):
    """One chunk of :meth:`MixedPrecisionOptimizer._adamw_low`: ``pieces`` = (master or bf16 parameter, gradient,
    exp_avg, exp_avg_sq) chunks, ``rem`` the master's remainders (None: ``pieces[0]`` is the fp32 master), ``old``
    the moments' current scales (None: not fp16). With ``fresh`` None, a dry run on copies returning each fp16
    moment's new absmax (None for the others); else the moments are stored with the scales ``fresh`` and the
    master written back."""
    pc, gc, mc, vc = pieces
    dry = fresh is None
    p32 = join_master(pc, rem) if rem is not None else pc.clone() if dry else pc
    m32, v32 = (t.clone() if dry and t.dtype == torch.float32 else unscaled(t, s) for t, s in zip((mc, vc), old))
    step([p32], [gc], [m32], [v32])
    if dry:
        return [None if s is None else absmax(x) for x, s in zip((m32, v32), old)]
    store(mc, m32, fresh[0], rescale=False)
    store(vc, v32, fresh[1], rescale=False)
    if rem is not None:
        split_master(p32, pc, rem)
    return None
