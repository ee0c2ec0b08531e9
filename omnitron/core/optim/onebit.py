"""1-bit Adam (``--optimizer onebit_adam``): DeepSpeed's algorithm on the engine's fp32 masters.

Two stages, switched by the step count:

* warm-up, steps 1..F (``F`` = ``--onebit-freeze-step``): exactly the AdamW of
  :class:`MixedPrecisionOptimizer` (same kernel, same state), on gradients the data-parallel wrapper
  averaged as usual.
* compressed, steps > F: the variance ``v`` is frozen at step F. The wrapper no longer reduces gradients
  over data parallelism (:meth:`OneBitAdam.grad_reduction_over_dp` is False; the sums over tp and over
  the tied embedding's stages still happen); each rank folds its *local* gradient into the momentum,
  ``m = b1 m + (1 - b1) g_local``, and ``m`` is replaced by its 1-bit compressed mean over ``groups.dp_cp``
  (:func:`~omnitron.core.parallel.data.compressed.compressed_all_reduce`, error feedback on both sides).
  The update is AdamW's with the frozen variance: ``p *= 1 - lr wd`` (decoupled, 2-D weights only), then
  ``p -= lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^F)) + eps)`` (the bias corrections continue AdamW's: the
  variance's stays at its step-F value).

Gradient clipping: ``--clip-grad`` applies in the warm-up only. In the compressed stage no rank holds the
mean gradient, only its own; the norm logged (and checked for NaN/inf, on every rank alike) is the root
mean square over dp ranks of the local norms, sqrt(mean_r |g_r|^2), one extra all-reduce of a scalar. It
is not used to clip: where gradient noise dominates it exceeds the mean gradient's norm by up to sqrt(dp)
(3.2 against 1.0 at dp4 in benchmarks/onebit.py), and with the variance frozen a clipped step is a smaller
learning rate, not a safer direction.

Compressed buffers: parameters are grouped so that ranks holding copies of the same parameters compress
them identically: tensor-parallel shards, tp-replicated parameters (identical on every tp rank), and the
tied word embedding's copies (``isolate``: one buffer each on the first and the last stage). Each group's
momenta are views into one flat fp32 buffer that is compressed in place.

Memory: the compressed step works one tensor at a time (the preconditioner is recomputed rather than kept) and
compresses piece by piece (``compressed.PIECE``): its temporaries are one tensor's preconditioner or one
piece's, 0.25x the fp32 model at dp2 and dp4 where they were 6.6x (tests/optim/test_onebit_adam.py).
"""
from __future__ import annotations

import logging
import math

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.optim.optimizer import MixedPrecisionOptimizer
from omnitron.core.parallel.data.compressed import ErrorFeedback, compressed_all_reduce

log = logging.getLogger("omnitron.train")

DEFAULT_FREEZE_FRACTION = 0.15
"""Warm-up share of the run when --onebit-freeze-step is not given. NOTE: the 1-bit Adam paper (Tang et
al., 2021) keeps exact Adam for roughly the first 15-25% of BERT pre-training before freezing the variance;
we take the low end, as the variance of a small LM settles early."""


SCALE_BLOCK = 256
"""Elements per compression scale. NOTE: one scale per whole chunk (1/dp of the model) gives every element
of the embedding the chunk's mean magnitude; blocks of 256 follow the magnitudes of the tensors and their
rows, for 4 / 256 bytes per element more: 1/8 + 1/64 bytes per element in all."""


def adam_ratio_bound(beta1: float, beta2: float) -> float:
    """The largest |m / sqrt(v)| exact Adam can reach (no bias correction): by Cauchy-Schwarz on
    m = (1 - b1) sum_k b1^k g_k and v = (1 - b2) sum_k b2^k g_k^2,
    |m| <= (1 - b1) / sqrt(1 - b2) x sqrt(sum_k (b1^2 / b2)^k) x sqrt(v) = that / sqrt(1 - b1^2 / b2) x sqrt(v)
    (7.27 at 0.9, 0.999). Needs b1^2 < b2."""
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1 ** 2 / beta2))


def resolve_freeze_step(config, train_iters: int | None) -> int:
    """The last warm-up step: ``--onebit-freeze-step``, else 15% of ``train_iters`` (at least 1)."""
    if config.onebit_freeze_step is not None:
        return config.onebit_freeze_step
    return max(1, round(DEFAULT_FREEZE_FRACTION * (train_iters or 0)))


