"""Turn FP8 on for a model's linear layers, and carry its scaling state through checkpoints.

``enable_fp8(model, recipe, groups)`` walks the model (or its list of pipeline chunks) and sets
``module.fp8 = FP8Linear(...)`` on each selected linear: modules that expose the ``fp8`` seam
(column/row-parallel linears, the output layer) and plain ``nn.Linear`` (whose forward is routed
through the executor). The output layer stays wide unless selected by name, as in Megatron and
DeepSeek-V3. ``fp8_state_dict`` / ``load_fp8_state_dict`` save and restore the amax histories and
scales so a resumed run quantizes exactly as the uninterrupted one.
"""
from __future__ import annotations

import fnmatch
import logging
import re
import types
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8.config import FP8Config, check_backend
from omnitron.core.precision.fp8.linear import FP8Linear
from omnitron.core.precision.fp8.scaling import AmaxReducer
from omnitron.core.precision.fp8.torchao_impl import TorchaoLinear, check_layout

log = logging.getLogger("omnitron.fp8")

DEFAULT_EXCLUDE = ("*output_layer*", "*lm_head*")
"""Linears left wide unless ``modules`` names them explicitly."""
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _chunks(model_or_chunks) -> list[tuple[str, nn.Module]]:
    if isinstance(model_or_chunks, nn.Module):
        return [("", model_or_chunks)]
    chunks = list(model_or_chunks)
    return [(f"chunk{i}." if len(chunks) > 1 else "", c) for i, c in enumerate(chunks)]


