"""``omnitron train``: parse and validate every setting, then launch the workers and train."""
from __future__ import annotations

import argparse


def register(sub) -> None:
    from omnitron.core.training.arguments import add_arguments

    p = sub.add_parser("train", help="train a GPT / Llama, BERT, T5 or LLaVA model (Megatron flag names; see --help)",
                       description="Train a Transformer model (--model-type gpt, bert, t5 or multimodal) with tensor, "
                       "sequence, pipeline, context, expert and data parallelism. Flags use Megatron's spellings; "
                       "--config FILE supplies the same keys (flags win).",
                       argument_default=argparse.SUPPRESS, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    given = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    return main_from_dict(given)


def main_from_dict(given: dict) -> int:
    """Validate (exit code 2 with one line naming the flag on bad settings), then launch. A torchrun rank first
    holds its lifeline (:mod:`omnitron.core.training.lifeline`): should it die before joining, its peers on every
    node stop waiting for it within a poll."""
    from omnitron.core.training import lifeline

    lifeline.hold()
    from omnitron.backends.registry import get_backend
    from omnitron.commands.fits import DoesNotFit, check_fits, refuse_once_a_host
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import build_settings, merge_settings
    from omnitron.core.training.failures import refuse
    from omnitron.core.training.launch import launch, precheck

    try:
        settings = build_settings(merge_settings(given))
        precheck(settings)
        check_fits(settings, get_backend(settings.backend))  # one line, not the allocator's traceback from each rank
    except DoesNotFit as err:  # every rank's verdict alike: said once a host
        return refuse_once_a_host(err)
    except (ConfigError, CheckpointError) as err:
        return refuse(err)
    try:
        return launch(settings, training_entry(settings))
    except (ConfigError, CheckpointError) as err:  # --save held by another job; one process: a corrupt shard
        return refuse(err)


def training_entry(settings):
    """What every rank runs: the training loop, given the planner's memory table under --log-memory-estimate
    (a partial of module-level functions, so spawned workers can import it)."""
    if not settings.logging.log_memory_estimate:
        return None  # launch's default: the training loop
    import functools

    from omnitron.core.training.loop import train
    from omnitron.plan.memory import memory_table

    return functools.partial(train, memory_table=memory_table)
