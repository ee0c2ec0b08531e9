"""How a tensor-parallel parameter maps to its full, layout-independent tensor.

Every parameter carries attributes that say how it is cut:

* ``tensor_model_parallel`` (bool): split over tp (False: replicated on every tp rank);
* ``partition_dim`` (int, -1 when replicated) and ``partition_stride`` (int): the full tensor is
  ``stride`` equal blocks along ``partition_dim`` and each block is split contiguously over tp
  (stride 2 for SwiGLU's ``[gate; up]`` so each rank holds matching gate and up rows);
* ``valid_rows`` (int | None): rows of the full tensor that are real (vocabulary); the rest is
  padding, dropped by :func:`gather_param` and zero-filled by :func:`shard_param`;
* ``sequence_parallel`` (bool): the gradient is a partial sum over tp ranks (norm weights and
  biases applied to sequence shards, QK-norm weights shared by heads on different ranks) and
  must be all-reduced over ``groups.tp`` before the optimizer step;
* ``init`` (tuple): ``("normal", std)``, ``("uniform", bound)`` (on ``[-bound, bound]``: torch's default for a
  convolution or linear, as Megatron's ViT patch convolution keeps it), ``("zeros",)`` or ``("ones",)`` for the
  full tensor;
  ``init_name`` (str, optional): draw the init under this name instead of the parameter's own
  (the last stage's copy of a tied embedding).
"""
from __future__ import annotations

import hashlib

import torch

from omnitron.core.parallel.tensor.mappings import gather_first


def set_attributes(p: torch.nn.Parameter, *, parallel: bool, dim: int = -1, stride: int = 1,
                   init: tuple = ("zeros",), valid_rows: int | None = None) -> torch.nn.Parameter:
    """Attach the sharding and init attributes described in the module docstring."""
    p.tensor_model_parallel = parallel
    p.partition_dim = dim if parallel else -1
    p.partition_stride = stride
    p.init = init
    p.valid_rows = valid_rows
    p.sequence_parallel = False
    return p


def to_device(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module.to(device)`` keeping every Parameter object: its identity (ties such as the shared
    embedding) and its attributes (the ones above). Plain ``Module.to`` replaces each parameter by a
    new one, attributes lost and ties broken, when the tensor types are not shallow-copy compatible:
    host to any out-of-tree (PrivateUse1) device, e.g. ``musa`` or ``sim``."""
    params = list(module.parameters())
    if all(p.device == torch.device(device) for p in params):
        return module.to(device)  # buffers only (a no-op for parameters)
    attrs = {id(p): dict(vars(p)) for p in params}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # moves each Parameter in place
    try:
        module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    for p in module.parameters():
        vars(p).update(attrs[id(p)])  # swap_tensors swaps __dict__ too: put the attributes back
    return module


def full_shape(p: torch.Tensor, tp: int) -> tuple[int, ...]:
    """Shape of the full (padded) tensor behind local shard ``p``."""
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition_dim] *= tp
    return tuple(shape)


def shard_param(full: torch.Tensor, p: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This rank's slice of ``full`` (unpadded rows are zero-padded to the local layout first)."""
    shape = full_shape(p, tp)
    if full.shape[0] < shape[0] and getattr(p, "valid_rows", None) is not None:
        pad = torch.zeros((shape[0] - full.shape[0],) + tuple(full.shape[1:]), dtype=full.dtype)
        full = torch.cat([full, pad.to(full.device)], dim=0)
    if tuple(full.shape) != shape:
        raise ValueError(f"full tensor shape {tuple(full.shape)} does not match parameter's full shape {shape}")
    if not getattr(p, "tensor_model_parallel", False) or tp == 1:
        return full
    dim, stride = p.partition_dim, p.partition_stride
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).contiguous()


def gather_param(t: torch.Tensor, p: torch.Tensor, group) -> torch.Tensor:
    """The full tensor from every rank's shard ``t`` of parameter ``p`` (padding rows removed)."""
    if getattr(p, "tensor_model_parallel", False) and group.size > 1:
        dim = p.partition_dim
        pieces = gather_first(t.movedim(dim, 0).contiguous(), group).chunk(group.size, dim=0)  # per rank
        return merge_shards([pc.movedim(0, dim) for pc in pieces], p)
    return merge_shards([t], p)


def merge_shards(shards: list[torch.Tensor], p: torch.Tensor) -> torch.Tensor:
    """The full tensor (padding rows removed) from the shards of parameter ``p`` held by tp ranks
    ``0..len(shards)-1``, in rank order; no communication (offline checkpoint resharding)."""
    full = shards[0]
    if getattr(p, "tensor_model_parallel", False) and len(shards) > 1:
        dim, stride, tp = p.partition_dim, p.partition_stride, len(shards)
        per_rank = [s.chunk(stride, dim=dim) for s in shards]
        full = torch.cat([per_rank[r][i] for i in range(stride) for r in range(tp)], dim=dim)
    rows = getattr(p, "valid_rows", None)
    return full[:rows] if rows is not None else full


def init_full(name: str, shape: tuple[int, ...], init: tuple, seed: int,
              valid_rows: int | None = None) -> torch.Tensor:
    """The full fp32 CPU tensor for parameter ``name``: a function of (seed, name, shape) only, so
    every parallel layout draws the same weights. Padding rows past ``valid_rows`` are zero."""
    kind = init[0]
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind not in ("normal", "uniform"):
        raise ValueError(f"unknown init {init!r} for {name}")
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    rows = valid_rows if valid_rows is not None else shape[0]
    size = (rows,) + tuple(shape[1:])
    real = (torch.randn(size, generator=gen) if kind == "normal" else torch.rand(size, generator=gen) * 2 - 1) * init[1]
    if rows == shape[0]:
        return real
    return torch.cat([real, torch.zeros((shape[0] - rows,) + tuple(shape[1:]))], dim=0)
