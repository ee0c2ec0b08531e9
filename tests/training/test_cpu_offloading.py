"""Activation offloading (--cpu-offloading-num-layers, --cpu-offloading-activations / -weights): the same
losses and final weights bit for bit as without it, nothing offloaded alive past its step, and the host bytes
offloaded equal what the flags select, counted here independently (a plain saved-tensors hook over one forward
of the offloaded layers), on cpu and on sim, whose asynchronous streams, stream-ordered allocator (a block freed
while another stream may still use it is an error) and guarded pinned pages are where a missing wait or
record_stream fails."""
from __future__ import annotations

import os

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

ITERS, MICRO_BATCHES, LAYERS = 3, 2, 3


def _args(root: str, extra) -> list[str]:
    return ["--num-layers", str(LAYERS), "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "96",
            "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", str(2 * MICRO_BATCHES),
            "--log-interval", str(ITERS), "--no-tensorboard", "--data-cache-path", os.path.join(root, "cache"),
            "--lr", "1e-2", "--train-iters", str(ITERS), "--clip-grad", "1.0", *extra]


def saved_bytes_per_forward(model, offloaded: int, modules: list | None = None) -> dict[str, int]:
    """Bytes the first ``offloaded`` layers (or the given ``modules``) save for backward in one training forward,
    by kind (a tensor that shares storage with one of the model's parameters is a weight), from a recording
    hook of its own."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = modules if modules is not None else list(model.decoder.layers.values())[:offloaded]
    inside, out = [False], {"activation": 0, "weight": 0}

    def pack(t):
        if inside[0] and t.numel() and t.device == next(model.parameters()).device:
            out["weight" if t.untyped_storage().data_ptr() in params else "activation"] += t.numel() * t.element_size()
        return t

    hooks = [m.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)) for m in layers]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__(0, False)) for m in layers]
    device = next(model.parameters()).device
    b, s, v = 2, model.config.seq_length, model.config.vocab_size
    tokens, labels = torch.randint(0, v, (b, s), device=device), torch.randint(0, v, (b, s), device=device)
    saved, model.offloader = model.offloader, None
    if hasattr(saved, "enabled"):  # the fine-grained offloader's hooks sit on the modules themselves
        saved.enabled = False
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens=tokens, labels=labels).sum().backward()
    finally:
        model.offloader = saved
        if hasattr(saved, "enabled"):
            saved.enabled = True
        for h in hooks:
            h.remove()
    model.zero_grad(set_to_none=True)
    return out


def train_offloading(root: str, extra: tuple) -> dict:
    """Train on this worker's backend with ``extra`` flags; the losses, the offloader's counts and the
    independently counted bytes the flags select."""
    import dataclasses
    import gc

    import torch

    from omnitron.backends import get_backend
    from omnitron.core.models.gpt.config import offload_layers
    from omnitron.core.parallel.data.wrapper import unwrap_model
    from omnitron.core.training import loop
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.transformer.offload import _Held

    torch.set_num_threads(1)
    backend, allocated = get_backend(), []
    step = loop._guarded_step

    def recorded_step(*args, **kwargs):  # the device allocator's bytes after each step (cpu has none: its RSS)
        values = step(*args, **kwargs)
        backend.synchronize()
        allocated.append(backend.memory_stats()["allocated"] if backend.name != "cpu" else None)
        return values

    loop._guarded_step = recorded_step
    res = loop.train(parse_settings(_args(root, extra), torch.distributed.get_world_size()), backend)
    model = unwrap_model(res["components"].modules[0])
    n = offload_layers(model.config)
    stats = [dataclasses.asdict(unwrap_model(c).offloader.stats) for c in res["components"].modules
             if unwrap_model(c).offloader]
    gc.collect()
    out = {"losses": res["losses"], "stats": stats[0] if len(stats) == 1 else stats or None,
           "weights": [p.detach().cpu().clone() for c in res["components"].modules for p in c.parameters()],
           "allocated": allocated, "held": sum(isinstance(o, _Held) for o in gc.get_objects())}
    if n and model.pre_process:  # a chunk that takes tokens (a later pipeline stage takes the previous' output)
        out["expected"] = saved_bytes_per_forward(model, n)
    if model.config.fine_grained_activation_offloading:  # the chosen submodules of every layer, by their paths
        paths = {"attn_norm": "input_layernorm", "attn_proj": "self_attention.linear_proj",
                 "mlp_norm": "pre_mlp_layernorm", "qkv_linear": "self_attention.linear_qkv"}
        chosen = [layer.get_submodule(paths[name]) for layer in model.decoder.layers.values()
                  for name in model.config.offload_modules]
        out["expected"] = saved_bytes_per_forward(model, 0, chosen)
    return out


def _same_run(plain: dict, off: dict) -> None:
    """The offloaded run is the plain one bit for bit (losses and final weights), and it left nothing behind: the
    device bytes allocated after every step are the plain run's (on a device with an allocator) and no offloaded
    tensor (host copy or device copy) is alive after the run."""
    assert off["losses"] == plain["losses"], "offloading changed the losses"
    assert len(off["weights"]) == len(plain["weights"]) and all(
        bool((a == b).all()) for a, b in zip(off["weights"], plain["weights"])), "offloading changed the weights"
    assert off["allocated"] == plain["allocated"], "an offloaded tensor outlived its step on the device"
    assert off["held"] == 0, f"{off['held']} offloaded tensors still alive after the run"


def _check(backend: str, tmp_path, flags: tuple, kinds: set[str]) -> None:
    plain, off = run_distributed(train_offloading, 1, str(tmp_path / "a"), (), backend=backend)[0], \
        run_distributed(train_offloading, 1, str(tmp_path / "b"), flags, backend=backend)[0]
    _same_run(plain, off)
    forwards = ITERS * MICRO_BATCHES
    stats, expected = off["stats"], off["expected"]
    assert stats["activation_bytes"] == (forwards * expected["activation"] if "activation" in kinds else 0)
    assert stats["weight_bytes"] == (forwards * expected["weight"] if "weight" in kinds else 0)
    assert stats["activation_bytes"] + stats["weight_bytes"] > 0
    assert stats["reloaded"] == stats["tensors"], "an offloaded tensor never came back"


@pytest.mark.multiprocess
def test_offloading_is_exact_and_counted_on_cpu(tmp_path):
    _check("cpu", tmp_path, ("--cpu-offloading-num-layers", "2"), {"activation"})


@requires_sim()
@pytest.mark.multiprocess
def test_offloading_is_exact_and_counted_on_sim(tmp_path):
    _check("sim", tmp_path, ("--cpu-offloading", "--cpu-offloading-num-layers", "2", "--cpu-offloading-weights"),
           {"activation", "weight"})


@requires_sim()
@pytest.mark.multiprocess
def test_weights_only_on_sim(tmp_path):
    _check("sim", tmp_path, ("--cpu-offloading-num-layers", "1", "--no-cpu-offloading-activations",
                             "--cpu-offloading-weights"), {"weight"})


@pytest.mark.multiprocess
def test_fine_grained_offloading_of_chosen_modules_on_cpu(tmp_path):
    """Megatron's --fine-grained-activation-offloading --offload-modules: what the chosen submodules of every
    layer save (activations, no size floor) moves; same losses, bytes counted independently per module."""
    _check("cpu", tmp_path, ("--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "qkv_linear",
                             "attn_proj", "--min-offloaded-tensor-size", "0"), {"activation"})


def train_recording_buffers(root: str, extra: tuple) -> dict:
    """Worker: :func:`train_offloading`, and per step the host buffers the offloader allocated and the storages its
    offloaded copies went to (their addresses)."""
    from omnitron.core.training import loop
    from omnitron.core.transformer import offload

    steps, now = [], {"allocated": 0, "storages": set()}
    real_buffer, real_held, real_step = offload.host_buffer, offload._Held.__init__, loop._guarded_step

    def buffer(*args, **kwargs):
        now["allocated"] += 1
        return real_buffer(*args, **kwargs)

    def held(self, host, *args, **kwargs):
        now["storages"].add(host.untyped_storage().data_ptr())
        real_held(self, host, *args, **kwargs)

    def step(*args, **kwargs):
        values = real_step(*args, **kwargs)
        steps.append(dict(now))
        now.update(allocated=0, storages=set())
        return values

    offload.host_buffer, offload._Held.__init__, loop._guarded_step = buffer, held, step
    return {**train_offloading(root, extra), "steps": steps}


@pytest.mark.multiprocess
@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=requires_sim())])
def test_retained_host_buffers_are_reused_and_change_nothing(tmp_path, backend):
    """Megatron's --cpu-offloading-retain-pinned-cpu-buffers: the run is the plain offloading run bit for bit
    (losses, final weights, device bytes after each step, nothing offloaded alive after it), the first step allocates
    one micro-batch's host buffers (the second micro-batch reuses them: no pipelining, its forward comes after the
    first's backward), later steps none, copying into the same storages; without it every offload allocates."""
    flags = ("--cpu-offloading-num-layers", "2")
    plain = run_distributed(train_recording_buffers, 1, str(tmp_path / "a"), flags, backend=backend)[0]
    kept = run_distributed(train_recording_buffers, 1, str(tmp_path / "b"),
                           flags + ("--cpu-offloading-retain-pinned-cpu-buffers",), backend=backend)[0]
    _same_run(plain, kept)
    per_step = plain["stats"]["tensors"] // ITERS
    assert [s["allocated"] for s in plain["steps"]] == [per_step] * ITERS and plain["stats"]["reused"] == 0
    first, *later = kept["steps"]
    assert first["allocated"] == per_step // MICRO_BATCHES > 0
    assert all(s["allocated"] == 0 and s["storages"] == first["storages"] for s in later), kept["steps"]
    assert kept["stats"]["reused"] == kept["stats"]["tensors"] - first["allocated"]


