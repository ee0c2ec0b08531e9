"""Measured activation bytes: what autograd actually keeps for backward during a forward.

The reference the memory model's activation term is checked against (tests/plan, BENCHMARKS.md).
``saved_tensors_hooks`` sees every tensor an autograd node saves; tensors are deduplicated by their
storage (a tensor saved by two nodes, or several views of one buffer, is held once) and parameters'
storages are left out (they are counted as parameters, not activations).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


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
    """Saved bytes of every stage chunk of ``layout`` (tp 1) for one micro-batch of ``b`` samples."""
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
