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

Expert parallelism (``--expert-model-parallel-size``, MoE checkpoints): world = tp x ep x pp. As in training, the
expert layout (etp = tp) x ep re-partitions tp x dp: the ep ranks are ``dp = ep`` replicas of the dense layers,
each holding ``E / ep`` experts of every MoE layer. Every replica runs the same prompts; in an MoE layer each
takes its slice of the (replicated) tokens, dispatches it to the experts' ranks over ep (training's all-to-all)
and all-gathers the outputs (:attr:`~omnitron.core.transformer.moe.layer.MoELayer.ep_replicated`), so the
replicas stay bit-identical and pick the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omnitron.core.config.parallel import ParallelConfig
from omnitron.core.config.training import TrainingConfig
from omnitron.core.inference.loader import SERVING_DTYPES, load_sharded
from omnitron.core.inference.sampling import SamplingParams
from omnitron.core.inference.stage import (  # noqa: F401 - re-exported: callers import them from here
    ShardedPicker, ShardedStage, build_stage)
from omnitron.core.parallel.groups import ParallelGroups


@dataclass
class ShardedJob:
    """What a tp x pp inference command hands every rank: the checkpoint, the layout, and the launcher's
    settings (backend, threads, world and the distributed timeout, as training's)."""

    load: str
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    backend: str | None = None
    threads: int | None = None
    nproc_per_node: int = 1
    world_size: int = 1
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Only its ``distributed_timeout_minutes`` is read (the launcher's and the process group's timeout)."""
    serving_dtype: str = "fp32"
    """Weights, activations and KV cache: ``fp32``, ``bf16`` (``--bf16``) or ``fp16`` (``--fp16``)."""

    def parallel_config(self):
        return ParallelConfig(tensor_model_parallel_size=self.tensor_model_parallel_size,
                              pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                              expert_model_parallel_size=self.expert_model_parallel_size)

    def load_stage(self, backend):
        """(groups, this rank's loaded stage) of the job's layout over the initialised world."""
        import torch.distributed as dist

        pc = self.parallel_config()
        world, actual = serving_world(pc), dist.get_world_size() if dist.is_initialized() else 1
        if actual != world:  # before any group: a wrong count would fail in the layout's own check
            raise ValueError(f"sharded inference runs on {describe_serving(pc)} = {world} processes, got {actual}; "
                             f"set --nproc-per-node {world}")
        groups = ParallelGroups.build(pc, backend=backend)
        return groups, load_sharded(self.load, groups, backend, SERVING_DTYPES[self.serving_dtype])


def serving_world(parallel: ParallelConfig) -> int:
    """Processes of a sharded inference job: tp x ep x pp (the ep ranks are data-parallel replicas of the dense
    layers, see the module docstring)."""
    return (parallel.tensor_model_parallel_size * parallel.expert_model_parallel_size
            * parallel.pipeline_model_parallel_size)


def describe_serving(parallel: ParallelConfig) -> str:
    """``tensor x pipeline = 2 x 1`` (with ``x expert`` where ep > 1): the layout, for messages."""
    names, sizes = ["tensor", "pipeline"], [parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size]
    if parallel.expert_model_parallel_size > 1:
        names.append("expert")
        sizes.append(parallel.expert_model_parallel_size)
    return f"{' x '.join(names)} = {' x '.join(map(str, sizes))}"


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
    from omnitron.core.inference.text import complete, print_result

    groups, loaded = job.load_stage(backend)
    sampling = dict(job.sampling)
    sampling["seed"] = loaded.seed if sampling.get("seed") is None else sampling["seed"]
    out = complete(loaded, job.prompts, job.max_new_tokens, params=SamplingParams(**sampling),
                   logprobs=job.return_log_probs)
    if groups.rank == 0:
        print_result(out, job.json, job.return_log_probs, None)
