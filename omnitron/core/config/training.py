"""Training, optimizer, precision, logging and checkpoint settings (Megatron flag names in docstrings).

One keyword-only dataclass per concern. ``__post_init__`` checks local invariants and raises
:class:`ConfigError` naming the flag and the fix; checks that need two concerns (batch sizes
against the world, heads against tensor parallelism) run in ``omnitron.core.training.arguments``
(``build_settings`` and the modules it calls: ``batch_settings``, ``settings_checks``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from omnitron.core.config.parallel import ConfigError

MAX_SEED = 2**32 - 1
"""The largest --seed: the data order's ``numpy.random.RandomState(seed)`` (Megatron's shuffle) takes 32 bits."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer and its learning-rate schedule."""

    optimizer: str = "adam"
    """--optimizer {adam,sgd,onebit_adam,muon}: AdamW (decoupled weight decay), SGD with momentum, 1-bit Adam
    (AdamW for --onebit-freeze-step steps, then frozen variance and 1-bit compressed momentum over dp), or Muon
    (Newton-Schulz orthogonalised momentum for the hidden 2-D weights, AdamW for the rest)."""
    lr: float = 1e-4
    """--lr: peak learning rate, reached at the end of warmup."""
    min_lr: float = 0.0
    """--min-lr: the rate the decay ends at (and stays at afterwards)."""
    lr_decay_style: str = "linear"
    """--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD} (Megatron's default: linear)."""
    lr_warmup_iters: int = 0
    """--lr-warmup-iters: linear warmup from 0 to --lr over this many iterations."""
    lr_decay_iters: int | None = None
    """--lr-decay-iters: iteration where the decay ends (default: --train-iters)."""
    lr_wsd_decay_iters: int | None = None
    """--lr-wsd-decay-iters: length of the final decay phase of WSD (required with --lr-decay-style WSD in an
    iteration run, as Megatron's scheduler asserts; it has no default)."""
    lr_wsd_decay_style: str = "exponential"
    """--lr-wsd-decay-style {linear,cosine,exponential,minus_sqrt}: shape of WSD's final decay (Megatron's default:
    exponential, ``2 * 0.5**ratio - 1``)."""
    lr_warmup_samples: int = 0
    """--lr-warmup-samples: with --train-samples, warm up over this many samples (the schedule counts samples)."""
    lr_decay_samples: int | None = None
    """--lr-decay-samples: with --train-samples, the sample count where the decay ends (default: --train-samples)."""
    lr_wsd_decay_samples: int | None = None
    """--lr-wsd-decay-samples: with --train-samples, the samples of WSD's final decay phase (required with WSD)."""
    lr_warmup_init: float = 0.0
    """--lr-warmup-init: the warmup rises linearly from this rate to --lr."""
    decoupled_lr: float | None = None
    """--decoupled-lr: peak rate of the input embedding and the output layer (Megatron's
    ``is_embedding_or_output_parameter``); the same schedule shape as --lr, ending at --decoupled-min-lr."""
    decoupled_min_lr: float | None = None
    """--decoupled-min-lr: where the decoupled rate's decay ends (default: --min-lr)."""
    weight_decay: float = 0.01
    """--weight-decay: decoupled decay; never applied to biases and norm weights (1-D parameters)."""
    apply_wd_to_qk_layernorm: bool = False
    """--apply-wd-to-qk-layernorm: decay the query and key norms' weights and biases too (``q_layernorm`` /
    ``k_layernorm``; Megatron's exception for Qwen3-Next)."""
    weight_decay_incr_style: str = "constant"
    """--weight-decay-incr-style {constant,linear,cosine}: constant applies --weight-decay throughout; linear and
    cosine rise from --start-weight-decay to --end-weight-decay over the run (--train-iters or --train-samples,
    counted as the learning rate is), as Megatron's ``OptimizerParamScheduler.get_wd``."""
    start_weight_decay: float | None = None
    """--start-weight-decay: the weight decay of the first step (only with --weight-decay-incr-style linear|cosine)."""
    end_weight_decay: float | None = None
    """--end-weight-decay: the weight decay reached at the end of the run (only with --weight-decay-incr-style
    linear|cosine)."""
    adam_beta1: float = 0.9
    """--adam-beta1."""
    adam_beta2: float = 0.999
    """--adam-beta2."""
    adam_eps: float = 1e-8
    """--adam-eps."""
    sgd_momentum: float = 0.9
    """--sgd-momentum."""
    clip_grad: float = 1.0
    """--clip-grad: clip the global gradient norm (all tp/pp/dp ranks) to this; 0 disables."""
    onebit_freeze_step: int | None = None
    """--onebit-freeze-step N: with --optimizer onebit_adam, exact AdamW for the first N steps, then the
    variance is frozen and the momentum travels 1-bit compressed (default: 15% of --train-iters)."""

    muon_momentum: float = 0.9
    """--muon-momentum: Muon's momentum, an EMA of the gradients (Megatron's command-line default)."""
    muon_nesterov: bool = False
    """--muon-nesterov: orthogonalise ``lerp(g, m, momentum)`` instead of the momentum ``m``."""
    muon_split_qkv: bool = True
    """--muon-split-qkv / --muon-no-split-qkv: orthogonalise the fused QKV weight's q, k and v rows as three
    matrices (Megatron's default)."""
    muon_scale_mode: str = "spectral"
    """--muon-scale-mode {spectral,unit_rms_norm,shape_scaling}: the orthogonalised update of an ``m x n`` matrix
    is multiplied by sqrt(max(m, n)), sqrt(m / n), or sqrt(max(1, m / n))."""
    muon_fp32_matmul_prec: str = "medium"
    """--muon-fp32-matmul-prec {low,medium,high}: medium runs the Newton-Schulz iterations in bf16, high and low in
    fp32, as Megatron: it hands the value to ``torch.set_float32_matmul_precision``, which ignores "low" (a
    warning), and emerging_optimizers casts to bf16 only under "medium"."""
    muon_coefficient_type: str = "quintic"
    """--muon-coefficient-type {simple,quintic,polar_express}: the Newton-Schulz polynomial coefficients per step."""
    muon_num_ns_steps: int = 5
    """--muon-num-ns-steps: Newton-Schulz iterations, >= 1 (quintic cycles its five coefficient sets, polar_express
    repeats the last of its eight, as Megatron)."""
    muon_tp_mode: str = "duplicated"
    """--muon-tp-mode {duplicated,distributed,blockwise}: duplicated gathers the whole matrix over tp and
    orthogonalises it on every tp rank (the update is independent of the layout); distributed is Megatron's other
    whole-matrix mode (it all-reduces the Gram matrices instead) and computes the same update here, by gathering;
    blockwise orthogonalises each shard alone."""
    muon_extra_scale_factor: float = 1.0
    """--muon-extra-scale-factor: one more factor on the Muon update (0.2 matches AdamW's update RMS)."""
    exp_avg_dtype: str = "fp32"
    """--exp-avg-dtype {fp32,bf16,fp16}: the dtype Adam's first moment is stored in (needs
    --use-precision-aware-optimizer). The step reads it as fp32, updates it in fp32 and rounds it back to nearest
    (Transformer Engine's FusedAdam; fp16 scaled per tensor, :mod:`omnitron.core.optim.moments`); bf16 and fp16
    halve its memory."""
    exp_avg_sq_dtype: str = "fp32"
    """--exp-avg-sq-dtype {fp32,bf16,fp16}: the dtype Adam's second moment is stored in, as --exp-avg-dtype."""
    store_param_remainders: bool = False
    """Keep each bf16 parameter's fp32 master as the parameter plus an int16 remainder (2 bytes instead of 4; the
    update is the fp32 master's bit for bit): Transformer Engine's ``store_param_remainders``, which Megatron's
    OptimizerConfig turns on by default and --use-precision-aware-optimizer applies under --bf16 (no flag; FP8
    recipes other than delayed keep Megatron's fp32 masters). Set by the flags' resolution, Adam only."""

    def __post_init__(self) -> None:
        if self.optimizer not in ("adam", "adamw", "sgd", "onebit_adam", "muon"):
            raise ConfigError(f"--optimizer {self.optimizer!r} is not supported; use adam, sgd, onebit_adam or muon")
        self._check_muon()
        self._check_moment_dtypes()
        if self.onebit_freeze_step is not None and self.onebit_freeze_step < 1:
            raise ConfigError(f"--onebit-freeze-step must be >= 1 (the variance needs warm-up steps), got "
                              f"{self.onebit_freeze_step}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root", "WSD"):
            raise ConfigError(f"--lr-decay-style {self.lr_decay_style!r} is not supported; "
                              "use constant, linear, cosine, inverse-square-root or WSD")
        if self.lr_wsd_decay_style not in ("linear", "cosine", "exponential", "minus_sqrt"):
            raise ConfigError(f"--lr-wsd-decay-style {self.lr_wsd_decay_style!r} is not supported; "
                              "use linear, cosine, exponential or minus_sqrt")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError("--lr-warmup-iters and --lr-warmup-samples must be >= 0")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"need 0 <= --lr-warmup-init ({self.lr_warmup_init}) <= --lr ({self.lr})")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr needs --decoupled-lr (the peak rate it decays from)")
        if self.decoupled_lr is not None and not 0 <= self.decoupled_min_lr_or_default <= self.decoupled_lr:
            raise ConfigError(f"need 0 <= --decoupled-min-lr ({self.decoupled_min_lr_or_default}) <= --decoupled-lr "
                              f"({self.decoupled_lr})")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ConfigError("--adam-beta1 and --adam-beta2 must lie in [0, 1)")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ConfigError("--clip-grad and --weight-decay must be >= 0")
        if self.adam_eps < 0 or self.sgd_momentum < 0:  # torch's AdamW and SGD (Megatron's without TE / Apex)
            raise ConfigError(f"--adam-eps ({self.adam_eps}) and --sgd-momentum ({self.sgd_momentum}) must be >= 0")
        for flag, n in (("--lr-decay-iters", self.lr_decay_iters), ("--lr-decay-samples", self.lr_decay_samples)):
            if n is not None and n < 1:  # 0 read as "not given" (the run's length); Megatron asserts a decay > 0
                raise ConfigError(f"{flag} must be >= 1, got {n}; drop it to decay over the whole run")
        self._check_weight_decay_incr()

    def _check_weight_decay_incr(self) -> None:
        """Megatron's rules (validate_args, OptimizerParamScheduler): a constant style takes --weight-decay alone;
        linear and cosine take both ends, with 0 <= start <= end."""
        style, start, end = self.weight_decay_incr_style, self.start_weight_decay, self.end_weight_decay
        if style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"--weight-decay-incr-style {style!r} is not supported; use constant, linear or cosine")
        if style == "constant" and (start is not None or end is not None):
            raise ConfigError("--start-weight-decay / --end-weight-decay need --weight-decay-incr-style linear or "
                              "cosine; a constant weight decay is --weight-decay")
        if style != "constant" and (start is None or end is None):
            raise ConfigError(f"--weight-decay-incr-style {style} needs both --start-weight-decay and "
                              "--end-weight-decay")
        if style != "constant" and not 0 <= start <= end:
            raise ConfigError(f"need 0 <= --start-weight-decay ({start}) <= --end-weight-decay ({end}): the decay "
                              "only increases (Megatron's rule)")

    def _check_moment_dtypes(self) -> None:
        """--exp-avg-dtype / --exp-avg-sq-dtype: fp32, bf16 or fp16, and below fp32 only for Adam (Megatron's rule)."""
        for flag, value in (("--exp-avg-dtype", self.exp_avg_dtype), ("--exp-avg-sq-dtype", self.exp_avg_sq_dtype)):
            if value == "fp8":
                raise ConfigError(f"{flag} fp8: Transformer Engine's scaled fp8 moments are not implemented; use "
                                  "bf16, fp16 or fp32")
            if value not in ("fp32", "bf16", "fp16"):
                raise ConfigError(f"{flag} {value!r} is not one of fp32, bf16, fp16")
            if value != "fp32" and self.optimizer not in ("adam", "adamw"):
                raise ConfigError(f"{flag} {value}: moments below fp32 are Adam's (Megatron's precision-aware "
                                  f"optimizer), not --optimizer {self.optimizer}'s; drop the flag")
        if self.store_param_remainders and self.optimizer not in ("adam", "adamw"):
            raise ConfigError(f"master remainders (store_param_remainders) are Adam's (Megatron's precision-aware "
                              f"optimizer), not --optimizer {self.optimizer}'s; turn them off")

    def _check_muon(self) -> None:
        """The Muon settings, each against Megatron's choices."""
        from omnitron.core.optim.newton_schulz import coefficient_schedule

        if self.muon_scale_mode not in ("spectral", "unit_rms_norm", "shape_scaling"):
            raise ConfigError(f"--muon-scale-mode {self.muon_scale_mode!r} is not supported; "
                              "use spectral, unit_rms_norm or shape_scaling")
        if self.muon_fp32_matmul_prec not in ("low", "medium", "high"):
            raise ConfigError(f"--muon-fp32-matmul-prec {self.muon_fp32_matmul_prec!r}: use low, medium or high")
        if self.muon_tp_mode not in ("duplicated", "distributed", "blockwise"):
            raise ConfigError(f"--muon-tp-mode {self.muon_tp_mode!r} is not supported; "
                              "use duplicated, distributed or blockwise")
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(f"--muon-momentum must lie in [0, 1), got {self.muon_momentum}")
        try:
            coefficient_schedule(self.muon_coefficient_type, self.muon_num_ns_steps)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    @property
    def decoupled_min_lr_or_default(self) -> float:
        """--decoupled-min-lr, or --min-lr when not given (as Megatron)."""
        return self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr


@dataclass(kw_only=True)
class PrecisionConfig:
    """Parameter/compute precision and fp16 loss scaling."""

    bf16: bool = False
    """--bf16: bf16 parameters and compute, fp32 master weights and optimizer state."""
    fp16: bool = False
    """--fp16: fp16 parameters and compute with loss scaling, fp32 master weights."""
    loss_scale: float | None = None
    """--loss-scale: a constant loss scale (under --fp16, --bf16 or the distributed optimizer, as Megatron); unset
    means dynamic scaling under --fp16."""
    initial_loss_scale: float = 2.0 ** 32
    """--initial-loss-scale: first dynamic loss scale."""
    min_loss_scale: float = 1.0
    """--min-loss-scale: the dynamic scale never backs off below this."""
    loss_scale_window: int = 1000
    """--loss-scale-window: clean steps before the dynamic scale doubles."""
    hysteresis: int = 2
    """--hysteresis: overflowing steps tolerated before the dynamic scale halves."""
    max_consecutive_skipped_iterations: int = 100
    """--max-consecutive-skipped-iterations: with loss scaling, stop the run (exit non-zero) after this many steps
    in a row skipped on gradient overflow: the loss scale cannot recover (0: never stop)."""

    def __post_init__(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are mutually exclusive; pick one")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ConfigError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.initial_loss_scale <= 0 or self.min_loss_scale <= 0:
            raise ConfigError("--initial-loss-scale and --min-loss-scale must be > 0")
        if self.fp16 and self.loss_scale is None and self.min_loss_scale > self.initial_loss_scale:
            raise ConfigError(f"--min-loss-scale {self.min_loss_scale:g} is above --initial-loss-scale "
                              f"{self.initial_loss_scale:g} (Megatron's dynamic scaler refuses it too); lower the "
                              "first or raise the second")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ConfigError("--loss-scale-window and --hysteresis must be >= 1")
        if self.max_consecutive_skipped_iterations < 0:
            raise ConfigError("--max-consecutive-skipped-iterations must be >= 0 (0: never stop)")

    @property
    def params_dtype_name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, length of the run, seeds and validation."""

    micro_batch_size: int = 1
    """--micro-batch-size: sequences per forward pass on one rank."""
    global_batch_size: int | None = None
    """--global-batch-size: sequences per optimizer step over all data-parallel ranks
    (default: micro batch x data-parallel size)."""
    train_iters: int = 100
    """--train-iters: optimizer steps to run (in total, counting resumed ones)."""
    train_samples: int | None = None
    """--train-samples: train on this many samples instead of --train-iters (Megatron's sample-based run: the
    iterations are counted from it, the learning-rate schedule counts samples: --lr-*-samples)."""
    rampup_batch_size: list[int] | None = None
    """--rampup-batch-size START INCREMENT SAMPLES: with --train-samples, start at START sequences per step and
    grow by INCREMENT evenly over the first SAMPLES samples up to --global-batch-size."""
    step_batch_size_schedule: str | None = None
    """--step-batch-size-schedule "THRESHOLD:BS ...": Megatron's step-wise batch size: each step's global batch is
    the BS of the last THRESHOLD (tokens, suffixes K M B T; divided by --seq-length into samples) that the samples
    consumed before it reach; the first THRESHOLD is 0 (omnitron.core.training.batches)."""
    seed: int = 1234
    """--seed: initialisation, data order and dropout all derive from it; 1 to ``MAX_SEED`` (Megatron's
    ``_set_random_seed`` stops every run with a seed <= 0 at initialization)."""
    eval_interval: int = 0
    """--eval-interval: validate every this many iterations (0: never)."""
    eval_iters: int = 10
    """--eval-iters: validation micro-batch groups per evaluation."""
    eval_global_batch_size: int | None = None
    """--eval-global-batch-size: sequences in each evaluation batch (Megatron's; default --global-batch-size): an
    evaluation reads --eval-iters batches of this size, in micro-batches of --micro-batch-size (a count the pipeline
    schedule takes: checked with the settings)."""
    start_eval_at_iter: int | None = None
    """--start-eval-at-iter: the --eval-interval evaluations start at this iteration (Megatron's; the one after
    training still runs); the validation split is sized for the evaluations that run."""
    skip_train: bool = False
    """--skip-train: no training: evaluate the model (from --load) on --eval-iters batches of the validation and
    the test split, each from its start, and exit; nothing is saved and, as Megatron, no optimizer state is loaded
    (--no-load-optim)."""
    exit_interval: int | None = None
    """--exit-interval: stop (after saving) when the iteration is a multiple of this."""
    exit_duration_in_mins: float | None = None
    """--exit-duration-in-mins: stop (after saving) at the first iteration that ends this many minutes after
    the job started (Megatron's program start: the model build, data indexes and checkpoint load count, so a
    limit sized to a scheduler's time slot holds); every rank stops at the same iteration (the ranks' clocks are
    OR-ed, as a signal is). An evaluation under way when the limit passes (or a stop signal arrives) ends
    between its batches, unlogged, as Megatron's evaluate; a resumed run's validation stream starts after the
    batches it read (the checkpoint's consumed_valid_samples, as Megatron's)."""
    calculate_per_token_loss: bool = False
    """--calculate-per-token-loss: the step's loss is the sum over all its tokens (every micro-batch and
    data-parallel rank) divided by their count, and so are its gradients (Megatron's per-token loss), instead of
    the mean of each micro-batch's token mean; the two differ when the micro-batches hold different numbers of
    loss tokens (a loss mask: --eod-mask-loss, SFT prompts). Refused for MoE, MTP and BERT, whose losses are
    weighted per micro-batch."""
    pipeline_schedule: str | None = None
    """--pipeline-schedule {none,1f1b,interleaved,zb-h1,zb-v,dualpipe-v} (default: none at pp 1, 1f1b, or
    interleaved with virtual stages). zb-v and dualpipe-v place two chunks per rank in a V and need
    --num-layers-per-virtual-pipeline-stage = num-layers / (2 x pp)."""
    distributed_timeout_minutes: float = 10
    """--distributed-timeout-minutes: a collective, p2p or training step that does not finish in this time (or a
    rank that stops sending heartbeats for this long) makes every reachable rank dump its stacks and exit
    non-zero (Megatron's flag and default); so does a process group's creation that a rank does not come to, or
    comes to with other groups (:mod:`omnitron.backends.group_agreement`)."""
    manual_gc: bool = False
    """--manual-gc: Python's automatic garbage collection off during training; every rank collects at the same
    iterations instead (--manual-gc-interval, and before validation and saves), so no rank pauses alone."""
    manual_gc_interval: int = 0
    """--manual-gc-interval: with --manual-gc, collect every this many iterations (0: only before validation
    and checkpoint saves)."""
    empty_unused_memory_level: int = 0
    """--empty-unused-memory-level {0,1,2}: release the device allocator's cached blocks after each step (1),
    and after validation too (2)."""
    torch_compile: bool = False
    """--torch-compile: compile each transformer layer once with torch.compile and reuse it for every layer,
    micro-batch and pipeline chunk (regional compilation, torchtitan's compile.enable; Megatron has no such
    flag); parameter names and checkpoints are unchanged. Refused on backends without a compiler."""
    cuda_graph_impl: str = "none"
    """--cuda-graph-impl {none,local}: capture each transformer layer's forward and backward as device graphs
    and replay them (Megatron's flag; omnitron.core.capture); with --torch-compile, the compiled layers.
    Refused where the backend has no graphs."""
    enable_cuda_graph: bool = False
    """--enable-cuda-graph: Megatron's older spelling of --cuda-graph-impl local."""
    check_for_nan_in_loss_and_grad: bool = True
    """--check-for-nan-in-loss-and-grad: stop before the optimizer step when the loss or the gradient norm
    is not finite, and never save a checkpoint of non-finite weights (on by default, as in Megatron; off under --fp16
    without --loss-scale even when named, as Megatron sets it: there the dynamic scaler skips non-finite steps)."""

    def __post_init__(self) -> None:
        from omnitron.core.capture import resolve_impl

        self.cuda_graph_impl, self.enable_cuda_graph = resolve_impl(self.cuda_graph_impl, self.enable_cuda_graph), False
        for flag, v in (("--micro-batch-size", self.micro_batch_size), ("--train-iters", self.train_iters)):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1, got {v}")
        if self.train_samples is not None and self.train_samples < 1:
            raise ConfigError(f"--train-samples must be >= 1, got {self.train_samples}")
        if self.rampup_batch_size is not None:
            try:
                self.rampup_batch_size = [int(v) for v in self.rampup_batch_size]
            except (TypeError, ValueError):
                self.rampup_batch_size = []
            if len(self.rampup_batch_size) != 3:
                raise ConfigError("--rampup-batch-size takes three integers: START INCREMENT SAMPLES")
            if self.train_samples is None:
                raise ConfigError("--rampup-batch-size needs a sample-based run: give --train-samples instead of "
                                  "--train-iters (as Megatron)")
        if self.step_batch_size_schedule is not None and self.rampup_batch_size is not None:
            raise ConfigError("give --step-batch-size-schedule or --rampup-batch-size, not both")
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ConfigError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.eval_interval < 0 or self.eval_iters < 0:
            raise ConfigError("--eval-interval and --eval-iters must be >= 0")
        if self.eval_global_batch_size is not None and self.eval_global_batch_size < 1:
            raise ConfigError(f"--eval-global-batch-size must be >= 1, got {self.eval_global_batch_size}")
        if self.start_eval_at_iter is not None and self.start_eval_at_iter < 0:
            raise ConfigError(f"--start-eval-at-iter {self.start_eval_at_iter}: give an iteration >= 0")
        if self.manual_gc_interval < 0 or self.empty_unused_memory_level not in (0, 1, 2):
            raise ConfigError("--manual-gc-interval must be >= 0 and --empty-unused-memory-level 0, 1 or 2")
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}")
        if self.seed <= 0:  # Megatron's initialize.py, for every model, before any model or data is built
            raise ConfigError(f"--seed {self.seed}: Megatron refuses it at initialization (\"Seed ({self.seed}) "
                              "should be a positive integer.\"); give --seed 1 or more")
        if self.seed > MAX_SEED:
            raise ConfigError(f"--seed {self.seed} is above {MAX_SEED}: the data order draws from numpy's "
                              "RandomState(seed), which takes 32-bit seeds (as Megatron's); give a smaller seed")

    @property
    def eval_batch(self) -> int:
        """Sequences in one evaluation batch: --eval-global-batch-size, else --global-batch-size."""
        return self.eval_global_batch_size or self.global_batch_size


@dataclass(kw_only=True)
class LoggingConfig:
    """What is logged, where and how often."""

    log_interval: int = 10
    """--log-interval: print and record metrics every this many iterations."""
    log_dir: str | None = None
    """--log-dir: metrics.jsonl and TensorBoard events (default: --save, else a new
    ./runs/<timestamp> for the job; $OMNITRON_RUNS_DIR replaces ./runs)."""
    tensorboard: bool = True
    """--no-tensorboard turns TensorBoard events off (they are written only when installed)."""
    tensorboard_dir: str | None = None
    """--tensorboard-dir: write the TensorBoard events in this directory itself, with Megatron's tag names
    (``lm loss``, ``learning-rate``, ...), as Megatron (default: LOG_DIR/tensorboard); also the --log-dir when
    that is not given."""
    progress_bar: bool | None = None
    """--progress-bar / --no-progress-bar (default: on when stdout is a terminal)."""
    timing_log_level: int = 0
    """--timing-log-level {0,1,2}: 0 times the whole step and checkpoint saves; 1 adds the once-per-step
    phases (forward-backward, gradient sync, optimizer, parameter gather); 2 adds the many-per-step ones
    (data loading; on synchronous devices also forward/backward compute and pipeline waits). Each timer
    synchronizes the device."""
    timing_log_option: str = "minmax"
    """--timing-log-option {max,minmax,all}: report each timer's max over ranks, min and max, or every rank's."""
    barrier_with_L1_time: bool = True  # noqa: N815 - Megatron's spelling
    """--barrier-with-L1-time: level-1 timers start after a barrier of every rank, so a phase's time
    excludes waiting for slower ranks to arrive (--no-barrier-with-L1-time: no barrier)."""
    log_throughput: bool = False
    """--log-throughput: show TFLOP/s and tokens/s per device on every log line (tokens_per_sec_per_device)."""
    log_params_norm: bool = False
    """--log-params-norm: log the global parameter L2 norm (each shard counted once), computed on logged steps."""
    log_num_zeros_in_grad: bool = False
    """--log-num-zeros-in-grad: log how many gradient elements are exactly zero (each counted once)."""
    log_memory_estimate: bool = False
    """--log-memory-estimate: rank 0 logs omnitron.plan's predicted memory per pipeline stage (the table of
    ``omnitron plan``) before the first step."""
    moe_expert_load_out: str | None = None
    """--moe-expert-load-out FILE (omnitron's; Megatron-LM has none): write the run's routing histogram, each
    decoder MoE layer's router picks per expert before capacity, to FILE at every checkpoint save and at the
    end, in the form ``omnitron plan --moe-expert-load`` reads (:mod:`omnitron.core.transformer.moe.expert_load`)."""
    log_memory_to_tensorboard: bool = False
    """--log-memory-to-tensorboard: log the backend's memory statistics (largest over ranks), mem_*_bytes (not to
    W&B, as Megatron)."""
    log_timers_to_tensorboard: bool = False
    """--log-timers-to-tensorboard: also write the timers to TensorBoard and W&B, as Megatron's ``<name>-time`` tags
    in seconds per iteration, max over ranks, with ``iteration-time`` (and ``throughput``, the TFLOP/s per device,
    with --log-throughput too), which Megatron writes only then (metrics.jsonl always has them all)."""
    log_loss_scale_to_tensorboard: bool = True
    """--log-loss-scale-to-tensorboard: TensorBoard's (and wandb's) ``loss-scale`` and ``loss-scale vs samples``, on
    by default as in Megatron (--no- / --disable-log-loss-scale-to-tensorboard: off; metrics.jsonl keeps
    loss_scale)."""
    log_validation_ppl_to_tensorboard: bool = False
    """--log-validation-ppl-to-tensorboard: TensorBoard's ``lm loss validation ppl`` (``lm loss test ppl``) and their
    ``vs samples`` twins, which Megatron writes only with this flag (metrics.jsonl always has val_ppl / test_ppl)."""
    log_world_size_to_tensorboard: bool = False
    """--log-world-size-to-tensorboard: records carry the job's world size (world_size), TensorBoard's
    ``world-size`` and ``world-size vs samples``, as Megatron's."""
    wandb_project: str | None = None
    """--wandb-project: log the metrics to this Weights & Biases project too (needs omnitron[wandb];
    WANDB_MODE=offline works without a network)."""
    wandb_exp_name: str | None = None
    """--wandb-exp-name: the wandb run's name (needed with --wandb-project)."""
    wandb_save_dir: str | None = None
    """--wandb-save-dir: where wandb keeps the run's files (default: <log dir>/wandb)."""
    profile: bool = False
    """--profile: trace iterations with torch.profiler into <log dir>/profile/ (a Chrome trace per rank)."""
    profile_step_start: int = 10
    """--profile-step-start: start tracing after this many completed iterations (S; the first traced is S + 1)."""
    profile_step_end: int = 12
    """--profile-step-end: stop tracing after this iteration (E; E - S iterations are traced)."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """--profile-ranks: the global ranks that trace."""
    log_straggler: bool = False
    """--log-straggler: every --log-interval iterations, gather each rank's step time and compute time (its
    forward and backward spans, waits for other ranks excluded), score every rank against the median, log the
    slowest (metrics.jsonl ``straggler_*``; TensorBoard the largest score and its rank)."""
    straggler_minmax_count: int = 1
    """--straggler-minmax-count N: with --log-straggler, name the N slowest and N fastest ranks."""

    def __post_init__(self) -> None:
        if self.log_interval < 1:
            raise ConfigError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.straggler_minmax_count < 1:
            raise ConfigError(f"--straggler-minmax-count must be >= 1, got {self.straggler_minmax_count}")
        if self.timing_log_level not in (0, 1, 2):
            raise ConfigError(f"--timing-log-level must be 0, 1 or 2, got {self.timing_log_level}")
        if self.timing_log_option not in ("max", "minmax", "all"):
            raise ConfigError(f"--timing-log-option {self.timing_log_option!r} is not supported; use max, minmax "
                              "or all")
        if self.profile_step_start < 0 or self.profile_step_end <= self.profile_step_start:
            raise ConfigError(f"--profile-step-end ({self.profile_step_end}) must be greater than "
                              f"--profile-step-start ({self.profile_step_start}) >= 0; the trace covers iterations "
                              "start+1 .. end")
        try:
            self.profile_ranks = [int(r) for r in self.profile_ranks]
        except (TypeError, ValueError):
            raise ConfigError(f"--profile-ranks expects global rank numbers, got {self.profile_ranks}") from None

    def check_world(self, world_size: int) -> None:
        """--profile-ranks against the world (called by the settings builder, which knows its size)."""
        bad = [r for r in self.profile_ranks if not 0 <= r < world_size]
        if self.profile and bad:
            raise ConfigError(f"--profile-ranks {bad[0]} is not a rank of this {world_size}-process run; "
                              f"use ranks 0..{world_size - 1}")


EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
"""--exit-signal's choices: the stop signals, and the two a scheduler sends as a warning (SLURM's --signal)."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading."""

    save: str | None = None
    """--save: directory checkpoints are written to."""
    load: str | None = None
    """--load: directory to resume from (its ``latest`` checkpoint); missing means start fresh."""
    ckpt_step: int | None = None
    """--ckpt-step: load the checkpoint of this iteration under --load, not the one ``latest`` names (an earlier
    one when the newest is damaged; Megatron's flag). It names --load's own iteration: a non-persistent checkpoint
    (--non-persistent-ckpt-type global) is not considered, where Megatron would take it when at least as new as
    the step asked for (a step is asked for to get that one checkpoint)."""
    save_interval: int | None = None
    """--save-interval: save every this many iterations (and always at the end)."""
    keep_last_n: int | None = None
    """--keep-last-n: delete older checkpoints, keeping this many (None keeps all)."""
    save_retain_interval: int | None = None
    """--save-retain-interval (Megatron's): each save deletes the checkpoint ``latest`` named before it unless its
    iteration is a multiple of this: the run keeps every multiple and its newest checkpoint."""
    finetune: bool = False
    """--finetune: load weights only; start at iteration 0 with fresh optimizer and data order."""
    no_load_optim: bool = False
    """--no-load-optim: do not restore optimizer/scaler/scheduler state."""
    no_load_rng: bool = False
    """--no-load-rng: do not restore RNG states."""
    override_opt_param_scheduler: bool = False
    """--override-opt_param-scheduler (Megatron's spelling): on resume, the learning-rate schedule (--lr, --min-lr,
    warm-up, decay length and style) is this command line's, not the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """--use-checkpoint-opt_param-scheduler: on resume, the checkpoint's schedule stands where the command line's
    differs. With neither flag a difference stops the load (Megatron's rule), naming each value."""
    use_checkpoint_args: bool = False
    """--use-checkpoint-args: take the model's shape and the tokenizer from the checkpoint under --load that the
    run resumes (the non-persistent one when that is the one loaded, as Megatron's); they override the command
    line's; each change is logged."""
    exit_on_missing_checkpoint: bool = False
    """--exit-on-missing-checkpoint: stop with an error when --load holds no checkpoint, instead of starting fresh."""
    save_on_signal: bool = True
    """Finish the current step, save and exit on SIGTERM/SIGINT (when --save is set)."""
    exit_signal: str = "SIGTERM"
    """--exit-signal (Megatron's): the signal that, besides SIGTERM and SIGINT, finishes the step, saves and exits:
    SIGUSR1 or SIGUSR2 for SLURM's ``--signal=USR1@SECONDS`` warning before the time limit."""
    non_persistent_save_interval: int | None = None
    """--non-persistent-save-interval (Megatron's): every N iterations where no regular save falls, a checkpoint
    into the non-persistent directory, which keeps only the newest (a cheap, frequent save to lose less to a crash
    than --save-interval does). Needs --save and --non-persistent-ckpt-type global."""
    non_persistent_ckpt_type: str | None = None
    """--non-persistent-ckpt-type (Megatron's): ``global`` only (a checkpoint like --save's, in
    --non-persistent-global-ckpt-dir); on --load the newer of it and --load's latest is resumed (the non-persistent
    one when as new), as Megatron's load_checkpoint chooses. ``local`` / ``in_memory`` (NVIDIA's resiliency
    extension) are refused."""
    non_persistent_global_ckpt_dir: str | None = None
    """--non-persistent-global-ckpt-dir (Megatron's): where the global non-persistent checkpoints go and are
    looked for; default ``<--save>/non_persistent`` when saving, ``<--load>/non_persistent`` when loading. Outside
    --save it is locked for the job as --save is (a second job saving into it is refused); --save itself is refused
    (keeping only its newest checkpoint would delete --save's)."""
    ckpt_format: str = "torch_dist"
    """--ckpt-format: ``torch_dist`` (the default, Megatron's too: torch.distributed.checkpoint, each rank
    writes only the slices it owns, loads under any layout) or ``torch`` (one torch.save file per rank).
    Loading reads either, told by the checkpoint's metadata whatever this flag says."""
    async_save: bool = False
    """--async-save: a save blocks the step only for a host copy of the state; writing goes on in the
    background and is committed (``latest`` moved) by the next save or the end of training (torch_dist only).
    Costs host memory for the run: staging buffers of what the rank writes (at most one copy of its state)."""

    def __post_init__(self) -> None:
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError(f"--keep-last-n must be >= 1, got {self.keep_last_n}")
        if self.save_retain_interval is not None and self.save_retain_interval < 1:
            raise ConfigError(f"--save-retain-interval must be >= 1, got {self.save_retain_interval}")
        if self.exit_signal not in EXIT_SIGNALS:
            raise ConfigError(f"--exit-signal {self.exit_signal}: give one of {', '.join(EXIT_SIGNALS)}")
        if self.ckpt_step is not None and (self.ckpt_step < 0 or not self.load):
            raise ConfigError(f"--ckpt-step {self.ckpt_step}: give the iteration (>= 0) of a checkpoint under --load "
                              f"DIR{'' if self.load else ' (--load is not set)'}")
        self._check_non_persistent()
        if self.ckpt_format not in ("torch", "torch_dist"):
            raise ConfigError(f"--ckpt-format {self.ckpt_format!r} is not one of torch, torch_dist")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ConfigError(f"--async-save needs --ckpt-format torch_dist (the {self.ckpt_format} format writes "
                              f"synchronously); add --ckpt-format torch_dist or drop --async-save")

    def _check_non_persistent(self) -> None:
        """The non-persistent checkpoint flags: only Megatron's ``global`` type, with an interval and --save."""
        kind, every = self.non_persistent_ckpt_type, self.non_persistent_save_interval
        if kind not in (None, "global"):
            raise ConfigError(f"--non-persistent-ckpt-type {kind}: omnitron implements only 'global' (a checkpoint "
                              f"in --non-persistent-global-ckpt-dir); 'local' and 'in_memory' need NVIDIA's "
                              f"resiliency extension: use global")
        if every is not None and every < 1:
            raise ConfigError(f"--non-persistent-save-interval must be >= 1, got {every}")
        if every is not None and kind is None:
            raise ConfigError("--non-persistent-save-interval needs --non-persistent-ckpt-type global")
        if every is not None and not self.save:
            raise ConfigError("--non-persistent-save-interval needs --save (Megatron's saves nothing without it)")
        where = self.non_persistent_global_ckpt_dir
        if every is not None and where and os.path.realpath(where) == os.path.realpath(self.save):
            raise ConfigError(f"--non-persistent-global-ckpt-dir {where} is --save: keeping only the newest "
                              f"non-persistent checkpoint there would delete --save's regular ones; give it a "
                              f"directory of its own (default: <--save>/non_persistent)")