def train_stats(root: str, extra: tuple) -> dict:
    """Train with ``extra`` flags; the losses and the offloader's counts (no recount: it reads parameter
    storages, which FSDP2's sharded DTensors do not have)."""
    import dataclasses

    import torch

    from omnitron.backends import get_backend
    from omnitron.core.parallel.data.wrapper import unwrap_model
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    res = train(parse_settings(_args(root, extra), torch.distributed.get_world_size()), get_backend())
    offloader = unwrap_model(res["components"].modules[0]).offloader
    return {"losses": res["losses"], "stats": dataclasses.asdict(offloader.stats) if offloader else None}


@pytest.mark.multiprocess
def test_offloading_under_fsdp2(tmp_path):
    """--use-torch-fsdp2 with --cpu-offloading: the offloader read the layer's parameter storages before the
    layer's forward, where FSDP2 holds sharded DTensors (no storage: every such run failed at its first forward,
    found by fuzzing the command line). Now: the FSDP2 losses bit for bit, and the same activation bytes as the
    same offloading without FSDP2 (the gathered parameters the forward saves are told apart as weights and stay)."""
    off = ("--cpu-offloading-num-layers", "2")
    fsdp = run_distributed(train_stats, 2, str(tmp_path / "a"), ("--use-torch-fsdp2",))
    fsdp_off = run_distributed(train_stats, 2, str(tmp_path / "b"), ("--use-torch-fsdp2",) + off)
    ddp_off = run_distributed(train_stats, 2, str(tmp_path / "c"), off)
    assert [r["losses"] for r in fsdp_off] == [r["losses"] for r in fsdp], "offloading changed the FSDP2 losses"
    for got, want in zip(fsdp_off, ddp_off):
        s = got["stats"]
        assert s["reloaded"] == s["tensors"] > 0 and s["weight_bytes"] == 0, s
        assert s["activation_bytes"] == want["stats"]["activation_bytes"], (s, want["stats"])


