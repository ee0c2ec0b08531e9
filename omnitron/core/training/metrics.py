"""Training metrics: plain log lines (or a progress bar on a terminal), ``metrics.jsonl``, TensorBoard.

One JSON object per logged iteration: ``iteration``, ``lm_loss`` (mean over the iterations since
the previous log line that were not skipped, as Megatron's; full float64 precision; None when all were skipped,
where TensorBoard gets the last step's own loss as Megatron's does), ``lr`` (the rate the
logged step applied: Megatron's line shows its scheduler's rate after the step, the next step's), ``grad_norm``,
``loss_scale``, ``skipped_iters``, ``nan_iters`` (skipped ones whose loss was not finite, Megatron's nan
iterations), ``tokens_per_sec``, ``step_time_s``, ``tflops_per_device`` (Megatron's
``num_floating_point_operations`` per device), ``mfu`` (None when the backend does not know its peak; the rates are
the interval's work over its summed step time, ``step_time_s`` its mean), ``peak_memory_bytes``,
``moe_aux_loss`` (MoE models), ``mtp_loss`` (multi-token prediction),
``consumed_samples`` (after the iteration), ``global_batch_size`` (its batch: ``--rampup-batch-size`` changes it),
``decoupled_lr`` (``--decoupled-lr``), ``weight_decay`` (``--weight-decay-incr-style linear|cosine``: the decay
the step applied) and ``time`` (local ISO 8601 with offset); validation lines carry ``val_loss``, ``val_ppl`` and
``time`` (one per evaluation, and one more after training), the test evaluation after training ``test_loss`` and
``test_ppl``. The console lines are Megatron's (:mod:`omnitron.core.training.log_lines`: training_log's line, with
omnitron's fields such as the ETA of the rest of the run after Megatron's, and evaluate_and_print_results' framed
validation and test lines); as Megatron's, a process's first iteration gets a line too (the console's only; the
interval's sums go on), and a last iteration off ``--log-interval`` none (its record is written: :func:`line_due`).
Only global rank 0 writes.
TensorBoard gets the same numbers under Megatron's tag names (:func:`tensorboard_scalars`), in --tensorboard-dir,
``iteration-time``, ``throughput``, ``loss-scale`` and the validation / test ``ppl`` only under the flags Megatron
writes them with, and no ``iteration-time`` at a process's first iteration (Megatron's is_first_iteration).

Asked for by flags: ``timers_<name>_ms`` (max over ranks), ``timers_<name>_min_ms`` and
``timers_<name>_ranks_ms`` (``--timing-log-option``; names in ``omnitron.core.training.timers``),
``tokens_per_sec_per_device`` (``--log-throughput``), ``params_norm`` (``--log-params-norm``),
``num_zeros_in_grad`` (``--log-num-zeros-in-grad``; the last step's), ``mem_allocated_bytes``,
``mem_reserved_bytes``, ``mem_max_allocated_bytes``, ``mem_max_reserved_bytes`` (``--log-memory-to-tensorboard``;
the largest over ranks), ``world_size`` (``--log-world-size-to-tensorboard``).
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import os
import sys
import time

from omnitron.core.training.log_lines import training_line, validation_lines

log = logging.getLogger("omnitron.train")


# record key -> Megatron's TensorBoard tag (megatron/training/training.py, training_log and evaluate_and_print_results,
# at d98e8a6); the keys marked True also get Megatron's "<tag> vs samples" twin, stepped by the consumed samples.
# Other keys keep omnitron's own name.
_TB_TAGS = {"lm_loss": ("lm loss", True), "lr": ("learning-rate", True), "global_batch_size": ("batch-size", True),
            "loss_scale": ("loss-scale", True), "grad_norm": ("grad-norm", True),
            "num_zeros_in_grad": ("num-zeros", True),
            "params_norm": ("params-norm", True), "step_time_s": ("iteration-time", False),
            "tflops_per_device": ("throughput", False), "mem_allocated_bytes": ("mem-allocated-bytes", False),
            "mem_reserved_bytes": ("mem-reserved-bytes", False),
            "mem_max_allocated_bytes": ("mem-max-allocated-bytes", False),
            "val_loss": ("lm loss validation", True), "val_ppl": ("lm loss validation ppl", True),
            "test_loss": ("lm loss test", True), "test_ppl": ("lm loss test ppl", True),
            "world_size": ("world-size", True), "sop_loss": ("sop loss", True),
            "val_sop_loss": ("sop loss validation", True), "test_sop_loss": ("sop loss test", True)}


def tensorboard_scalars(record: dict, consumed_samples: int | None, timers: bool = False, throughput: bool = False,
                        loss_scale: bool = True, validation_ppl: bool = False, memory: bool = True):
    """``(tag, value, step)`` for every number of ``record`` as Megatron names it (see ``_TB_TAGS``); the
    ``vs samples`` twins only when the consumed samples are known. Megatron's training_log gates three of them:
    ``timers`` (--log-timers-to-tensorboard): the ``timers_*`` values and ``iteration-time``; ``throughput``
    (--log-throughput, with ``timers``): ``throughput``; ``loss_scale`` (--log-loss-scale-to-tensorboard, on by
    default): ``loss-scale``; and evaluate_and_print_results one: ``validation_ppl``
    (--log-validation-ppl-to-tensorboard, off by default): the validation and test ``ppl`` tags; ``memory`` the
    ``mem_*`` values (W&B, which Megatron never sends them, passes False). A run without loss
    scaling logs a loss scale of 1.0 there, as Megatron's optimizers report one (the record itself keeps None). A
    timer goes as Megatron's ``Timers.write`` writes it: ``<name>-time``, the max over ranks, in seconds per
    iteration (``timers_<name>_ms``; the min and per-rank values stay in the record)."""
    it = record["iteration"]
    gated = {"step_time_s": timers, "tflops_per_device": timers and throughput, "loss_scale": loss_scale,
             "val_ppl": validation_ppl, "test_ppl": validation_ppl}
    for k, v in record.items():
        if k == "loss_scale" and v is None:
            v = 1.0
        if k in ("iteration", "consumed_samples") or v is None or isinstance(v, bool) or \
                not isinstance(v, (int, float)) or (k.startswith("timers_") and not timers) or not gated.get(k, True) \
                or (k.startswith("mem_") and not memory):
            continue
        if k.startswith("timers_"):
            if k.endswith("_ms") and not k.endswith("_min_ms"):
                yield k[len("timers_"):-len("_ms")].replace("_", "-") + "-time", v / 1e3, it
            continue
        tag, twin = _TB_TAGS.get(k, (k, False))
        yield tag, v, it
        if twin and consumed_samples is not None:
            yield f"{tag} vs samples", v, consumed_samples


def runs_root() -> str:
    """Where runs without ``--save`` or ``--log-dir`` go: ``$OMNITRON_RUNS_DIR``, else ``./runs`` (a job started
    from a read-only or shared working directory, or a test suite, points it elsewhere)."""
    return os.environ.get("OMNITRON_RUNS_DIR") or "runs"


def default_log_dir(save: str | None) -> str:
    """``--save``, else ``<runs root>/<timestamp>`` (what a rank takes alone; ``omnitron train``'s launcher names
    one folder for the whole job first: :func:`new_run_dir`)."""
    return save or os.path.join(runs_root(), time.strftime("%Y%m%d-%H%M%S"))


def new_run_dir(root: str | None = None) -> str:
    """A new folder for one job under ``root`` (default :func:`runs_root`): ``<timestamp>``, or ``<timestamp>-2``,
    ``-3``... where another job took that name in the same second. Created here, so two launchers never share one."""
    root = root or runs_root()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(root, exist_ok=True)
    n = 1
    while True:
        path = os.path.join(root, stamp if n == 1 else f"{stamp}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            n += 1


def read_records(path: str) -> list[tuple[str, dict]]:
    """Each line of a metrics file with its record. A last line that does not parse (a run killed while
    writing it) is dropped with a warning; a bad line before it is an error naming the line."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append((line if line.endswith("\n") else line + "\n", json.loads(line)))
        except json.JSONDecodeError as e:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON ({e}); repair or remove that line to resume") from e
            log.warning("%s: its last line is cut short (a run stopped while writing it): dropped", path)
    return out


