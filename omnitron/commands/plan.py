"""``omnitron plan``: memory per pipeline stage of a layout, before launching it (omnitron.plan)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omnitron.plan.settings import flat_flags, layout_flags, settings_of  # noqa: F401 - also imported from here


def register(sub) -> None:
    from omnitron.core.training.arguments import add_arguments

    p = sub.add_parser("plan", help="predict each pipeline stage's memory (and with --bench or --device the step "
                       "time) of a layout, or recommend layouts (--devices), before launch",
                       description="Predict each pipeline stage's memory (parameters, gradients, optimizer state, "
                       "activations, logits) for the training flags given, under --layout tpN,ppN,cpN,dpN or "
                       "the usual parallelism flags and --nproc-per-node; with --bench or --device also the step "
                       "time, with --devices the fastest layouts that fit.", argument_default=argparse.SUPPRESS)
    p.add_argument("--layout", metavar="LAYOUT", help="tp2,pp2,dp2 (a missing dimension is 1): sets the parallel "
                   "sizes and the world size")
    p.add_argument("--bench", nargs="+", metavar="REPORT", help="omnitron bench reports (files or `bench all` "
                   "folders) of the target machine: also predict the step time, tokens/s and its breakdown")
    p.add_argument("--assume-overlap", choices=("none", "dp", "all", "megatron"), help="communication hidden behind "
                   "compute: none (default), dp (gradient reduction), all (also pipeline sends, cp ring hops and the "
                   "parameter all-gather; tp collectives and expert all-to-alls stay on the critical path, as the "
                   "engine waits for them), megatron (all and tp collectives hidden: for comparing with Megatron-LM "
                   "runs that used --tp-comm-overlap; omnitron's engine runs all)")
    p.add_argument("--devices", type=int, help="recommend layouts for this many devices (needs --bench or --device, "
                   "and --global-batch-size): the fastest that fit, with their launch flags")
    p.add_argument("--device-memory", help="memory per device for --devices, e.g. 80GiB or 80GB (default with "
                   "--device: the profile's)")
    shipped = ", ".join(sorted(f.stem for f in (Path(__file__).parents[1] / "plan" / "devices").glob("*.toml")))
    p.add_argument("--device", metavar="PROFILE", help="price on a device profile (omnitron/plan/devices/): "
                   f"{shipped}, or a .toml of the same form; with --bench, a report of that accelerator replaces "
                   "the profile where it has rows")
    p.add_argument("--gpus-per-node", type=int, help="devices per node with --device (default: the profile's, 8)")
    p.add_argument("--json", metavar="FILE", help="write each layout's prediction (step time, tokens/s, "
                   "tflops_per_device by Megatron's formula, memory per stage) to FILE")
    p.add_argument("--top", type=int, help="layouts to print with --devices (default 5)")
    p.add_argument("--moe-expert-load", metavar="FILE", help='a measured routing histogram, JSON {"tokens_per_expert": '
                   "[[count per expert], ...]} one row per MoE layer (`omnitron train --moe-expert-load-out` writes "
                   "one): MoE layers priced at its imbalance and capacity drops instead of balanced routing, speed "
                   "on the ep group's busiest rank, memory on each stage's busiest ep rank")
    p.add_argument("--inference-max-requests", type=int, metavar="B", help="serving estimate instead of training: "
                   "weights, KV cache and the prefill's working set per rank for B requests (Megatron's flag; "
                   "default with --inference-max-seq-length: 8, Megatron's); with --device-memory or --device also "
                   "the most requests that fit; training's batch flags are set aside")
    p.add_argument("--inference-max-seq-length", type=int, metavar="S", help="tokens per request, prompt and "
                   "generated (LLaVA: with the image's positions; T5: the decoder's, the source is --seq-length) "
                   "(Megatron's flag; default with --inference-max-requests: the model's --seq-length, "
                   "not Megatron's 2560)")
    p.add_argument("--return-log-probs", action="store_true", help="serving estimate: the prompts' log-probs are "
                   "asked (Megatron's flag), so the prefill computes every position's logits, not the last one's")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.memory import estimate, format_table, vocabulary_line
    from omnitron.plan.layouts import Choice
    from omnitron.plan.speed import predict

    own = ("func", "command", "bench", "assume_overlap", "devices", "device_memory", "top", "device", "gpus_per_node",
           "json", "moe_expert_load", "inference_max_requests", "inference_max_seq_length", "return_log_probs")
    given = {k: v for k, v in vars(args).items() if k not in own}
    bench, overlap = getattr(args, "bench", None), getattr(args, "assume_overlap", "none")
    comm = given.get("cp_comm_type")
    if isinstance(comm, list) and len(comm) > 1:
        print(f"omnitron plan: error: the planner prices one --cp-comm-type for every layer, not the per-layer "
              f"list {' '.join(comm)}: price each type apart", file=sys.stderr)
        return 2
    if hasattr(args, "inference_max_requests") or hasattr(args, "inference_max_seq_length"):  # SUPPRESS: given
        return _serve(args, given)
    if hasattr(args, "return_log_probs"):
        return _error("--return-log-probs prices serving: give --inference-max-requests and/or "
                      "--inference-max-seq-length with it")
    if getattr(args, "devices", None) is not None:
        return _recommend(args, given, bench, overlap)
    try:
        rates, load = _rates(args, bench), _load(args)
        s = settings_of(given)
        stages = estimate(s, load=load, device=getattr(rates, "profile", None))
        step = predict(s, rates, overlap) if rates else None
        if step is not None and getattr(args, "json", None):
            _write(args, [Choice(flat_flags(given), s, step, stages)], rates)
    except ConfigError as err:
        print(f"omnitron plan: error: {err}", file=sys.stderr)
        return 2
    pc = s.parallel
    print(f"{s.model_type} {s.model.num_layers} layers, hidden {s.model.hidden_size} | world {s.world_size}: "
          f"tp{pc.tensor_model_parallel_size} pp{pc.pipeline_model_parallel_size} cp{pc.context_parallel_size} "
          f"dp{s.dp} | micro-batch {s.training.micro_batch_size} x {s.num_microbatches} | "
          f"{s.precision.params_dtype_name}")
    print(vocabulary_line(s))
    print(format_table(stages))
    fit = _fit_line(args, rates, stages)
    if fit:
        print(fit)
    if step is not None:
        from omnitron.plan.speed import format_step

        print(_named(rates))
        print(format_step(step))
    return 0


def _serve(args, given: dict) -> int:
    """``--inference-max-requests``: the serving estimate (:mod:`omnitron.plan.inference`)."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.inference import format_serve
    from omnitron.plan.memory import vocabulary_line

    try:
        s, requests, seq, stages, fused, memory, largest = _serve_figures(args, given)
    except ConfigError as err:
        return _error(err)
    pc = s.parallel
    print(f"serving {s.model_type} {s.model.num_layers} layers, hidden {s.model.hidden_size} | "
          f"tp{pc.tensor_model_parallel_size} pp{pc.pipeline_model_parallel_size}"
          f"{f' ep{pc.expert_model_parallel_size}' if pc.expert_model_parallel_size > 1 else ''} | {requests} "
          f"requests x {seq} tokens | {s.precision.params_dtype_name} weights and KV cache")
    print(vocabulary_line(s))
    print(format_serve(stages, memory, largest))
    less = max(st.total for st in stages) - fused
    if less > 0:
        print(f"(left-padded prompts: the masked attention's [b, heads, s, s] fp32 scores counted, as SDPA's math path "
              f"holds them (cpu, sim); a device whose masked SDPA is a fused kernel holds {less / 2**30:.3f} GiB less)")
    return 0