@pytest.mark.parametrize("flags, message", [
    (("--fine-grained-activation-offloading", "--offload-modules", "core_attn"), "core attention is a method"),
    (("--fine-grained-activation-offloading", "--offload-modules", "fused_group_mlp"), "op fuser"),
    (("--fine-grained-activation-offloading",), "needs --offload-modules"),
    (("--offload-modules", "attn_norm"), "needs --fine-grained-activation-offloading"),
    (("--fine-grained-activation-offloading", "--offload-modules", "attn_norm", "--cpu-offloading-num-layers", "1"),
     "cannot be combined"),
    (("--cpu-offloading",), "offload between 1 and"),
    (("--cpu-offloading-num-layers", str(LAYERS)), "offload between 1 and"),
    (("--cpu-offloading-num-layers", "1", "--no-cpu-offloading-activations"), "offloads nothing"),
    (("--cpu-offloading-retain-pinned-cpu-buffers",), "needs --cpu-offloading-num-layers"),
    (("--cpu-offloading-num-layers", "1", "--recompute-granularity", "full", "--recompute-method", "uniform"),
     "choose one"),
])
def test_refused_combinations(tmp_path, flags, message):
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match=message):
        parse_settings(_args(str(tmp_path), flags), 1)


def train_without_record_stream(root: str) -> dict:
    """Worker: offloading with ``record_stream`` planted out (a no-op)."""
    import torch

    torch.Tensor.record_stream = lambda self, stream: None
    return train_offloading(root, ("--cpu-offloading-num-layers", "2"))


