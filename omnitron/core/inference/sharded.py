"""Generation under tensor x pipeline parallelism: a model too big for one device is sampled where it trains.

Launched like training (``--nproc-per-node`` or torchrun, world = tp x pp). Every rank builds its pipeline
stage at the requested tensor-parallel size (sequence parallelism off: a decoding step holds one position)
and reads its own parameters from the checkpoint, whatever layout wrote it (the reshard reader keeps only the
tensors the stage owns). The KV cache is each rank's own attention's: sharded by heads over tp, by layers over
pp.

One decoding step: the first stage embeds the new tokens; each stage receives the previous stage's hidden
states, runs its layers and sends them on (a chain of blocking point-to-point messages, in the same order on
every rank: safe under NCCL's in-order semantics); the last stage gathers the vocabulary-parallel logits over
tp and picks the next tokens (:class:`ShardedPicker`), which it broadcasts over the pipeline group with their
log-probs, so every rank appends the same tokens and stops at the same step. Every rank knows the prompts,
hence every message's shape. Sampling is seeded per row as in one process, so greedy and seeded sampling give
the one-process tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnitron.core.config.training import TrainingConfig
from omnitron.core.inference.generation import Picker
from omnitron.core.parallel.tensor.mappings import gather_last


class ShardedStage:
    """This rank's stage of a tp x pp model and how it talks to its neighbours during generation."""

    def __init__(self, model, groups, collectives) -> None:
        self.model, self.groups, self.coll = model, groups, collectives
        self.pp, self.tp = groups.pp, groups.tp

    @property
    def is_last(self) -> bool:
        return self.pp.size == 1 or self.pp.is_last

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor | None:
        """One step over ``ids [b, s]``: full-vocabulary logits ``[s, b, V_pad]`` on the last stage, else None."""
        m, pp = self.model, self.pp
        if pp.size > 1 and not pp.is_first:
            hidden = torch.empty(ids.shape[1], ids.shape[0], m.config.hidden_size, dtype=m.config.params_dtype,
                                 device=ids.device)
            self.coll.recv(hidden, src=pp.global_rank(pp.rank - 1), group=pp.handle)
            out = m(hidden=hidden, position_ids=pos)
        else:
            out = m(tokens=ids, position_ids=pos)
        if not self.is_last:
            self.coll.send(out.contiguous(), dst=pp.global_rank(pp.rank + 1), group=pp.handle)
            return None
        return gather_last(out, self.tp) if self.tp.size > 1 else out

    def picker(self) -> "ShardedPicker":
        return ShardedPicker(self)

    def generate_kwargs(self) -> dict:
        """What :func:`~omnitron.core.inference.generation.generate_batch` takes to run on this stage."""
        return {"forward": self.forward, "picker": self.picker()}


class ShardedPicker(Picker):
    """Picks on the last stage (its tp ranks agree: the same gathered logits and seeds) and broadcasts the
    choice over the pipeline group, float64 (token ids are exact below 2**53)."""

    def __init__(self, stage: ShardedStage) -> None:
        self.stage = stage

    def _share(self, values: torch.Tensor) -> torch.Tensor:
        pp = self.stage.pp
        if pp.size > 1:
            self.stage.coll.broadcast(values, src=pp.global_rank(pp.size - 1), group=pp.handle)
        return values

    def prompt_log_probs(self, logits, ids, valid):
        picked = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.float64, device=ids.device)
        if self.stage.is_last:
            picked.copy_(self.prompt_picked(logits, ids))
        return self.kept(self._share(picked), ids, valid)

    def next_tokens(self, logits, params, gens, want_lp, rows):
        if not params.greedy and params.seed is None:
            raise ValueError("sharded sampling needs a seed (every tensor-parallel rank of the last stage must draw "
                             "the same tokens): give --seed / random_seed, or sample greedily")
        device = next(self.stage.model.parameters()).device
        buf = torch.zeros(rows, 2, dtype=torch.float64, device=device)
        if self.stage.is_last:
            nxt, lp = super().next_tokens(logits, params, gens, want_lp, rows)
            buf[:, 0] = nxt.to(torch.float64)
            if lp is not None:
                buf[:, 1] = torch.tensor(lp, dtype=torch.float64)
        self._share(buf)
        return buf[:, 0].to(torch.long), (buf[:, 1].tolist() if want_lp else None)


def build_stage(cfg, groups, backend, *, on_device: bool = True):
    """This rank's stage of ``cfg`` (a GPT-family model) over ``groups``, in fp32, weights uninitialised-safe;
    on the backend's device, or (not ``on_device``) where it was built (meta parameters stay meta)."""
    from omnitron.core.training.components import build_model_chunks

    chunks = build_model_chunks(cfg, groups, seed=0, backend=backend, on_device=on_device)
    if len(chunks) != 1:
        raise ValueError("sharded generation runs one stage per rank (no virtual pipeline stages)")
    return chunks[0]


@dataclass
class ShardedJob:
    """What a tp x pp inference command hands every rank: the checkpoint, the layout, and the launcher's
    settings (backend, threads, world and the distributed timeout, as training's)."""

    load: str
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    backend: str | None = None
    threads: int | None = None
    nproc_per_node: int = 1
    world_size: int = 1
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Only its ``distributed_timeout_minutes`` is read (the launcher's and the process group's timeout)."""

    def parallel_config(self):
        from omnitron.core.config.parallel import ParallelConfig

        return ParallelConfig(tensor_model_parallel_size=self.tensor_model_parallel_size,
                              pipeline_model_parallel_size=self.pipeline_model_parallel_size)

    def load_stage(self, backend):
        """(groups, this rank's loaded stage) of the job's layout over the initialised world."""
        from omnitron.core.inference.loader import load_sharded
        from omnitron.core.parallel.groups import ParallelGroups

        groups = ParallelGroups.build(self.parallel_config(), backend=backend)
        if groups.dp_size != 1:
            raise ValueError(f"sharded inference runs on tensor x pipeline = {self.world_size // groups.dp_size} "
                             f"processes, got {self.world_size}; set --nproc-per-node to that product")
        return groups, load_sharded(self.load, groups, backend)


@dataclass
class GenerateJob(ShardedJob):
    """``omnitron generate`` under tp x pp."""

    prompts: list[str] = field(default_factory=list)
    max_new_tokens: int = 40
    sampling: dict = field(default_factory=dict)
    """:class:`~omnitron.core.inference.sampling.SamplingParams` fields (``seed`` None: the checkpoint's)."""
    return_log_probs: bool = False
    json: bool = False


def run_generate_job(job: GenerateJob, backend, watchdog=None) -> None:
    """One rank of a sharded ``omnitron generate``: load this rank's stage, generate, rank 0 prints."""
    from omnitron.core.inference.sampling import SamplingParams
    from omnitron.core.inference.text import complete, print_result

    groups, loaded = job.load_stage(backend)
    sampling = dict(job.sampling)
    sampling["seed"] = loaded.seed if sampling.get("seed") is None else sampling["seed"]
    out = complete(loaded, job.prompts, job.max_new_tokens, params=SamplingParams(**sampling),
                   logprobs=job.return_log_probs)
    if groups.rank == 0:
        print_result(out, job.json, job.return_log_probs, None)
