"""``omnitron plan`` at cluster scale: the rates of a device profile on nodes of ``--gpus-per-node`` devices,
Megatron's FLOP count of a step, and each layout's prediction as a JSON record (``--json FILE``).

``tflops_per_device`` is Megatron-LM's model FLOPs per step (``num_floating_point_operations`` in its
``training.py``, :func:`omnitron.core.models.gpt.config.flops_per_iteration`: forward and backward GEMMs,
attention scores uncausal, logits; recomputation not counted) over the step time and the devices;
``tflops_per_device_recompute`` adds the recomputed layers' forward (full recomputation), the convention of
Narayanan et al. (SC21) ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``.
"""
from __future__ import annotations

import json

from omnitron.core.config.parallel import ConfigError


def device_rates(name: str, gpus_per_node: int | None, bench: list[str] | None = None):
    """:class:`omnitron.plan.device_rates.DeviceRates` of the profile ``name`` on nodes of ``gpus_per_node``
    devices (the profile's usual node when None); ``bench``: reports of the same accelerator whose rows replace
    the profile's where they have them."""
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.profile import load

    prof = load(name)
    gpn = gpus_per_node or prof.gpus_per_node
    if gpn < 1:
        raise ConfigError(f"--gpus-per-node must be >= 1, got {gpn}")
    measured = None
    if bench:
        from omnitron.plan.rates import Rates

        measured = Rates.from_reports(bench)
        if measured.device_type == "cpu":
            raise ConfigError(f"--bench {' '.join(bench)} was measured on a cpu, --device {name} is an accelerator; "
                              "give reports measured on that accelerator, or drop one of the two")
    return DeviceRates(prof, gpn, measured=measured)


def step_flops(settings, cfg, recompute: bool = False) -> float:
    """Model FLOPs of one step by Megatron's formula (module docstring); ``recompute``: plus the recomputed
    layers' forward under ``--recompute-granularity full`` (the logits are not recomputed)."""
    from dataclasses import replace

    from omnitron.core.models.gpt.config import flops_per_iteration

    gbs = settings.training.global_batch_size
    total = flops_per_iteration(cfg, gbs)
    if recompute and cfg.recompute_granularity == "full":
        no_head = flops_per_iteration(replace(cfg, vocab_size=0, make_vocab_size_divisible_by=1), gbs)
        total += no_head / 3
    return total


def record(choice, device: str, gpus_per_node: int) -> dict:
    """One layout's prediction as plain data (``--json``)."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.recommend import launch_flags

    s, st = choice.settings, choice.step
    cfg = model_config(s)
    per = [{"stage": m.stage, "layers": m.layers, "gib": m.total / 2**30, "params_gib": m.params / 2**30,
            "grads_gib": m.grads / 2**30, "optimizer_gib": m.optimizer / 2**30,
            "activations_gib": m.activations / 2**30, "transient_gib": (m.transient + m.recompute) / 2**30}
           | ({} if m.ep_rank is None else {"busiest_ep_rank": m.ep_rank, "balanced_gib": m.balanced / 2**30})
           for m in choice.stages or []]
    out = {"layout": choice.name(), "world": s.world_size, "device": device, "gpus_per_node": gpus_per_node,
           "launch": launch_flags(choice), "step_s": st.total, "tokens_per_s": st.tokens_per_s,
           "tflops_per_device": step_flops(s, cfg) / st.total / s.world_size / 1e12,
           "tflops_per_device_recompute": step_flops(s, cfg, True) / st.total / s.world_size / 1e12,
           "breakdown_s": st.breakdown(), "memory_per_stage": per,
           "peak_gib": max((m["gib"] for m in per), default=None), "assumptions": st.assumptions, "notes": st.notes}
    return out


def write_json(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"layouts": records}, f, indent=1)
        f.write("\n")