@requires_sim()
@pytest.mark.multiprocess
@pytest.mark.planted
def test_sim_catches_a_missing_record_stream(tmp_path):
    """Without record_stream the copy stream's read of a freed activation block goes unnoticed on a GPU
    until the block is reused under it; sim's allocator names it at the first free."""
    with pytest.raises(RuntimeError, match="record_stream"):
        run_distributed(train_without_record_stream, 1, str(tmp_path), backend="sim")


PP_MICRO_BATCHES = 4


def _pp_args(layers: int, extra: tuple = ()) -> tuple:
    """pp2, 4 micro-batches of 2 (four in flight on the first stage), ``layers`` layers, dropout on."""
    return ("--num-layers", str(layers), "--pipeline-model-parallel-size", "2", "--global-batch-size",
            str(2 * PP_MICRO_BATCHES), *extra)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule, layers, extra", [
    ("1f1b", 4, ()), pytest.param("interleaved", 8, ("--num-layers-per-virtual-pipeline-stage", "2"),
                                  marks=pytest.mark.slow)])
def test_offloading_with_pipeline_parallelism(tmp_path, schedule, layers, extra):
    """Every pipeline chunk offloads its first layer: the losses are bit-identical to pp2 without offloading,
    every offloaded tensor of every in-flight micro-batch came back by the prefetch (as the next layer's
    backward started, before its own), and the host bytes are what one layer saves per forward (counted
    independently on the first stage, the layers being alike) x chunks x forwards."""
    base = _pp_args(layers, ("--pipeline-schedule", schedule) + extra)
    plain = run_distributed(train_offloading, 2, str(tmp_path / "a"), base)
    off = run_distributed(train_offloading, 2, str(tmp_path / "b"), base + ("--cpu-offloading-num-layers", "1"))
    for p, o in zip(plain, off):
        _same_run(p, o)
    stats = [s for r in off for s in (r["stats"] if isinstance(r["stats"], list) else [r["stats"]])]
    assert len(stats) == 2 * (2 if extra else 1)  # one offloader per chunk
    forwards = ITERS * PP_MICRO_BATCHES
    for s in stats:
        assert s["reloaded"] == s["tensors"] > 0 and s["reloaded_late"] == 0, s
        assert s["activation_bytes"] == forwards * off[0]["expected"]["activation"] and s["weight_bytes"] == 0
