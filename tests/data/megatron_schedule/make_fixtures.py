"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: each step's learning rate, decoupled rate,
weight decay and global batch size that omnitron's schedule must reproduce.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU, offline. Run from the
omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_schedule/make_fixtures.py

(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.) omnitron is not imported.
Each case's flags go through Megatron's ``parse_args`` and ``validate_args``; the scheduler is Megatron's
``get_optimizer_param_scheduler`` over an optimizer stand-in with two parameter groups (the default one, and the
embedding/output group with --decoupled-lr's max_lr / min_lr as ``get_standard_config_overrides`` makes it); the
steps are driven as ``train`` / ``train_step`` drive them: the batch size from the num-microbatches calculator at
the consumed samples, ``step(increment=num_microbatches x micro batch x dp)`` after each successful step (a skipped
fp16 step advances the samples, not the scheduler). Resume cases save run A's ``state_dict`` and load it into run
B's scheduler under B's flags (``load_state_dict``), as ``load_checkpoint`` does.
"""
from __future__ import annotations

import json
import os
import sys
import typing
import warnings

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--max-position-embeddings", "16", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "256"]
"""The model flags Megatron's parser needs (the schedule does not depend on them); omnitron's test gives the same."""
ITER = "--train-iters 30 --global-batch-size 8 --lr 1e-3 --min-lr 1e-5"
SAMPLES = "--train-samples 200 --global-batch-size 8 --lr 1e-3 --min-lr 1e-5"
CASES = {  # name -> (flags, steps skipped as fp16 overflows)
    "linear_warmup": (ITER + " --lr-warmup-iters 4", ()),
    "cosine_decay_iters_init": (ITER + " --lr-decay-style cosine --lr-warmup-iters 3 --lr-decay-iters 20 "
                                "--lr-warmup-init 1e-4", (2, 7)),
    "constant": (ITER + " --lr-decay-style constant --lr-warmup-iters 5", ()),
    "isr": (ITER + " --lr-decay-style inverse-square-root --lr-warmup-iters 4", ()),
    "isr_no_warmup": (ITER + " --lr-decay-style inverse-square-root", ()),
    "wsd_exponential": (ITER + " --lr-decay-style WSD --lr-warmup-iters 2 --lr-wsd-decay-iters 8", ()),
    "wsd_linear": (ITER + " --lr-decay-style WSD --lr-wsd-decay-iters 6 --lr-wsd-decay-style linear "
                   "--lr-decay-iters 25", ()),
    "wsd_cosine": (ITER + " --lr-decay-style WSD --lr-warmup-iters 3 --lr-wsd-decay-iters 10 "
                   "--lr-wsd-decay-style cosine", ()),
    "wsd_minus_sqrt": (ITER + " --lr-decay-style WSD --lr-wsd-decay-iters 7 --lr-wsd-decay-style minus_sqrt", ()),
    "warmup_fraction": (ITER + " --lr-decay-style cosine --lr-warmup-fraction 0.13 --lr-decay-iters 23", ()),
    "decoupled": (ITER + " --lr-decay-style cosine --lr-warmup-iters 3 --decoupled-lr 4e-3 --decoupled-min-lr 2e-5",
                  (5,)),
    "decoupled_default_min": (SAMPLES + " --lr-decay-style linear --lr-warmup-samples 20 --decoupled-lr 3e-3", ()),
    "wd_linear": (ITER + " --lr-warmup-iters 2 --weight-decay-incr-style linear --start-weight-decay 0.01 "
                  "--end-weight-decay 0.1", (4,)),
    "wd_cosine_decay_iters": (ITER + " --lr-decay-style cosine --lr-decay-iters 12 --weight-decay-incr-style cosine "
                              "--start-weight-decay 0.0 --end-weight-decay 0.3", ()),
    "samples_cosine": (SAMPLES + " --lr-decay-style cosine --lr-warmup-samples 30 --lr-decay-samples 150", (3,)),
    "samples_fraction": (SAMPLES + " --lr-decay-style linear --lr-warmup-fraction 0.07", ()),
    "samples_wsd": (SAMPLES + " --lr-decay-style WSD --lr-warmup-samples 12 --lr-wsd-decay-samples 60 "
                    "--lr-wsd-decay-style cosine", ()),
    "samples_isr": (SAMPLES + " --lr-decay-style inverse-square-root --lr-warmup-samples 10", ()),
    "samples_wd": (SAMPLES + " --weight-decay-incr-style cosine --start-weight-decay 0.02 --end-weight-decay 0.2", ()),
    "samples_step_schedule": ("--train-samples 120 --step-batch-size-schedule 0:2,128:4,512:8 --lr 1e-3 --min-lr 1e-5 "
                              "--lr-decay-style cosine --lr-warmup-samples 10 --weight-decay-incr-style linear "
                              "--start-weight-decay 0.0 --end-weight-decay 0.1", (1,)),
}
RESUMES = {  # name -> (run A's flags, its successful steps, run B's flags, B's steps): --global-batch-size changed
    "gbs_override": ("--global-batch-size 4 --train-iters 3", 3,
                     "--global-batch-size 8 --train-iters 8 --override-opt_param-scheduler", 5),
    "gbs_use_checkpoint": ("--global-batch-size 4 --train-iters 3", 3,
                           "--global-batch-size 8 --train-iters 8 --use-checkpoint-opt_param-scheduler", 5),
}
RESUME_SCHEDULE = "--lr 1e-3 --lr-warmup-iters 2 --lr-decay-iters 10 --min-lr 1e-5 --lr-decay-style cosine"


class _Optimizer:
    """What the scheduler touches: ``param_groups`` (the default group; the decoupled group with its end points)."""

    def __init__(self, args) -> None:
        self.param_groups = [{"params": [], "default_config": True, "wd_mult": 1.0}]
        if args.decoupled_lr is not None:
            group = {"params": [], "max_lr": args.decoupled_lr, "wd_mult": 1.0}
            if args.decoupled_min_lr is not None:
                group["min_lr"] = args.decoupled_min_lr
            self.param_groups.append(group)


def _scheduler(flags: list[str]):
    """(scheduler, optimizer stand-in, args) for ``flags`` through Megatron's own parsing."""
    import megatron.training.global_vars as gv
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import get_optimizer_param_scheduler

    sys.argv = ["pretrain_gpt.py", *MODEL, *flags]
    args = validate_args(parse_args(), {})
    gv._GLOBAL_ARGS = args
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size,
                                         args.data_parallel_size, args.decrease_batch_size_if_needed,
                                         step_batch_size_schedule=args.step_batch_size_schedule,
                                         seq_length=args.seq_length)
    opt = _Optimizer(args)
    return get_optimizer_param_scheduler(opt), opt, args


