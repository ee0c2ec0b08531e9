"""Parallel layout configuration (Megatron flag names in the docstrings)."""
from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A setting is invalid; the message names the flag and how to fix it."""


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")
"""The --cp-comm-type values (Megatron's)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How the world is cut. The data-parallel size is what remains: world / (tp * cp * pp)."""

    tensor_model_parallel_size: int = 1
    """--tensor-model-parallel-size: ranks that split each layer's matrices."""
    pipeline_model_parallel_size: int = 1
    """--pipeline-model-parallel-size: ranks that split the layer stack into stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved schedule); from --num-layers-per-virtual-pipeline-stage or
    --num-virtual-stages-per-pipeline-rank."""
    microbatch_group_size_per_vp_stage: int | None = None
    """--microbatch-group-size-per-virtual-pipeline-stage N: the interleaved schedule runs every model chunk over N
    micro-batches before the next N (default: pp); N between pp and the micro-batch count, and the count's
    remainder mod N 0 or >= pp (Megatron's rules). More than pp warms up (vp - 1) (N - pp) more forwards per rank."""
    context_parallel_size: int = 1
    """--context-parallel-size: ranks that split the sequence inside attention."""
    expert_model_parallel_size: int = 1
    """--expert-model-parallel-size: ranks that split the experts of an MoE layer."""
    expert_tensor_parallel_size: int | None = None
    """--expert-tensor-parallel-size: tensor parallelism inside each expert (default: tp)."""
    overlap_moe_expert_parallel_comm: bool = False
    """--overlap-moe-expert-parallel-comm: Megatron's combined 1F1B: in the steady state of the none, 1f1b,
    interleaved or dualpipe-v schedule one micro-batch's forward and another's backward run in turns, so each one's MoE
    dispatch / combine all-to-all (forward or backward) is in flight while the other computes (one more warm-up
    forward per rank, pp - r more in 1F1B; see pipeline/combined.py)."""
    cp_comm_type: list[str] | str = "p2p"
    """--cp-comm-type {p2p,a2a,allgather,a2a+p2p}: how context parallelism shares the sequence in attention: p2p,
    the ring of K/V blocks; a2a, all-to-all of heads and sequence (DeepSpeed-Ulysses; the local heads must divide
    by cp); allgather, all-gathered K/V; a2a+p2p, all-to-all inside groups of consecutive cp ranks, then the ring
    across them (sizes from --hierarchical-context-parallel-sizes). One type for every layer, or one per layer
    (``--cp-comm-type p2p a2a ...``, --num-layers of them, as Megatron: layer i's attention uses the i-th; a
    multi-token-prediction depth k the k-th, as Megatron numbers its layers)."""
    hierarchical_context_parallel_sizes: list[int] | None = None
    """--hierarchical-context-parallel-sizes A P: the a2a and p2p sizes of --cp-comm-type a2a+p2p (A x P =
    --context-parallel-size; A consecutive cp ranks trade heads for sequence, the ring runs over P of those groups)."""
    sequence_parallel: bool = False
    """--sequence-parallel: norms/dropout on sequence shards inside the tensor-parallel group."""
    decoder_first_pipeline_num_layers: int | None = None
    """--decoder-first-pipeline-num-layers: layers on the first pipeline stage (it also holds the
    embedding); the remaining layers split evenly over the other stages."""
    decoder_last_pipeline_num_layers: int | None = None
    """--decoder-last-pipeline-num-layers: layers on the last pipeline stage (it also holds the
    output layer and the loss); the remaining layers split evenly over the other stages."""
    account_for_embedding_in_pipeline_split: bool = False
    """--account-for-embedding-in-pipeline-split: count the embedding as one layer when splitting the layers over
    the (virtual) pipeline stages, so the first stage builds one layer fewer (Llama 3 405B's 126 layers at pp16:
    128 slots); not with --decoder-first/last-pipeline-num-layers."""
    account_for_loss_in_pipeline_split: bool = False
    """--account-for-loss-in-pipeline-split: count the output layer and loss as one layer when splitting the
    layers over the (virtual) pipeline stages, so the last stage builds one layer fewer."""

    def __post_init__(self) -> None:
        for flag, value in (("--tensor-model-parallel-size", self.tensor_model_parallel_size),
                            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
                            ("--context-parallel-size", self.context_parallel_size),
                            ("--expert-model-parallel-size", self.expert_model_parallel_size)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        group = self.microbatch_group_size_per_vp_stage
        if group is not None and (not isinstance(group, int) or group < 1):
            raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage must be a positive integer, "
                              f"got {group!r}")
        self._check_cp_comm_type()
        self._check_hierarchical()
        vp = self.virtual_pipeline_model_parallel_size
        if vp is not None and (vp < 1 or (vp > 1 and self.pipeline_model_parallel_size < 2)):
            raise ConfigError(f"virtual pipeline size {vp} needs --pipeline-model-parallel-size >= 2 "
                              f"(got {self.pipeline_model_parallel_size}); drop --num-layers-per-virtual-pipeline-"
                              f"stage / --num-virtual-stages-per-pipeline-rank")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            # harmless but meaningless; Megatron silently disables it, we keep it off explicitly
            self.sequence_parallel = False

    def _check_cp_comm_type(self) -> None:
        """Each type is known; one type (a list of one, as from the command line) is kept as a string, several as a
        list (their number is checked against --num-layers with the model)."""
        types = [self.cp_comm_type] if isinstance(self.cp_comm_type, str) else list(self.cp_comm_type or [])
        bad = [t for t in types if t not in CP_COMM_TYPES]
        if not types or bad:
            raise ConfigError(f"--cp-comm-type {' '.join(map(str, bad or types))!r} is not one of "
                              f"{', '.join(CP_COMM_TYPES)} (one type for every layer, or one per layer)")
        self.cp_comm_type = types[0] if len(types) == 1 else types

    def cp_comm_types(self) -> tuple[str, ...]:
        """The distinct --cp-comm-type values in use (one, or those of the per-layer list)."""
        comm = self.cp_comm_type
        return (comm,) if isinstance(comm, str) else tuple(dict.fromkeys(comm))

    def layer_cp_comm_type(self, layer: int) -> str:
        """--cp-comm-type of the 0-based global transformer layer ``layer`` (Megatron's ``cp_comm_type[n - 1]``)."""
        comm = self.cp_comm_type
        return comm if isinstance(comm, str) else comm[layer]

    def _check_hierarchical(self) -> None:
        """--cp-comm-type a2a+p2p needs exactly two positive sizes whose product is cp (and nothing else takes them)."""
        sizes, cp = self.hierarchical_context_parallel_sizes, self.context_parallel_size
        if "a2a+p2p" not in self.cp_comm_types():
            if sizes:
                raise ConfigError(f"--hierarchical-context-parallel-sizes only applies to --cp-comm-type a2a+p2p "
                                  f"(got --cp-comm-type {' '.join(self.cp_comm_types())}); drop it or use a2a+p2p")
            return
        if not sizes:
            raise ConfigError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the a2a and "
                              f"p2p sizes, A x P = --context-parallel-size {cp})")
        if len(sizes) != 2:
            raise ConfigError(f"--hierarchical-context-parallel-sizes takes two sizes (a2a, p2p), got {len(sizes)}: "
                              f"{' '.join(map(str, sizes))}")
        try:  # from the command line the values are strings
            sizes = [int(n) for n in sizes]
        except (TypeError, ValueError):
            sizes = []
        if len(sizes) != 2 or min(sizes) < 1:
            raise ConfigError(f"--hierarchical-context-parallel-sizes must be positive integers, got "
                              f"{' '.join(map(str, self.hierarchical_context_parallel_sizes))}")
        if sizes[0] * sizes[1] != cp:
            raise ConfigError(f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}: a2a size x p2p size = "
                              f"{sizes[0] * sizes[1]} is not --context-parallel-size {cp}")
        self.hierarchical_context_parallel_sizes = sizes

    @property
    def cp_a2a_p2p_sizes(self) -> tuple[int, int] | None:
        """(A, P) of --cp-comm-type a2a+p2p, else None."""
        sizes = self.hierarchical_context_parallel_sizes
        return (sizes[0], sizes[1]) if "a2a+p2p" in self.cp_comm_types() and sizes else None

    @property
    def uneven_pipeline(self) -> bool:
        """True when the stages are not an even split of --num-layers: the first or last stage holds a set number
        of layers, or the embedding / the loss count as a layer."""
        return (self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
                or self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split)

    @property
    def model_parallel_size(self) -> int:
        """tp * cp * pp: ranks holding one replica of the model."""
        return self.tensor_model_parallel_size * self.context_parallel_size * self.pipeline_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


def data_parallel_size(cfg: ParallelConfig, world_size: int) -> int:
    """world / (tp * cp * pp), with an error naming the numbers when it does not divide."""
    mp = cfg.model_parallel_size
    if world_size % mp:
        raise ConfigError(
            f"world size {world_size} is not a multiple of tensor ({cfg.tensor_model_parallel_size}) x context "
            f"({cfg.context_parallel_size}) x pipeline ({cfg.pipeline_model_parallel_size}) = {mp}; change "
            "--tensor-model-parallel-size/--pipeline-model-parallel-size/--context-parallel-size or the number of "
            "processes")
    dp = world_size // mp
    inner = cfg.tensor_model_parallel_size * cfg.context_parallel_size * dp
    outer = cfg.etp * cfg.expert_model_parallel_size
    if inner % outer:
        raise ConfigError(
            f"expert layout etp ({cfg.etp}) x ep ({cfg.expert_model_parallel_size}) = {outer} must divide "
            f"tp x cp x dp = {inner}; change --expert-model-parallel-size or --expert-tensor-parallel-size")
    return dp