def _open_metrics(path: str, start_iteration: int):
    """A fresh run starts the file afresh; a resumed one keeps the records up to its checkpoint
    (dropping any written after it by the run that was interrupted), then appends."""
    keep = []
    if start_iteration > 0 and os.path.exists(path):
        keep = [line for line, rec in read_records(path) if rec.get("iteration", 0) <= start_iteration]
    f = open(path, "w")
    f.writelines(keep)
    f.flush()
    return f


def _wall_clock() -> datetime.datetime:
    """The local wall-clock time (a function, so that a test can fix it)."""
    return datetime.datetime.now()


def _iso(now: datetime.datetime) -> str:
    """``now`` with its UTC offset, to the second (ISO 8601): the records' ``time``."""
    return now.astimezone().isoformat(timespec="seconds")


def log_due(iteration: int, log_interval: int, train_iters: int) -> bool:
    """True when ``iteration`` gets a record (metrics.jsonl, TensorBoard, W&B): every ``log_interval`` iterations and
    the last one (whose steps since the previous record would be reported nowhere else)."""
    return iteration % log_interval == 0 or iteration == train_iters


def line_due(iteration: int, log_interval: int, first_iteration: int) -> bool:
    """True when ``iteration`` gets a training line on the console: Megatron's training_log condition, every
    ``log_interval`` iterations and the process's first (``is_first_iteration``); a last iteration off the interval
    gets none (its record is written all the same)."""
    return iteration % log_interval == 0 or iteration == first_iteration