def _run(sched, opt, args, steps: int, skipped=(), consumed: int = 0) -> list[list]:
    """[lr, decoupled lr (or lr), weight decay, global batch] of each step, as ``train`` drives the scheduler."""
    from megatron.core import num_microbatches_calculator as nmc

    out = []
    for i in range(steps):
        nmc.update_num_microbatches(consumed, consistency_check=False)
        gbs = nmc.get_current_global_batch_size()
        groups = opt.param_groups
        out.append([groups[0]["lr"], groups[-1]["lr"], groups[0]["weight_decay"], gbs])
        if i not in skipped:
            sched.step(increment=nmc.get_num_microbatches() * args.micro_batch_size * args.data_parallel_size)
        consumed += gbs
    return out


def main() -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    fixtures = {"cases": {}, "resumes": {}, "model": MODEL}
    for name, (flags, skipped) in CASES.items():
        sched, opt, args = _scheduler(flags.split())
        fixtures["cases"][name] = {"flags": flags, "skipped": list(skipped),
                                   "steps": _run(sched, opt, args, args.train_iters + 3, skipped)}
    for name, (a, done, b, steps) in RESUMES.items():
        sched, opt, args = _scheduler((RESUME_SCHEDULE + " " + a).split())
        consumed = sum(row[3] for row in _run(sched, opt, args, done))
        state = sched.state_dict()
        sched, opt, args = _scheduler((RESUME_SCHEDULE + " " + b).split())
        sched.load_state_dict(state)
        fixtures["resumes"][name] = {"first": RESUME_SCHEDULE + " " + a, "done": done,
                                     "then": RESUME_SCHEDULE + " " + b,
                                     "steps": _run(sched, opt, args, steps, consumed=consumed)}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(fixtures, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
