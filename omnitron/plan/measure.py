"""Measured activation bytes: what autograd actually keeps for backward during a forward.

The reference the memory model's activation term is checked against (tests/plan, BENCHMARKS.md).
``saved_tensors_hooks`` sees every tensor an autograd node saves; tensors are deduplicated by their
storage (a tensor saved by two nodes, or several views of one buffer, is held once) and parameters'
storages are left out (they are counted as parameters, not activations).
"""
from __future__ import annotations

import math
import threading
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F


@contextmanager
def one_thread():
    """Run the plan's probes on one intra-op thread: their ops are tiny, and on a loaded host the threads spin
    (an MoE probe ran 10x slower on the 2-core box at load 4.4, 2026-12-04); their bytes do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fused_dropout_device() -> bool:
    """Whether this process's backend runs torch's fused dropout kernel, which saves a one-byte boolean mask for
    backward (ATen's ``is_fused_kernel_acceptable``: every device type but the CPU, whose dropout saves a mask of the
    input's dtype: 4 bytes an element in fp32). The plan's probes run on the host, so they save the CPU's."""
    from omnitron.backends import get_backend

    return get_backend().device().type != "cpu"


_REAL = {"dropout": F.dropout, "scaled_dot_product_attention": F.scaled_dot_product_attention}


def _dropout(x, p=0.5, training=True, inplace=False):
    """``F.dropout`` as on an accelerator: ``torch.native_dropout``, which saves a boolean mask."""
    if not training or p == 0.0 or p == 1.0:
        return _REAL["dropout"](x, p, training, inplace)
    return torch.native_dropout(x, p, True)[0]


def _math_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as ATen's math path runs on a device with fused dropout: q and k scaled by the square root of the scale,
    the float mask added in place, ``_safe_softmax``, the fused dropout, ``@ v``, half and bfloat16 in float32 (what
    it saves: the scaled q and k, the probabilities before and after dropout, the boolean mask, v). sim's path; a GPU's
    fused attention kernel with dropout saves no probabilities (not modelled: issue 34's kernel tables)."""
    if dropout_p == 0.0:
        return _REAL["scaled_dot_product_attention"](q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                     scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    dtype = q.dtype  # ATen's math path computes half and bfloat16 inputs in float32
    q, k, v = (t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in (q, k, v))
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    attn = torch.matmul(q * root, k.transpose(-2, -1) * root)
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
            attn_mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(~keep, -math.inf)
        attn.add_(attn_mask)
    attn = torch.native_dropout(torch._safe_softmax(attn, -1), dropout_p, True)[0]
    return torch.matmul(attn, v).to(dtype)


@contextmanager
def _fused_dropout():
    """While active, ``F.dropout`` and ``F.scaled_dot_product_attention`` run as on a device with fused dropout
    (:func:`_dropout`, :func:`_math_sdpa`; the probes' bytes are used, not their numbers). The module's functions are
    replaced, not a torch-function mode's: a mode is off inside ``backward``, where checkpointed layers recompute."""
    before = F.dropout, F.scaled_dot_product_attention
    F.dropout, F.scaled_dot_product_attention = _dropout, _math_sdpa
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = before


_PROBING = threading.RLock()
"""Held by :func:`probing` for its whole body: the settings it changes are the process's (the thread count, the host
kernel table's pins, ``F.dropout``), each saved on entry and put back on exit, so two threads' probes interleaved
would put back each other's (the first out unpins the kernels the second still measures with; the last out leaves
its saved copy of the pins behind for good). Re-entrant: a probe may run another inside it on its own thread."""


@contextmanager
def probing():
    """A probe's context: one intra-op thread (:func:`one_thread`), the backend's kernels where the host has them
    (:func:`_backend_kernels`) and, where the backend's dropout is fused (:func:`fused_dropout_device`), dropout
    saving its boolean mask as there (measured 2026-12-06 on sim: the host's fp32 masks put a 4-layer h128 GPT-2's
    planned step peak 15% above the device's). One thread's probes at a time (:data:`_PROBING`): threads planning
    at once take turns."""
    with _PROBING, one_thread(), _backend_kernels(), \
            (_fused_dropout() if fused_dropout_device() else nullcontext()):
        yield


@contextmanager
def _backend_kernels():
    """While active, the host backend's kernel table (the probes' chunks are built on it) runs each fused op as this
    process's backend resolves it, where that implementation runs on the host (sim's reference SwiGLU, RMSNorm and
    rope, which save more for backward than the host's C++ kernels: a Llama-style layer's planned step peak 15-22%
    under sim's allocator before 2026-12-07); an implementation the host lacks (sim's flash attention) keeps the
    host's. Nothing changes where this process's backend is the host's."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import host_backend
    from omnitron.kernels.registry import implementations, ops

    run, host = get_backend(), host_backend()
    if run.device().type == "cpu":
        yield
        return
    table = host.kernels
    pins = {}
    for op in ops():
        name, impl = run.kernels.resolved(op), implementations(op).get(run.kernels.resolved(op))
        if name != table.resolved(op) and impl is not None and (impl.backends is None or "cpu" in impl.backends) \
                and impl.available()[0]:
            pins[op] = name
    before = table.pins, table._cache
    table.pins, table._cache = {**table.pins, **pins}, {}
    try:
        yield
    finally:
        table.pins, table._cache = before


class SavedBytes:
    """Bytes of the distinct storages saved for backward inside :meth:`record`."""

    def __init__(self, exclude=()) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.exclude:
                self.storages[ptr] = max(self.storages.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    @contextmanager
    def record(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def stage_microbatch_bytes(settings, cfg) -> dict[tuple[int, int], int]:
    """``{(pp_rank, chunk): saved bytes}`` of one micro-batch through every stage of a tensor-parallel size 1
    layout, run in this process stage after stage (real modules on the host; the loss on the last)."""
    from omnitron.core.checkpoint.reshard import Layout

    pc = settings.parallel
    if pc.tensor_model_parallel_size != 1 or pc.context_parallel_size != 1:
        raise ValueError("stage_microbatch_bytes runs tensor- and context-parallel size 1 layouts in one process")
    layout = Layout(pp=pc.pipeline_model_parallel_size, vp=pc.virtual_pipeline_model_parallel_size,
                    first=pc.decoder_first_pipeline_num_layers, last=pc.decoder_last_pipeline_num_layers,
                    embedding=pc.account_for_embedding_in_pipeline_split, loss=pc.account_for_loss_in_pipeline_split)
    return pipeline_bytes(cfg, layout, settings.training.micro_batch_size)


def pipeline_bytes(cfg, layout, b: int) -> dict[tuple[int, int], int]:
    """Saved bytes of every stage chunk of ``layout`` (tp 1) for one micro-batch of ``b`` samples, dropout's masks
    as the backend's (:func:`probing`: the plan's probes', checked against the device in tests/sim)."""
    with probing():
        return _pipeline_bytes(cfg, layout, b)


def _pipeline_bytes(cfg, layout, b: int) -> dict[tuple[int, int], int]:
    from omnitron.core.checkpoint.reshard import skeleton_chunks

    torch.manual_seed(0)
    chunks = skeleton_chunks(cfg, layout)
    pp, s = layout.pp, cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (b, s))
    out, hidden = {}, None
    for key in sorted(chunks, key=lambda k: k[1] * pp + k[0]):  # virtual stage order
        m = chunks[key].train()
        last = key == (pp - 1, layout.chunks - 1)
        rec = SavedBytes(m.parameters())
        with rec.record():
            y = m(tokens=tokens, position_ids=torch.arange(s).expand(b, s), hidden=hidden,
                  labels=tokens if last else None)
        out[key] = rec.total
        hidden = y.detach().requires_grad_()
    return out


def train_step_peak(argv: list[str], world: int, root: str, prepare=None) -> tuple[int, int]:
    """(this rank's pipeline stage, peak bytes of every storage created during one training step): the run
    of ``argv`` built in this process (one rank of a ``world``-rank job), one warm step first (``prepare``:
    called with the built components before it, e.g. a test's routing). Parameters,
    gradient buffers and optimizer state exist before and count 0, so the peak is what the step adds:
    activations, backward's transients, received pipeline tensors and collective buffers (``PeakTracker``:
    the real run at its real size, where the plan replays small probes' logs scaled)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import train_step
    from omnitron.kernels.benchmark import PeakTracker

    s = parse_settings(argv + ["--num-workers", "0", "--train-iters", "3", "--no-tensorboard", "--data-cache-path",
                               root], world)
    c = build_components(s, get_backend())
    if prepare is not None:
        prepare(c)
    it = data_iterator(c, c.train_data, 0)
    train_step(c, it)
    tracker = PeakTracker()
    with tracker:
        train_step(c, it)
    return (c.groups.pp.rank if world > 1 else 0), tracker.peak