def _serve_figures(args, given: dict) -> tuple:
    """(settings, requests, tokens, stages, the largest rank's total without the masked scores, device memory or
    None, the most requests that fit or None); ConfigError on a flag the serving estimate does not take."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.inference import largest_batch, serve_estimate

    training_only = [f for f in ("devices", "bench", "json", "moe_expert_load") if getattr(args, f, None)]
    if training_only:
        raise ConfigError(f"--{training_only[0].replace('_', '-')} prices training; the serving estimate "
                          "(--inference-max-requests) takes the model, --tensor-model-parallel-size, "
                          "--pipeline-model-parallel-size, --bf16 and --device-memory / --device")
    s = settings_of(_serving_world(given), serving=True)
    requests = getattr(args, "inference_max_requests", 8)
    seq = getattr(args, "inference_max_seq_length", s.model.seq_length)
    log_probs = bool(getattr(args, "return_log_probs", False))
    stages = serve_estimate(s, requests, seq, log_probs=log_probs)
    fused = max(st.total for st in serve_estimate(s, requests, seq, padded=False, log_probs=log_probs))
    memory = _device_memory(args)
    return s, requests, seq, stages, fused, memory, largest_batch(s, seq, memory, log_probs) if memory else None


def _serving_world(given: dict) -> dict:
    """``given`` with the world of a sharded inference job where it names none (``--nproc-per-node``, ``--layout``):
    tp x ep x pp (:func:`omnitron.core.inference.sharded.serving_world`: ep ranks replicate the dense layers)."""
    if "nproc_per_node" in given or given.get("layout"):
        return given
    dims = [int(given.get(k, 1)) for k in ("tensor_model_parallel_size", "expert_model_parallel_size",
                                            "pipeline_model_parallel_size")]
    return {**given, "nproc_per_node": dims[0] * dims[1] * dims[2]}


def _error(err) -> int:
    """Print a refusal (one line) and return the command's exit code 2."""
    print(f"omnitron plan: error: {err}", file=sys.stderr)
    return 2


