"""Run the training function on this process (torchrun, one process) or on N spawned local workers.

Under torchrun (``RANK``/``WORLD_SIZE`` set) each process joins the default process group and
trains. ``--nproc-per-node N`` starts N workers, each with its share of the cores (processes x threads never
exceed them unless ``--threads-per-process`` or ``OMP_NUM_THREADS`` asks), and forwards SIGTERM to them; each
worker finishes its step, saves and exits. The launcher (rank 0 under torchrun) holds the lock on
``--save`` for the job's life (:mod:`omnitron.core.training.outputs`). Workers die with their launcher,
and a failed job is summarised in a few lines naming the rank at fault (:mod:`omnitron.core.training.workers`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from omnitron.core.config.parallel import ConfigError
from omnitron.core.lifetime import die_with_parent
from omnitron.core.training import failures
from omnitron.core.training.metrics import new_run_dir
from omnitron.core.training.outputs import check_writable, lock_outputs

log = logging.getLogger("omnitron.train")


def precheck(settings) -> None:
    """Checks that need files or the backend but no process group (raise ConfigError/CheckpointError)."""
    from omnitron.backends.registry import BackendUnavailableError, get_backend

    try:
        backend = get_backend(settings.backend)
    except BackendUnavailableError as err:
        raise ConfigError(f"--backend: {err}") from None
    _check_kernels(backend)
    _check_dtype(settings.precision, backend)
    if settings.fp8 is not None:
        from omnitron.core.precision.fp8 import check_backend

        check_backend(settings.fp8, backend)  # e.g. a backend without FP8 formats: one clear line
    _check_files(settings)
    check_writable(settings)  # a read-only --save is found now, not at the first save after the work
    from omnitron.core.training.wandb_log import check_available

    check_available(settings.logging)
    from omnitron.core.training.datacheck import check_tokenizer_and_data

    check_tokenizer_and_data(settings)
    if settings.checkpoint.load:
        from omnitron.core.training.checkpointing import check_resume

        check_resume(settings)


def _check_dtype(precision, backend) -> None:
    """``--bf16`` / ``--fp16`` on a device whose capabilities do not list that dtype (``Capabilities.dtypes``, a
    fact of the device): refused naming what it has, as ``--fp8-format`` is on a device without FP8."""
    import torch

    have = backend.capabilities().dtypes
    flags = {"--bf16": (precision.bf16, torch.bfloat16), "--fp16": (precision.fp16, torch.float16)}
    for flag, (on, dtype) in flags.items():
        if on and dtype not in have:
            instead = [f for f, (_, d) in flags.items() if f != flag and d in have] + ["fp32 (neither flag)"]
            raise ConfigError(f"{flag}: the {backend.name} backend's device has no {flag[2:]} (its dtypes: "
                              f"{', '.join(str(d).replace('torch.', '') for d in have)}); use {' or '.join(instead)}")


def _check_kernels(backend) -> None:
    """The backend's kernel table resolves every op (its kernel module imports, each implementation takes the
    reference's calls, ``OMNITRON_KERNELS`` names real ones): one line here, not a traceback from every worker."""
    from omnitron.kernels.registry import KernelContractError

    try:
        backend.kernels.table()
    except KernelContractError as err:
        raise ConfigError(str(err)) from None


