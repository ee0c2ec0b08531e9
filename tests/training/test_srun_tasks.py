"""``omnitron train`` started by srun as several tasks without torchrun is refused in one line: omnitron reads none
of SLURM's variables, so each task trained a separate copy of the model. An sbatch script's own process (SLURM's
job variables, no step of several tasks) and a task given RANK (torchrun's, or exported) are left alone."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.launch import check_not_srun_tasks

ARGS = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1", "--num-workers", "0",
        "--no-tensorboard"]
# what srun sets for task 1 of a step of 4 tasks on 2 nodes; sbatch's batch script sees the job's, no step's
SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "node[01-02]"}
BATCH_SCRIPT = {k: v for k, v in SRUN_TASK.items() if not k.startswith("SLURM_STEP")}


def test_an_srun_task_without_rank_is_refused_naming_the_task():
    with pytest.raises(ConfigError, match=r"^started by srun as task 1 of 4 without torchrun: .* Start one torchrun "
                                          r"per node"):
        check_not_srun_tasks(SRUN_TASK)


@pytest.mark.parametrize("env", [BATCH_SCRIPT, dict(SRUN_TASK, RANK="1"), dict(SRUN_TASK, SLURM_STEP_NUM_TASKS="1"),
                                 {}], ids=["sbatch-script", "rank-given", "one-task", "no-slurm"])
def test_other_launches_are_left_alone(env):
    check_not_srun_tasks(env)


def test_the_cli_refuses_before_training(tmp_path):
    """The whole command as srun's task 1 of 4 would run it: exit code 2, one line, nothing trained or saved
    (without the check it trained alone and saved under --save)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") and not k.startswith("SLURM_")}
    env.update(SRUN_TASK, SLURM_PROCID=str(random.randrange(4)), OMP_NUM_THREADS="1",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "omnitron.train", *ARGS, "--save", str(tmp_path / "ck")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert errors[0].startswith(f"omnitron train: error: started by srun as task {env['SLURM_PROCID']} of 4 without "
                                "torchrun: "), errors
    assert not os.path.exists(tmp_path / "ck" / "latest")


def test_a_launch_in_the_suite_is_not_an_srun_task(tmp_path):
    """One training launched in this process, as the suite's tests launch theirs (run alone by the next test,
    inside a planted srun step)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.launch import launch

    assert launch(parse_settings(ARGS + ["--save", str(tmp_path / "ck")])) == 0
    assert os.path.exists(tmp_path / "ck" / "latest")


def test_the_suite_inside_a_several_task_srun_step_launches_its_trainings(tmp_path):
    """pytest as task 1 of a 4-task srun step (SLURM_STEP_* inherited): its launches are not refused as srun
    tasks (tests/conftest.py removes the step's task variables; the job's stay). Without that the launch above
    stopped on "started by srun as task 1 of 4 without torchrun". About 10 s on 2 cores."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SRUN_TASK, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "t"), f"{__file__}::test_a_launch_in_the_suite_is_not_an_srun_task"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=os.getcwd())
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
