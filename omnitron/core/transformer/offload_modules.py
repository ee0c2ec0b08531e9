"""Megatron's fine-grained activation offloading (``--fine-grained-activation-offloading --offload-modules ...``)
on the layer-level offloader (``offload.py``): the chosen submodules of every layer offload what they save for
backward.

Megatron offloads each chosen module's *input*; here the module's forward runs under the offloader's saved-tensor
hooks, so what moves is what that module saves for its backward (for a linear layer, its input; for a norm, its
input and the statistics), tensors of at least ``--min-offloaded-tensor-size`` elements, activations only.
The tensors come back when the backward reaches the enclosing layer's output (a hook on its gradient), one layer
later than the layer-level offloader's prefetch. Modules mapped: ``attn_norm`` (the input norm), ``qkv_linear``
(the fused QKV projection, or the separate Q and KV projections), ``attn_proj`` (the output projection),
``mlp_norm`` (the pre-MLP norm). The others of Megatron's list are refused (:data:`REFUSED`), with the reason.
"""
from __future__ import annotations

import torch

from omnitron.core.transformer.offload import ActivationOffloader

MODULES = {
    "attn_norm": ("input_layernorm",),
    "qkv_linear": ("self_attention.linear_qkv", "self_attention.linear_q", "self_attention.linear_kv"),
    "attn_proj": ("self_attention.linear_proj",),
    "mlp_norm": ("pre_mlp_layernorm",),
}
"""Megatron's ``--offload-modules`` names -> the submodules of a layer they select (those present)."""

REFUSED = {
    "core_attn": "core attention is a method of the attention module here, not a module the offloader can scope "
                 "(its saved q, k, v and output move with --cpu-offloading-num-layers)",
    "expert_fc1": "the experts' first projection runs inside the grouped expert GEMM, not as a module of its own",
    "moe_act": "the experts' activation runs inside the grouped expert GEMM, not as a module of its own",
    "fused_group_mlp": "needs Transformer Engine's op fuser (--use-transformer-engine-op-fuser), which omnitron "
                       "does not have",
    "gdp_qkv": "omnitron has no GatedDeltaProduct mixer",
}
"""Megatron's other names, and why each is not offered."""


def _submodules(layer: torch.nn.Module, name: str) -> list[torch.nn.Module]:
    found = dict(layer.named_modules())
    return [found[path] for path in MODULES[name] if path in found]


class ModuleOffloader(ActivationOffloader):
    """The offloader scoped to submodules: :meth:`attach` hooks the chosen ones of each layer."""

    def __init__(self, backend, *, min_numel: int) -> None:
        super().__init__(backend, activations=True, weights=False)
        self.min_numel = min_numel
        self.enabled = True  # False: the hooks let every module run as without offloading
        self._open: list = []  # (saved-tensor hooks context or None, group) of the modules now running
        self._done: list = []  # groups of the current layer's finished modules

    def attach(self, layers, names: list[str]) -> None:
        """Hook every chosen submodule of every layer; raise naming a module none of the layers has."""
        for name in names:
            if not any(_submodules(layer, name) for layer in layers) and len(layers):
                raise ValueError(f"--offload-modules {name}: this model's layers have no {' or '.join(MODULES[name])}"
                                 f" (e.g. --multi-latent-attention's projections); drop it")
        for layer in layers:
            for sub in (s for name in names for s in _submodules(layer, name)):
                sub.register_forward_pre_hook(self._enter)
                sub.register_forward_hook(self._exit)
            layer.register_forward_hook(self._layer_done)

    def _enter(self, module, args) -> None:
        if not (self.enabled and module.training and torch.is_grad_enabled()):
            self._open.append((None, None))
            return
        ctx = self.layer(module)
        self._open.append((ctx, ctx.__enter__()))

    def _exit(self, module, args, output) -> None:
        ctx, group = self._open.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
            self._done.append(group)

    def _layer_done(self, layer, args, output) -> None:
        groups, self._done = self._done, []
        if torch.is_tensor(output):
            for group in groups:
                self.prefetch_hook(group, output)

    def _pack(self, t: torch.Tensor, group, param_storages: set[int]):
        if t.numel() < self.min_numel:
            return t
        return super()._pack(t, group, param_storages)