def _device_memory(args, prof=None) -> int | None:
    """The memory per device in bytes: ``--device-memory``'s, else ``--device``'s profile's (``prof``, that profile
    already loaded), else None."""
    from omnitron.plan.recommend import parse_memory

    if getattr(args, "device_memory", None):
        return parse_memory(args.device_memory)
    if prof is not None:
        return prof.memory_bytes
    device = getattr(args, "device", None)
    if not device:
        return None
    from omnitron.plan.profile import load

    return load(device).memory_bytes


def _fit_line(args, rates, stages) -> str | None:
    """Whether the layout's largest rank fits ``--device-memory`` (else ``--device``'s memory): the line to print,
    None without either. A prediction of a layout that does not fit says so first."""
    given = getattr(args, "device_memory", None)
    prof = getattr(rates, "profile", None)
    memory = _device_memory(args, prof)
    if not memory:
        return None
    top = max(stages, key=lambda st: st.total)
    gib, what = top.total / 2**30, f"--device-memory {given}" if given else f"{prof.name}'s {memory / 2**30:.1f} GiB"
    if top.total > memory:
        return (f"DOES NOT FIT: stage {top.stage} needs {gib:.3f} GiB, more than {what} (a run of this layout "
                f"would run out of memory; omnitron plan --devices N searches layouts that fit)")
    return f"fits {what}: the largest rank needs {gib:.3f} GiB"


def _rates(args, bench):
    """The rates to price with: the bench reports, or ``--device``'s profile on ``--gpus-per-node`` nodes; None
    without either (memory only). ConfigError when both are given."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.rates import Rates

    device = getattr(args, "device", None)
    if device:
        from omnitron.plan.cluster import device_rates

        rates = device_rates(device, getattr(args, "gpus_per_node", None), bench)
    elif getattr(args, "gpus_per_node", None):
        raise ConfigError("--gpus-per-node places a layout on --device's nodes; give --device too")
    else:
        rates = Rates.from_reports(bench) if bench else None
    if rates is not None:
        rates.expert_load = _load(args)
    return rates


def _load(args):
    """``--moe-expert-load``'s histogram (:func:`omnitron.plan.routing.read_expert_load`), or None."""
    if not getattr(args, "moe_expert_load", None):
        return None
    from omnitron.plan.routing import read_expert_load

    return read_expert_load(args.moe_expert_load)


def _named(rates) -> str:
    """The line naming what the prediction priced with."""
    prof = getattr(rates, "profile", None)
    if prof is None:
        return "rates: omnitron bench report(s)"
    return (f"device: {prof.name} ({prof.title}), {rates.gpus_per_node} per node, {prof.links.intra} + "
            f"{prof.links.nic}; profile {prof.path}" + ("; measured rows from the bench report(s) where they exist"
                                                        if rates.measured is not None else ""))


def _write(args, choices, rates) -> None:
    from omnitron.plan.cluster import record, write_json

    prof = getattr(rates, "profile", None)
    write_json(args.json, [record(c, prof.name if prof else "bench", getattr(rates, "gpus_per_node", 0))
                           for c in choices])


def _recommend(args, given: dict, bench, overlap: str) -> int:
    """``--devices``: the fastest layouts that fit, or one line naming what binds."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.memory import vocabulary_line
    from omnitron.plan.recommend import format_choices, recommend

    try:
        if not bench and not getattr(args, "device", None):
            raise ConfigError("--devices needs --bench REPORT (an omnitron bench report of the target machine) or "
                              "--device PROFILE (e.g. h100-sxm) to rank layouts by speed")
        rates = _rates(args, bench)
        prof = getattr(rates, "profile", None)
        if not getattr(args, "device_memory", None) and prof is None:
            raise ConfigError("--devices needs --device-memory (e.g. 80GiB)")
        if given.get("layout"):
            raise ConfigError("--devices searches layouts; drop --layout")
        memory = _device_memory(args, prof)
        top = getattr(args, "top", None)
        choices = recommend(given, args.devices, memory, rates, overlap, 5 if top is None else top,
                            cluster=getattr(rates, "gpus_per_node", None))
        if getattr(args, "json", None):
            _write(args, choices, rates)
    except ConfigError as err:
        print(f"omnitron plan: error: {err}", file=sys.stderr)
        return 2
    print(_named(rates))
    print(vocabulary_line(settings_of(given)))
    print(format_choices(choices, args.devices, memory))
    if prof is not None:
        print("search: tp within a node, the distributed optimizer on where dp x cp > 1; screened without backward's "
              "transient probes, every layout listed priced with them (as `--layout` prices one)")
    return 0