def _interval_loss(steps: list[dict], key: str = "lm_loss") -> float | None:
    """The interval's loss ``key`` (the LM loss; BERT's ``sop_loss``) as Megatron's log averages it: over the steps
    that updated the weights (a step an fp16 overflow skipped adds neither its loss nor a count); None when every
    step was skipped (no average exists: Megatron's line then prints its empty sum, 0, or no loss at all before any
    step advanced)."""
    losses = [v[key] for v in steps if not v["skipped"]]
    return sum(losses) / len(losses) if losses else None


def _not_finite(step: dict) -> bool:
    """A skipped step is one of Megatron's nan iterations when any loss its loss function reported (the LM loss;
    BERT's sentence-order loss) is not finite."""
    return any(not math.isfinite(step[key]) for key in ("lm_loss", "sop_loss") if key in step)


def _interval_rate(steps: list[dict], key: str) -> float | None:
    """The rate ``key`` (tokens/s, TFLOP/s, MFU) over the steps together: their work over their summed time, as
    Megatron divides the interval's FLOPs by its elapsed time (each step's rate weighted by its time; a plain mean
    of the rates would let one slow step count as much as a fast one). None when no step has it."""
    timed = [(v[key], v["step_time_s"]) for v in steps if v.get(key) is not None]
    total = sum(t for _, t in timed)
    return sum(r * t for r, t in timed) / total if timed else None


class _BarLogging(logging.Handler):
    """While the progress bar is shown, omnitron's log lines ("saving checkpoint ...") are written above it
    (``tqdm.write``) instead of through it; :meth:`close` puts the usual handlers back."""

    def __init__(self, bar) -> None:
        super().__init__()
        self.bar, self.logger = bar, logging.getLogger("omnitron")
        self.setFormatter(logging.Formatter("%(message)s"))
        self._propagate = self.logger.propagate
        self.logger.addHandler(self)
        self.logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.bar.write(self.format(record))

    def close(self) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = self._propagate
        super().close()


