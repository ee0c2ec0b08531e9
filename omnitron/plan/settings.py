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


_DIMS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size", "cp": "context_parallel_size",
         "ep": "expert_model_parallel_size"}


def _merged(layout: str, flags: dict, given: dict) -> dict:
    """The layout's sizes, except that a dimension the layout string does not name keeps its flag (``--layout
    tp4,pp4,dp4 --expert-model-parallel-size 4`` plans ep4, as the flag says); a named dimension and a flag that
    disagree are a one-line error rather than one silently winning."""
    import re

    from omnitron.core.config.parallel import ConfigError

    named = set(re.findall(r"(tp|pp|cp|ep|dp)\d+", layout.lower()))
    out = {}
    for dim, key in _DIMS.items():
        if dim not in named and key in given:
            continue
        if dim in named and key in given and int(given[key]) != flags[key]:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(f"--layout {layout!r} says {dim}{flags[key]} but {flag} is {given[key]}: "
                              f"give the size once (in the layout, or drop {dim} from it)")
        out[key] = flags[key]
    return out


def flat_flags(given: dict) -> dict:
    """``given`` with ``--layout`` turned into the parallel-size flags it means (as :func:`settings_of` prices)."""
    given = dict(given)
    layout = given.pop("layout", None)
    if layout:
        given.update(_merged(layout, layout_flags(layout)[0], given))
    return given


def settings_of(given: dict, *, serving: bool = False):
    """Validated Settings for the plan: the layout's sizes, with flags for the dimensions it does not name.
    ``serving``: for the serving estimate, which runs no training step, so training's batch flags are set aside
    (:func:`_serving_batch`) rather than checked against the layout."""
    from omnitron.core.training.arguments import build_settings, merge_settings

    world = layout_flags(given["layout"])[1] if given.get("layout") else None
    merged = merge_settings(flat_flags(given))
    return build_settings(_serving_batch(merged, world) if serving else merged, world)


TRAINING_BATCH = ("global_batch_size", "micro_batch_size", "rampup_batch_size", "step_batch_size_schedule",
                  "eval_global_batch_size")
"""Training's batch flags: the serving estimate takes none (its batch is --inference-max-requests)."""


def _serving_batch(merged: dict, world: int | None) -> dict:
    """``merged`` without training's batch flags, and with a batch every pipeline schedule takes (2 x pp
    micro-batches of one sequence per data-parallel rank: interleaving needs multiples of pp, DualPipeV 2 pp), so
    that the training checks build_settings makes of the batch pass whatever the command line gave for training."""
    out = {k: v for k, v in merged.items() if k not in TRAINING_BATCH}
    sizes = [int(merged.get(k) or 1) for k in ("tensor_model_parallel_size", "context_parallel_size",
                                                "pipeline_model_parallel_size")]
    world = world or int(merged.get("nproc_per_node") or 1)
    dp = max(world // (sizes[0] * sizes[1] * sizes[2]), 1)  # a world that does not divide is refused later
    return {**out, "micro_batch_size": 1, "global_batch_size": 2 * sizes[2] * dp}