def _denominator(v: torch.Tensor, bc2: float, eps: float) -> torch.Tensor:
    """``sqrt(v / bc2) + eps``: the frozen preconditioner of one tensor."""
    return v.div(bc2).sqrt_().add_(eps)


class OneBitAdam(MixedPrecisionOptimizer):
    """:class:`MixedPrecisionOptimizer` with AdamW until ``freeze_step``, 1-bit Adam after (module docstring).

    ``isolate``: parameters compressed in a buffer of their own (the tied embedding's copies, so the first
    and the last pipeline stage take the same update)."""

    def __init__(self, named_params, config, groups, *, backend, freeze_step: int, loss_scaler=None,
                 duplicates=(), isolate=()) -> None:
        if loss_scaler is not None:
            raise ValueError("--optimizer onebit_adam does not support --fp16 loss scaling; use --bf16")
        if not config.adam_beta1 ** 2 < config.adam_beta2:
            raise ValueError(f"--optimizer onebit_adam needs --adam-beta1^2 < --adam-beta2 (its update bound), got "
                             f"{config.adam_beta1} and {config.adam_beta2}")
        if freeze_step < 1:
            raise ValueError(f"--onebit-freeze-step must be >= 1 (the variance needs warm-up steps), got {freeze_step}")
        named_params = list(named_params)
        wide = next((n for n, p in named_params if p.dtype == torch.float64), None)
        if wide is not None:
            raise ValueError(f"--optimizer onebit_adam keeps its momenta and compression errors in fp32, but {wide} is "
                             f"float64; train a float64 model with --optimizer adam")
        super().__init__(named_params, config, groups, backend=backend, loss_scaler=None, duplicates=duplicates)
        self.freeze_step = freeze_step
        self.dp = groups.dp_cp
        isolated = {id(p) for p in isolate}
        kinds: dict[str, list[int]] = {}
        for i, p in enumerate(self.params):
            kind = "shared" if id(p) in isolated else (
                "tp" if getattr(p, "tensor_model_parallel", False) else "replicated")
            kinds.setdefault(kind, []).append(i)
        self.buffers: list[list[int]] = list(kinds.values())
        """Indices into ``params`` of each compressed buffer, in a fixed order."""
        self.flat: list[torch.Tensor] = []
        """Each buffer's momenta, flat fp32 (``state["exp_avg"][i]`` are views)."""
        for idx in self.buffers:
            flat = torch.zeros(sum(self.masters[i].numel() for i in idx), dtype=torch.float32,
                               device=self.masters[idx[0]].device)
            start = 0
            for i in idx:
                n = self.masters[i].numel()
                self.state["exp_avg"][i] = flat[start:start + n].view_as(self.masters[i])
                start += n
            self.flat.append(flat)
        self.errors = self._zero_errors()

    def _zero_errors(self) -> list[ErrorFeedback]:
        return [ErrorFeedback.zeros(f.numel(), self.dp.size, device=f.device, block=SCALE_BLOCK) for f in self.flat]

    # ---- the stage ----------------------------------------------------------------------
    def compressing(self) -> bool:
        """True when the next step is in the compressed stage (after ``freeze_step`` steps)."""
        return self.step_count >= self.freeze_step

    def grad_reduction_over_dp(self) -> bool:
        """Whether the data-parallel wrapper averages this step's gradients over dp (warm-up only)."""
        return not self.compressing()

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        norm = super()._grad_norm(grads)
        if not self.compressing() or self.dp.size == 1:
            return norm
        sq = torch.tensor([norm * norm], dtype=torch.float64, device=self.flat[0].device)
        self.backend.collectives.all_reduce(sq, op=ReduceOp.SUM, group=self.dp.handle)
        return math.sqrt(sq.item() / self.dp.size)  # RMS of the local norms (module docstring)

    def _clip_coefficient(self, norm: float) -> float:
        if self.compressing() and not math.isnan(norm):  # NOTE: a NaN norm still poisons the step, as in AdamW
            return 1.0
        return super()._clip_coefficient(norm)

    def _adamw(self, grads: list[torch.Tensor], rates: list[float]) -> None:
        """``rates``: each master's learning rate (--decoupled-lr for the embedding and output layer)."""
        if self.step_count <= self.freeze_step:  # step_count already counts this step
            return super()._adamw(grads, rates)
        c = self.config
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        bc1 = 1.0 - c.adam_beta1 ** self.step_count
        bc2 = 1.0 - c.adam_beta2 ** self.freeze_step
        # NOTE: what travels is the preconditioned momentum u = m / (sqrt(v / bc2) + eps), not m: v is frozen and
        # the same on every rank, so mean_r(m_r) / d = mean_r(m_r / d) and the exact algorithm is unchanged, but
        # Adam's normalisation makes |u| = O(1) everywhere, so one scale per block fits every element of it
        # (sign-compressing m gives an element of small variance its block's magnitude of m, and then divides
        # it by that small sqrt(v): the dp4 benchmark diverged at iteration 51). Elements whose variance is exactly
        # zero (no gradient in the warm-up: padded vocabulary rows) keep u = 0 (DeepSpeed's exp_avg_mask, automatic).
        # |u| is clamped to the bound exact Adam obeys (:func:`adam_ratio_bound`): with a frozen variance a rare
        # token's embedding row, whose warm-up variance was tiny, reached |u| = 2.7e4 in that benchmark.
        # NOTE: one tensor at a time, the preconditioner computed twice: the temporaries are one tensor's, not a
        # model's worth of preconditioners and masks
        bound = adam_ratio_bound(c.adam_beta1, c.adam_beta2)
        for i, x in enumerate(v):
            m[i].lerp_(grads[i], 1.0 - c.adam_beta1).div_(_denominator(x, bc2, c.adam_eps)).mul_(x.ne(0))
            m[i].clamp_(-bound, bound)
        for flat, err in zip(self.flat, self.errors):
            compressed_all_reduce(flat, err, self.dp, self.backend.collectives)
        for i, (p, lr) in enumerate(zip(self.masters, rates)):
            m[i].mul_(v[i].ne(0))  # the compressed value of a masked element is its block's scale
            if self.weight_decay and self.decay[i]:
                p.mul_(1.0 - lr * self.weight_decay)
            p.add_(m[i], alpha=-lr / bc1)
            m[i].mul_(_denominator(v[i], bc2, c.adam_eps))  # back to the momentum

    # ---- state --------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """The base count plus the error-feedback buffers (worker: the padded buffer; server: its chunk)."""
        return super().state_bytes() + sum(e.worker.untyped_storage().nbytes() + e.server.untyped_storage().nbytes()
                                           for e in self.errors)

    def rank_state_dict(self) -> dict:
        """What only this rank holds: its error feedback (the server error is its own chunk's) and the freeze
        step; checkpoints keep it per rank (``torch``: in the optimizer state, ``torch_dist``: in rank_R.pt).
        Copies: --async-save writes them on a thread while training goes on."""
        return {"freeze_step": self.freeze_step, "worker_error": [e.worker.clone() for e in self.errors],
                "server_error": [e.server.clone() for e in self.errors]}

    def load_rank_state_dict(self, saved: dict | None) -> None:
        """Restore :meth:`rank_state_dict`; without one (another layout, an older checkpoint) the error
        feedback restarts at zero (logged when the run is past the freeze)."""
        if saved is not None and saved["freeze_step"] != self.freeze_step and self.step_count > saved["freeze_step"]:
            raise ValueError(f"the checkpoint's run froze the variance at step {saved['freeze_step']} and is past it; "
                             f"resume with --onebit-freeze-step {saved['freeze_step']} (not {self.freeze_step})")
        if saved is None or len(saved["worker_error"]) != len(self.errors) or any(
                w.numel() != e.worker.numel() for w, e in zip(saved["worker_error"], self.errors)):
            self.errors = self._zero_errors()
            if self.step_count > self.freeze_step and self.groups.rank == 0:
                log.info("onebit_adam: the checkpoint holds no error feedback for this layout; it restarts at zero")
            return
        with torch.no_grad():
            for e, w, s in zip(self.errors, saved["worker_error"], saved["server_error"]):
                e.worker.copy_(w)
                e.server.copy_(s)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "onebit": self.rank_state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.load_rank_state_dict(state.get("onebit"))