def _check_files(settings) -> None:
    """Data and tokenizer files named on the command line exist (before workers start)."""
    from omnitron.core.data.config import parse_data_path

    d = settings.data
    for flag, paths in ([] if d.mock_data else d.path_flags()):
        for _, prefix in parse_data_path(paths):
            for ext in (".bin", ".idx"):
                if not os.path.exists(prefix + ext):
                    raise ConfigError(f"{flag} {prefix}: {prefix}{ext} not found; give the prefix of an indexed "
                                      f"dataset (omnitron preprocess writes PREFIX_text_document.bin/.idx)")
    for flag, path in (("--vocab-file", d.vocab_file), ("--merge-file", d.merge_file),
                       ("--tokenizer-model", d.tokenizer_model)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{flag} {path}: file not found")


def _threads(settings, local_world: int) -> int:
    """Torch threads for one worker: ``--threads-per-process``, else ``OMP_NUM_THREADS`` where the environment set
    it (torchrun's 1, a scheduler's share, a test runner's), else the cores shared among the node's workers."""
    if settings.threads:
        return settings.threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={env!r} is not a positive integer: set it to the threads each worker "
                             "should use, or unset it")
        return int(env)
    cores = os.cpu_count() or 1
    return max(1, cores // local_world) if local_world > 1 else max(1, min(cores, 8))


def _worker(rank: int, world: int, port: int, settings, entry, launcher_pid: int, env: dict[str, str]) -> None:
    import torch

    from omnitron.core.training.workers import enter_worker

    enter_worker(launcher_pid, env, unblock=False)  # unblocked once _run_rank has installed the stop flag
    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(_threads(settings, world))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(_run_rank(settings, entry))


def _run_rank(settings, entry=None) -> int:
    """Join the job (store per restart attempt, process group, watchdog), run ``entry``; the exit code.
    A failure is reported in one line (:mod:`omnitron.core.training.failures`)."""
    from omnitron.backends import get_backend
    from omnitron.core.training import signals
    from omnitron.core.training.loop import train
    from omnitron.core.training.nonfinite import TrainingStopped
    from omnitron.core.training.watchdog import NullWatchdog
    from omnitron.core.training.workers import join_job, unblock_stop_signals

    entry = entry or train
    backend = get_backend(settings.backend)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = backend.device_count()
    if devices > 1:  # one device per local rank (a no-op on the host CPU)
        backend.set_device(int(os.environ.get("LOCAL_RANK", "0")) % devices)
    watchdog, ok, fault = NullWatchdog(), False, None
    stop = signals.install(settings.checkpoint) if _trains(settings, entry, train) else None
    unblock_stop_signals()  # a forked rank's (a signal pending since its start acts now)
    try:
        if world > 1:
            watchdog = join_job(settings, backend)
        entry(settings, backend, watchdog=watchdog)
        ok = True
    except (Exception, signals.StopNow) as exc:  # noqa: BLE001 - every failure becomes one report
        if isinstance(exc, signals.StopNow):  # a second stop signal: what happened, not where (no traceback)
            exc = TrainingStopped(str(exc))
        kind, line = failures.classify(exc)
        fault = line if kind != "peer" else None  # this rank's own fault: its last heartbeat names it
        return failures.handle(exc, int(os.environ.get("RANK", "0")), watchdog.dump, watchdog.silent_ranks)
    finally:
        if stop is not None:
            signals.uninstall(stop)
        watchdog.stop(fault)
        if ok:  # after a failure the group may wait on a dead peer: the process just exits
            backend.collectives.destroy()
    return 0


def _trains(settings, entry, train) -> bool:
    """Whether ``entry`` is the training loop (the default, or it with arguments bound), which takes over the
    stop flag the rank installs at its start (:mod:`omnitron.core.training.signals`)."""
    trains = entry is train or getattr(entry, "func", None) is train  # a functools.partial of it
    return trains and getattr(settings, "checkpoint", None) is not None


def _name_run_dir(settings, entry) -> None:
    """Training with neither ``--save`` nor ``--log-dir``: one new ``./runs/<timestamp>`` (``runs_root()``) for
    the job, named here so every worker writes to the same folder (each rank taking its own clock could straddle a
    second) and locked like a given ``--log-dir`` (two jobs started in the same second take two folders)."""
    lg, ck = getattr(settings, "logging", None), getattr(settings, "checkpoint", None)
    if entry is None and lg is not None and ck is not None and not lg.log_dir and not ck.save:
        lg.log_dir = new_run_dir()


SRUN_TASK_VARIABLES = ("SLURM_STEP_", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID",
                       "SLURM_GTIDS", "SLURM_SRUN_COMM_", "SLURM_LAUNCH_NODE_IPADDR")
"""Names (and prefixes) of the variables srun sets for each task of a step: what makes a process a task of it
(:func:`check_not_srun_tasks` reads ``SLURM_STEP_NUM_TASKS``); the job's own (``SLURM_JOB_ID``, ``SLURM_NTASKS``,
...) are not among them."""


def srun_task_variables(env) -> list[str]:
    """The names in ``env`` of :data:`SRUN_TASK_VARIABLES`: what a process that starts its own launches (the test
    suite) removes, so that they are not taken for tasks of the step it runs in."""
    return [k for k in env if k.startswith(SRUN_TASK_VARIABLES)]


def check_not_srun_tasks(env=None) -> None:
    """ConfigError for a process that srun started as one of several tasks of its step (``SLURM_STEP_NUM_TASKS``
    > 1) with no ``RANK``: omnitron reads no SLURM variables, so each task would train a copy of the model of its
    own (two srun tasks without --save both trained, each into its own runs folder; with --save the second was
    refused as "in use by another job"). An sbatch script's own process (``SLURM_NTASKS`` set, no step) is no
    task of a step: a launch from it is left alone."""
    env = os.environ if env is None else env
    tasks = env.get("SLURM_STEP_NUM_TASKS", "").strip()
    if "RANK" in env or not tasks.isdigit() or int(tasks) < 2:
        return
    raise ConfigError(f"started by srun as task {env.get('SLURM_PROCID', '?')} of {tasks} without torchrun: omnitron "
                      "does not read SLURM's variables, so each task would train a separate copy. Start one torchrun "
                      "per node (srun --ntasks-per-node 1 torchrun --nnodes $SLURM_NNODES ...: "
                      "examples/slurm_gpt_1p3b.sh), or export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                      "MASTER_PORT in each task")


def launch(settings, entry=None) -> int:
    """Run ``entry(settings, backend, watchdog=...)`` (default: the training loop) on every rank; the exit code.

    ``entry`` must be a module-level function (spawned workers import it)."""
    check_not_srun_tasks()
    if settings.backend:
        # every module that asks for the backend (and every spawned worker) sees the same choice
        os.environ["OMNITRON_BACKEND"] = settings.backend
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != settings.world_size:
            settings.world_size = int(os.environ["WORLD_SIZE"])
        import torch

        die_with_parent(os.getppid())  # torchrun's agent: its workers must not outlive it
        if int(os.environ["RANK"]) == 0:
            _name_run_dir(settings, entry)  # the other ranks read it from the store (workers.join_job)
        torch.set_num_threads(_threads(settings, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        with lock_outputs(settings) if int(os.environ["RANK"]) == 0 else contextlib.nullcontext():
            return _run_rank(settings, entry)
    n = settings.nproc_per_node
    _name_run_dir(settings, entry)
    with lock_outputs(settings):  # the launcher holds it: a killed launcher's lock goes with it
        if n == 1:
            import torch

            torch.set_num_threads(_threads(settings, 1))
            return _run_rank(settings, entry)
        from omnitron.core.training.workers import run_workers

        _threads(settings, n)  # a bad OMP_NUM_THREADS stops the launcher, not each of its workers
        return run_workers(settings, entry, n, _worker)
