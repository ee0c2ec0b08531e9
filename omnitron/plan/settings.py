"""The validated training Settings a plan prices: the user's flags, with ``--layout tpN,ppN,...`` turned into
the parallel sizes it means. Shared by ``omnitron plan`` and the layout search (:mod:`omnitron.plan.recommend`);
it lives with the planner because the planner does not import the command layer.
"""
from __future__ import annotations


def layout_flags(layout: str) -> tuple[dict, int]:
    """``--layout`` -> (flat settings it implies, world size); ConfigError on a malformed string."""
    from omnitron.bench.train import parse_layout
    from omnitron.core.config.parallel import ConfigError

    try:
        dims, world = parse_layout(layout)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    flags = {"tensor_model_parallel_size": dims["tp"], "pipeline_model_parallel_size": dims["pp"],
             "context_parallel_size": dims["cp"], "expert_model_parallel_size": dims["ep"]}
    return flags, world


def settings_of(given: dict):
    """Validated Settings for the plan (the layout's sizes override the flags of the same meaning)."""
    from omnitron.core.training.arguments import build_settings, merge_settings

    given = dict(given)
    world = None
    if given.get("layout"):
        flags, world = layout_flags(given.pop("layout"))
        given.update(flags)
    else:
        given.pop("layout", None)
    return build_settings(merge_settings(given), world)