class MetricsLogger:
    """Collects per-step values and emits them every ``log_interval`` iterations (rank 0 only).

    A step's ``values["log"]`` (computed by the loop on logged steps only: timers, parameter norm, memory)
    is copied into the record as it is; its ``values["log_lines"]`` follow the line. ``throughput``:
    --log-throughput (TFLOP/s and tokens/s per device on every line). ``tensorboard_timers``:
    --log-timers-to-tensorboard (the timers go to TensorBoard too, as Megatron's ``<name>-time`` tags, with
    ``iteration-time`` and, with ``throughput``, ``throughput``; metrics.jsonl always has them).
    ``tensorboard_loss_scale``: --log-loss-scale-to-tensorboard (TensorBoard's ``loss-scale``).
    ``tensorboard_validation_ppl``: --log-validation-ppl-to-tensorboard (TensorBoard's validation and test ppl)."""

    def __init__(self, *, log_dir: str, log_interval: int, train_iters: int, enabled: bool, tensorboard: bool,
                 progress_bar: bool | None, start_iteration: int, throughput: bool = False,
                 tensorboard_timers: bool = False, wandb=None, tensorboard_dir: str | None = None,
                 tensorboard_loss_scale: bool = True, tensorboard_validation_ppl: bool = False) -> None:
        self.enabled, self.log_interval, self.train_iters = enabled, log_interval, train_iters
        self.log_dir, self.throughput, self.tensorboard_timers = log_dir, throughput, tensorboard_timers
        self.tensorboard_loss_scale = tensorboard_loss_scale
        self.tensorboard_validation_ppl = tensorboard_validation_ppl
        self._pending: list[dict] = []
        self._advanced = False  # a logged step of this process updated the weights (Megatron's loss key exists)
        self._first_iteration = start_iteration + 1  # this process's first (after a resume too)
        self._file = self._tb = self._bar = None
        self._wandb = wandb  # a WandbRun (--wandb-project) or None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self._file = _open_metrics(os.path.join(log_dir, "metrics.jsonl"), start_iteration)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run replaces the events a crashed attempt wrote past its checkpoint
                self._tb = SummaryWriter(log_dir=tensorboard_dir or os.path.join(log_dir, "tensorboard"),
                                         purge_step=start_iteration + 1 if start_iteration else None)
            except ImportError:
                self._tb = None
                log.info("TensorBoard events are off: the tensorboard package is not installed (pip install "
                         "tensorboard); %s has every logged value", os.path.join(log_dir, "metrics.jsonl"))
        use_bar = sys.stdout.isatty() if progress_bar is None else progress_bar
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=train_iters, initial=start_iteration, unit="it", dynamic_ncols=True)
            self._log_through_bar = _BarLogging(self._bar)

    def _emit(self, record: dict, line: str, consumed_samples: int | None = None, scalars: dict | None = None) -> None:
        """``record`` to metrics.jsonl, ``scalars`` (default ``record``) to TensorBoard and W&B, ``line`` printed."""
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        scalars = record if scalars is None else scalars
        if self._tb is not None:
            samples = scalars.get("consumed_samples", consumed_samples)
            for tag, value, step in tensorboard_scalars(scalars, samples, self.tensorboard_timers, self.throughput,
                                                        self.tensorboard_loss_scale, self.tensorboard_validation_ppl):
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars)
        if line:
            self._print(line)

    def _print(self, line: str) -> None:
        """``line`` on the console (above the progress bar when there is one)."""
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def step(self, iteration: int, values: dict) -> None:
        """Record one iteration; emit an averaged line when ``iteration`` is a multiple of the interval."""
        if not self.enabled:
            return
        self._pending.append(values)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{values['lm_loss']:.4f}")
        if not log_due(iteration, self.log_interval, self.train_iters):
            if iteration == self._first_iteration:  # NOTE: Megatron prints a line at a process's first iteration
                now = _wall_clock()  # too (is_first_iteration), only to the console, and keeps summing the interval
                rec = self._record(iteration, now)  # (the next line's averages include this iteration)
                self._print(self._line(rec, now))
                self._advanced = rec["lm_loss"] is not None
            return
        now = _wall_clock()
        rec = self._record(iteration, now)
        last = self._pending[-1]
        extra = last.get("log_lines", ())  # e.g. the timers (--timing-log-level >= 1)
        self._pending = []
        # NOTE: an interval whose every step was skipped has no loss average (the record's None); Megatron's
        # TensorBoard and W&B get the iteration's own loss whether or not it was skipped (training_log's loss_dict)
        scalars = {**rec, "lm_loss": last["lm_loss"]} if rec["lm_loss"] is None else dict(rec)
        if iteration == self._first_iteration:  # NOTE: Megatron's training_log writes no iteration-time at a
            del scalars["step_time_s"]  # process's first iteration (is_first_iteration): that step holds the warm-up
        # NOTE: a last iteration off the interval prints no training line (Megatron's training_log has none there);
        # the lines that follow one (timers, straggler report) still report the steps since the previous line
        lines = [self._line(rec, now)] if line_due(iteration, self.log_interval, self._first_iteration) else []
        self._advanced = self._advanced or rec["lm_loss"] is not None
        self._emit(rec, "\n".join([*lines, *extra]), scalars=scalars)

    def _record(self, iteration: int, now: datetime.datetime) -> dict:
        """The averaged record of the pending iterations (the last one's lr, norms and ``log`` values) at ``now``."""
        n = len(self._pending)
        last = self._pending[-1]
        skipped = [v for v in self._pending if v["skipped"]]
        rec = {"iteration": iteration, "lm_loss": _interval_loss(self._pending),
               "lr": last["lr"], "grad_norm": last["grad_norm"], "loss_scale": last["loss_scale"],
               "skipped_iters": len(skipped), "nan_iters": sum(_not_finite(v) for v in skipped),
               "step_time_s": sum(v["step_time_s"] for v in self._pending) / n, "time": _iso(now)}
        for key in ("consumed_samples", "global_batch_size"):  # NOTE: a ramp changes the batch; the last step's
            if key in last:
                rec[key] = last[key]
        for key in ("tokens_per_sec", "tflops_per_device", "mfu") + (("tokens_per_sec_per_device",) if self.throughput
                                                                      else ()):
            rec[key] = _interval_rate(self._pending, key)
        rec["peak_memory_bytes"] = last.get("peak_memory_bytes")
        for key in ("moe_aux_loss", "mtp_loss"):  # MoE's, MTP's: in lm_loss
            if key in last:
                rec[key] = sum(v[key] for v in self._pending) / n
        if "sop_loss" in last:  # BERT's sentence order (in lm_loss): a loss key of Megatron's, averaged as lm loss
            rec["sop_loss"] = _interval_loss(self._pending, "sop_loss")
        if "num_zeros_in_grad" in last:
            rec["num_zeros_in_grad"] = last["num_zeros_in_grad"]
        for key in ("decoupled_lr", "weight_decay"):  # the last step's (weight_decay: a scheduled decay only)
            if last.get(key) is not None:
                rec[key] = last[key]
        rec.update(last.get("log", {}))
        return rec

    def _printed_loss(self, loss: float | None) -> float | None:
        """The LM loss Megatron's line prints for an interval's average: sum over the advanced steps / max(1, their
        count), so 0 where every step was skipped, none before any step of this process advanced (its
        ``total_loss_dict`` has no loss key yet), and none for an average that is not ``>= 0`` (nan: Megatron's
        ``avg >= 0.0`` test leaves it out)."""
        if loss is None:
            loss = 0.0 if self._advanced else None
        return loss if loss is not None and loss >= 0.0 else None

    def _line(self, rec: dict, now: datetime.datetime) -> str:
        """The console line of one record: Megatron's training_log line, then omnitron's fields
        (:func:`omnitron.core.training.log_lines.training_line`)."""
        losses = {"lm loss": self._printed_loss(rec["lm_loss"])}
        if "sop_loss" in rec:  # pretrain_bert's second loss key, printed by the same rule
            losses["sop loss"] = self._printed_loss(rec["sop_loss"])
        return training_line(rec, self.train_iters, now, losses, self.throughput)

    def validation(self, iteration: int, values: dict, consumed_samples: int | None = None,
                   after_training: bool = False) -> None:
        """One validation (``val_loss``, ``val_ppl``) or test (``test_loss``, ``test_ppl``) record
        (``consumed_samples``: the training samples so far, for the ``vs samples`` tags), printed as Megatron's
        evaluate_and_print_results prints it (``after_training``: one of the evaluations after the loop, whose
        prefix names the split)."""
        if not self.enabled:
            return
        rec = {"iteration": iteration, **values, "time": _iso(_wall_clock())}
        self._emit(rec, "\n".join(validation_lines(iteration, values, after_training)), consumed_samples)

    def close(self) -> None:
        if self._bar is not None:
            self._log_through_bar.close()
        for h in (self._bar, self._tb, self._wandb, self._file):
            if h is not None:
                h.close()