def _is_linear(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    has_seam = "fp8" in vars(module) or hasattr(type(module), "fp8")
    return isinstance(w, torch.Tensor) and w.dim() == 2 and (has_seam or isinstance(module, nn.Linear))


def _fp8_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` routed through the executor (installed by :func:`enable_fp8`)."""
    if self.fp8 is None:
        return nn.functional.linear(x, self.weight, self.bias)
    return self.fp8(x, self.weight, self.bias)


def linear_modules(model_or_chunks) -> Iterable[tuple[str, nn.Module]]:
    """(qualified name, module) of every linear that can run in FP8, in model order."""
    for prefix, chunk in _chunks(model_or_chunks):
        for name, module in chunk.named_modules():
            if _is_linear(module):
                yield prefix + name, module


def _layer_numbers(model_or_chunks) -> dict[str, int]:
    """Transformer-layer path -> 1-based global layer number: the layer's ``layer_number`` attribute if
    it has one, else its index in the path (``...layers.<i>``, global in GPTModel at every layout).
    Multi-token prediction's depths (``mtp.layers.<i>``) are no decoder layers and have no number: Megatron
    passes them ``layer_no=-1``, which ``--first-last-layers-bf16`` never keeps wide, so they stay FP8."""
    out = {}
    for prefix, chunk in _chunks(model_or_chunks):
        for name, module in chunk.named_modules():
            if re.search(r"(?:^|\.)layers\.\d+$", name) and not re.search(r"(?:^|\.)mtp\.layers\.\d+$", name):
                num = getattr(module, "layer_number", None)
                out[prefix + name] = int(num) if num is not None else int(_LAYER_RE.search(name).group(1)) + 1
    return out


def _total_layers(model_or_chunks, groups, numbers: dict[str, int], num_layers: int | None) -> int:
    if num_layers is not None:
        return num_layers
    for _, chunk in _chunks(model_or_chunks):
        n = getattr(getattr(chunk, "config", None), "num_layers", None)
        if isinstance(n, int):
            return n
    if (groups is not None and groups.pp.size > 1) or len(_chunks(model_or_chunks)) > 1:
        raise ConfigError("--first-last-layers-bf16 with pipeline stages: the model has no config.num_layers; "
                          "pass num_layers= to enable_fp8")
    return max(numbers.values())


def _wide_layers(model_or_chunks, recipe: FP8Config, groups, num_layers: int | None) -> set[str]:
    """Paths of the transformer layers kept wide by ``--first-last-layers-bf16``."""
    numbers = _layer_numbers(model_or_chunks)
    if not numbers:
        raise ConfigError("--first-last-layers-bf16: found no transformer layers (modules named 'layers.<i>') "
                          "in the model; drop the flag or name the FP8 modules explicitly")
    total = _total_layers(model_or_chunks, groups, numbers, num_layers)
    lo, hi = recipe.num_layers_at_start_in_bf16, total - recipe.num_layers_at_end_in_bf16
    return {path for path, n in numbers.items() if n <= lo or n > hi}


def _selected(name: str, modules) -> bool:
    if modules is None:
        return not any(fnmatch.fnmatch(name, p) for p in DEFAULT_EXCLUDE)
    if callable(modules):
        return bool(modules(name))
    return any(fnmatch.fnmatch(name, p) for p in modules)


def amax_groups_for(recipe: FP8Config, groups) -> tuple:
    """Groups whose ranks share per-tensor scales: tensor x context parallel (whole tensors from shards),
    plus data parallel for ``delayed`` (identical recipe state on every replica). None for block-wise."""
    if groups is None or not recipe.per_tensor:
        return ()
    return (groups.tp_cp, groups.dp) if recipe.fp8_recipe == "delayed" else (groups.tp_cp,)


def amax_reduction_group(groups, collectives):
    """This rank's group over the tensor x context x data parallel ranks (Transformer Engine's amax reduction
    group; the world when pp = 1), made now: every rank of the world calls this together."""
    from omnitron.core.parallel.grid import dense_groups
    from omnitron.core.parallel.groups import Group

    mine, every = None, dense_groups(groups.config, groups.world_size, ("tp", "cp", "dp"))
    specs = [("amax", m) for m in every if len(m) > 1]
    made = iter(collectives.new_groups(specs) if specs else [])
    for members in every:
        handle = next(made) if len(members) > 1 else None
        if groups.rank in members:
            mine = Group("amax", tuple(members), handle, collectives if handle is not None else None)
    return mine


def tensorwise_role_groups(kind: str, groups) -> dict[str, tuple]:
    """Under ``tensorwise``, the groups each operand of a ``kind`` (``column`` / ``row``) tensor-parallel linear
    differs over -- the only ones its amax must be MAX-reduced over (a max over copies is the copy):

    * column: the input is whole over tp (copied or all-gathered before the GEMM): context parallel only; the
      weight and output gradient are tp shards (the weight is the same on every cp rank): tp, and tp x cp;
    * row: the input is a tp shard: tp x cp; the weight: tp; the output gradient is the gradient of the summed
      output, the same on every tp rank: cp only.
    """
    tp, cp, tp_cp = groups.tp, groups.cp, groups.tp_cp
    if kind == "column":
        return {"input": (cp,), "weight": (tp,), "grad_output": (tp_cp,)}
    return {"input": (tp_cp,), "weight": (tp,), "grad_output": (cp,)}


def _role_groups(module, recipe: FP8Config, groups) -> dict[str, tuple] | None:
    """:func:`tensorwise_role_groups` for a tensor-parallel linear over ``groups.tp`` under tensorwise, else None
    (every operand over the amax groups)."""
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

    if groups is None or recipe.fp8_recipe != "tensorwise" or getattr(module, "group", None) != groups.tp:
        return None  # NOTE: a one-rank "replicated" column layer (MLA) sees sequence shards: keep tp x cp
    if isinstance(module, ColumnParallelLinear):
        return tensorwise_role_groups("column", groups)
    return tensorwise_role_groups("row", groups) if isinstance(module, RowParallelLinear) else None


def _executor(recipe: FP8Config, provider, agroups, backend, name: str, reducer, role_groups):
    """The FP8 executor of one linear: omnitron's :class:`FP8Linear`, or torchao's (``--fp8-impl torchao``;
    emulated where the device has no FP8 GEMM)."""
    if recipe.fp8_impl == "torchao":
        return TorchaoLinear(recipe.fp8_format, backend.capabilities().fp8_gemm != "scaled_mm", name)
    return FP8Linear(recipe, provider, amax_groups=agroups, collectives=backend.collectives, name=name,
                     reducer=reducer, role_groups=role_groups)


def enable_fp8(model_or_chunks, recipe: FP8Config, groups, *, first_last_layers_bf16: bool | None = None,
               modules: Sequence[str] | Callable[[str], bool] | None = None, num_layers: int | None = None,
               backend=None, per_step: bool = False) -> dict[str, FP8Linear]:
    """Set ``.fp8`` on the selected linears; returns {module name: executor}.

    ``per_step`` (delayed recipe; collective over the world): one amax reduction per optimizer step over the
    amax reduction group, issued by :func:`fp8_step` at each step's end, which the caller must then call
    (:mod:`~omnitron.core.precision.fp8.scaling`); otherwise one batched reduction per micro-batch.

    ``modules``: fnmatch patterns (or a predicate) on module names choosing the FP8 linears; by
    default every linear except the output layer. ``first_last_layers_bf16`` (default: the recipe's
    flag) keeps the first/last transformer layers wide; ``num_layers`` is the model's total layer
    count, needed with pipeline stages when the layers do not say it. Errors name what is missing.
    """
    from omnitron.core.parallel.groups import resolve_backend

    backend = resolve_backend(backend, groups)
    check_backend(recipe, backend)
    if recipe.fp8_impl == "torchao":
        check_layout(groups)
    provider = backend.fp8
    keep_ends = recipe.first_last_layers_bf16 if first_last_layers_bf16 is None else first_last_layers_bf16
    wide = _wide_layers(model_or_chunks, recipe, groups, num_layers) if keep_ends else set()
    agroups = amax_groups_for(recipe, groups)
    reducer = None
    if recipe.fp8_recipe == "delayed":
        step_groups = (amax_reduction_group(groups,
                                            backend.collectives),) if per_step and groups is not None else agroups
        reducer = AmaxReducer(step_groups if per_step else agroups, backend.collectives, per_step=per_step)
    enabled: dict[str, FP8Linear] = {}
    skipped = []
    for name, module in linear_modules(model_or_chunks):
        if not _selected(name, modules) or any(name == w or name.startswith(w + ".") for w in wide):
            skipped.append(name)
            continue
        ex = _executor(recipe, provider, agroups, backend, name, reducer, _role_groups(module, recipe, groups))
        module.fp8 = ex
        if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:  # no seam of its own
            module.forward = types.MethodType(_fp8_linear_forward, module)
        enabled[name] = ex
    if not enabled and wide:  # e.g. --num-layers 2 with the default one layer kept wide at each end
        raise ConfigError(f"FP8 ({recipe.fp8_recipe}) selected no linear layer: --first-last-layers-bf16 keeps every "
                          f"layer wide ({', '.join(sorted(wide))}); lower --num-layers-at-start-in-bf16 / "
                          "--num-layers-at-end-in-bf16, add layers, or drop --first-last-layers-bf16")
    if not enabled:
        raise ConfigError(f"FP8 ({recipe.fp8_recipe}) selected no linear layer (modules={modules!r}); "
                          "check the module patterns")
    log.info("%s; recipe %s, format %s; %d linears in FP8, %d kept wide%s", provider.describe(), recipe.fp8_recipe,
             recipe.fp8_format, len(enabled), len(skipped), f" ({', '.join(skipped)})" if skipped else "")
    return enabled


def fp8_step(enabled: dict[str, FP8Linear]) -> None:
    """End of an optimizer step under ``enable_fp8(..., per_step=True)``: the one packed amax reduction and
    every history push (:meth:`~omnitron.core.precision.fp8.scaling.AmaxReducer.step`); nothing otherwise."""
    reducers = {id(ex.reducer): ex.reducer for ex in enabled.values() if ex.reducer is not None}
    for reducer in reducers.values():
        if reducer.per_step:
            reducer.step()


def disable_fp8(model_or_chunks) -> None:
    """Return every linear to its wide GEMM (``.fp8 = None``)."""
    for _, module in linear_modules(model_or_chunks):
        if isinstance(getattr(module, "fp8", None), (FP8Linear, TorchaoLinear)):
            module.fp8 = None


def fp8_state_dict(model_or_chunks) -> dict[str, dict]:
    """{module name: {role: {amax_history, scale}}} for every FP8 linear (CPU tensors)."""
    return {name: m.fp8.state_dict() for name, m in linear_modules(model_or_chunks)
            if isinstance(getattr(m, "fp8", None), FP8Linear)}


def load_fp8_state_dict(model_or_chunks, state: dict[str, dict]) -> None:
    """Restore :func:`fp8_state_dict` output; the FP8 module set must match (same flags, same layout)."""
    mine = {name: m.fp8 for name, m in linear_modules(model_or_chunks)
            if isinstance(getattr(m, "fp8", None), FP8Linear)}
    if set(mine) != set(state):
        missing, extra = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
        raise ConfigError(f"FP8 checkpoint state does not match the model's FP8 linears (missing {missing[:4]}, "
                          f"unexpected {extra[:4]}); resume with the same FP8 flags and parallel layout")
    for name, ex in mine.items():
        ex.load_state_dict(state[name])
