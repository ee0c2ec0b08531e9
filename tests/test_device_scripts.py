"""The prepared GPU scripts stay runnable without a GPU: syntax, the dry-run plan, the 9-minute budget.

scripts/device_bench.sh is the one run a lent GPU gets (fifteen minutes of device time for everything,
one rerun included), so its step limits must add up to at most 540 s and every file a step uses must
exist in the checkout; DRY_RUN=1 checks both and runs nothing.
"""
import os
import shutil
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["device_bench.sh", "device_check.sh", "musa_smoke.sh", "prepare_corpus.sh", "lib/steps.sh"]
BUDGET_S = 540  # 9 minutes of the 15 lent (the machine's start takes one or two of the rest)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_parses(name):
    subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", name)], check=True)


def _train_commands(text: str) -> list[str]:
    """Each ``omnitron train --config ...`` command of a shell script, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.splitlines() if re.search(r"omnitron[\"']? train .*--config", line)]


@pytest.mark.parametrize("name", [n for n in SCRIPTS if n.endswith(".sh")] + ["ci_oldest_torch.sh"])
def test_scripts_save_outside_the_main_jobs_checkpoints(name):
    """A config's ``save:`` (the main job's runs/moby_dick_tp2_pp2) would get the script's short run as ``latest``
    and lose older checkpoints to ``keep-last-n``: every script that trains from a config names its own --save."""
    with open(os.path.join(ROOT, "scripts", name)) as f:
        for cmd in _train_commands(f.read()):
            config = re.search(r"--config (\S+\.yaml)", cmd).group(1)
            with open(os.path.join(ROOT, config)) as c:
                saves = any(line.startswith("save:") for line in c)
            assert not saves or "--save " in cmd, f"scripts/{name}: {config} saves into its own folder: {cmd.strip()}"


def _dry_run(script, tmp_path):
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path))
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", script)], env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, (tmp_path / "summary.md").read_text()


def test_device_bench_dry_run_writes_nothing_into_the_checkout():
    """Without OUT a dry run's plan goes to a temporary folder: benchmarks/results/ holds the same entries after."""
    results = os.path.join(ROOT, "benchmarks", "results")
    before = set(os.listdir(results))
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "device_bench.sh")], env=dict(env, DRY_RUN="1"),
                          capture_output=True, text=True, timeout=60)
    added = set(os.listdir(results)) - before
    for name in added:  # a failing run leaves nothing behind either
        shutil.rmtree(os.path.join(results, name), ignore_errors=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not added, f"a dry run wrote {sorted(added)} into benchmarks/results/"


def test_device_bench_dry_run_plan(tmp_path):
    """The plan runs the headline figures first (1.3B bf16 vs FP8, eager then compiled) and the whole run is
    held to the budget by BUDGET_S (steps past it are skipped), whatever the step limits add up to."""
    proc, summary = _dry_run("device_bench.sh", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^\| ([\w.-]+) \| dry run \|", summary, re.M)
    assert steps[:5] == ["environment", "train-bf16", "train-fp8-tensorwise", "train-bf16-compiled",
                         "train-fp8-tensorwise-compiled"]
    assert {"fp8-profile", "multirank", "conformance", "golden", "bench-all", "planted"} <= set(steps)
    script = open(os.path.join(ROOT, "scripts", "device_bench.sh")).read()
    budget = int(re.search(r"BUDGET_S=\$\{BUDGET_S:-(\d+)\}", script).group(1))
    assert budget <= BUDGET_S, f"device_bench.sh's default budget {budget}s is over {BUDGET_S}s"
    assert "missing files: 0" in summary


def test_budget_skips_the_steps_that_no_longer_fit(tmp_path):
    """BUDGET_S trims a step's limit to what is left and skips a step with too little left (the row says so):
    a 3 s budget, a 1 s step, a 60 s step cut at the 2 s left, and a step with under 1 s left skipped."""
    lib = os.path.join(ROOT, "scripts", "lib", "steps.sh")
    script = tmp_path / "plan.sh"
    script.write_text(f"LOG_DIR={tmp_path}\nsource {lib}\nrun_step first 60 sleep 1\n"
                      f"run_step second 60 sleep 60\nrun_step third 10 true\nwrite_summary plan\n")
    env = dict(os.environ, BUDGET_S="3", BUDGET_MIN_STEP_S="1")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    summary = (tmp_path / "summary.md").read_text()
    assert re.search(r"^\| first \| ok \|", summary, re.M), summary
    assert re.search(r"^\| second \| TIMED OUT after [12]s \|", summary, re.M), summary
    assert re.search(r"^\| third \| skipped \(budget\) \|", summary, re.M), summary
    assert proc.returncode != 0  # a timed-out step fails the run


def test_dry_run_reports_a_missing_file(tmp_path):
    """The plan check can fail: a step naming an absent file makes the dry run exit non-zero."""
    lib = os.path.join(ROOT, "scripts", "lib", "steps.sh")
    script = tmp_path / "plan.sh"
    script.write_text(f'LOG_DIR={tmp_path}\nsource {lib}\nneed {tmp_path}/absent.py\n'
                      f'run_step x 10 true\nwrite_summary plan\n')
    proc = subprocess.run(["bash", str(script)], env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True)
    assert proc.returncode != 0 and "MISSING" in proc.stdout


def test_multirank_driver_layouts_parse():
    """Every layout the device step runs is a valid `omnitron train` flag set (checked without training)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import device_multirank
    finally:
        sys.path.pop(0)
    import argparse

    from omnitron.core.training.arguments import add_arguments, build_settings, merge_settings

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    for name, (procs, flags) in device_multirank.LAYOUTS.items():
        argv = ["--config", os.path.join(ROOT, device_multirank.CONFIG), "--nproc-per-node", str(procs),
                "--train-iters", "2", "--lr-warmup-iters", str(device_multirank.warmup_iters(2)), *flags]
        settings = build_settings(merge_settings(vars(parser.parse_args(argv))))
        assert settings is not None, name
