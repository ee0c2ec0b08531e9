"""Muon (``--optimizer muon``): orthogonalised momentum for the hidden matrices, AdamW for the rest.

Which parameters (Megatron's rule): every 2-D parameter that is not the input embedding or the output layer
(``is_embedding_or_output_parameter``) and not marked ``use_muon = False`` takes the Muon step; embeddings,
the output layer, norms and biases take the engine's AdamW (same kernel, same flags).

The Muon step of one matrix, after the usual unscale / inf check / global-norm clipping (Megatron's
``TensorParallelMuon`` on emerging_optimizers' ``OrthogonalizedOptimizer``):

* ``p *= 1 - lr wd`` (decoupled decay; the 2-D weights are all decayed);
* ``m = lerp(m, g, 1 - momentum)`` (``--muon-momentum``); ``u = lerp(g, m, momentum)`` with
  ``--muon-nesterov``, else ``u = m``;
* ``p -= lr x extra x scale(rows, cols) x NS(U)``, where ``U`` is the whole logical matrix
  (:mod:`omnitron.core.optim.newton_schulz`; the fused QKV weight as its q, k and v row blocks with
  ``--muon-split-qkv``, each orthogonalised and scaled alone).

Tensor parallelism (``--muon-tp-mode duplicated``, Megatron's default): every tp rank all-gathers ``U`` over
tp (``groups.etp`` for expert shards), orthogonalises the whole matrix and keeps its own shard, so the
update does not depend on the layout. ``distributed`` (Megatron all-reduces the Gram matrices of the shards
instead of gathering them: the same whole-matrix update) takes the same path here. ``blockwise``
orthogonalises each shard alone (no communication; the update then depends on tp).

Distributed optimizer (:class:`DistributedMuon`): the momentum is sharded like Adam's moments (ZeRO-1 slices
of the data-parallel buckets, which cut matrices anywhere). Each rank orthogonalises the whole matrices it
owns any part of, after an all-gather of ``U``'s slices over the bucket's group (the peers' "gather"
choice, as Megatron's duplicated tp mode and torchtitan's full-tensor Muon), and keeps the part it owns; a
matrix cut by a slice boundary is orthogonalised by each of its (at most a few) owners, bit-identically.
Why not whole-matrix ownership (Megatron's layer-wise distributed optimizer): the slices are the data-parallel
wrapper's reduce-scatter layout, shared with the in-place parameter all-gather; owning whole matrices would
replace the reduce-scatter by an all-reduce and the bucket gathers by per-owner broadcasts. The cost here is
one fp32 all-gather of the buckets per step (the size of the fp32 parameters) and ~1/dp of the
orthogonalisation work per rank.

State: Adam's ``exp_avg`` doubles as Muon's momentum buffer; Muon matrices keep no ``exp_avg_sq`` (4 bytes per
element less than AdamW), and checkpoints leave it out for them (:meth:`keeps`). Otherwise the engine's format:
the plain and distributed optimizers resume from each other's checkpoints, and they reshard like AdamW's.
"""
from __future__ import annotations

import torch

from omnitron.core.optim.distributed import DistributedOptimizer
from omnitron.core.optim.newton_schulz import coefficient_schedule, orthogonalize, update_scale
from omnitron.core.optim.optimizer import MixedPrecisionOptimizer
from omnitron.core.parallel.tensor.sharding import gather_param, shard_param
from omnitron.core.transformer.qkv import group_cat, group_split


def uses_muon(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` takes the Muon step (the module docstring's rule)."""
    return (param.ndim == 2 and getattr(param, "use_muon", True)
            and not getattr(param, "is_embedding_or_output_parameter", False))


class MuonMixin:
    """The Muon step for optimizers whose masters align with ``_param_of(j)``; AdamW for the other masters."""

    def _param_of(self, j: int) -> int:
        raise NotImplementedError

    def _build_masters(self) -> None:
        super()._build_masters()
        self.muon = [uses_muon(self.params[self._param_of(j)]) for j in range(len(self.masters))]
        c = self.config
        self.ns_coefficients = coefficient_schedule(c.muon_coefficient_type, c.muon_num_ns_steps)

    def _zero_state(self) -> dict[str, list[torch.Tensor]]:
        """Adam's two moments for the AdamW masters; the momentum (``exp_avg``) alone for the Muon ones (their
        ``exp_avg_sq`` is an empty placeholder, neither stepped nor checkpointed)."""
        state = super()._zero_state()
        for j, m in enumerate(self.masters):
            if self.muon[j]:
                state["exp_avg_sq"][j] = m.new_zeros(0)
        return state

    def keeps(self, key: str, i: int) -> bool:
        return key != "exp_avg_sq" or not uses_muon(self.params[i])

    def _adamw(self, grads: list[torch.Tensor], rates: list[float], only=None) -> None:
        super()._adamw(grads, rates, only=[j for j in range(len(self.masters)) if not self.muon[j]])
        self._muon(grads, rates)

    def _muon(self, grads: list[torch.Tensor], rates: list[float]) -> None:
        """The momentum, the orthogonalised update and the decoupled decay of every Muon master."""
        c, beta = self.config, self.config.muon_momentum
        mom = self.state["exp_avg"]
        idx = [j for j in range(len(self.masters)) if self.muon[j]]
        for j in idx:
            mom[j].lerp_(grads[j], 1.0 - beta)
        u = {j: grads[j].lerp(mom[j], beta) if c.muon_nesterov else mom[j] for j in idx}
        updates = self._orthogonalized(u)
        for j in idx:
            if self.weight_decay and self.decay[j]:
                self.masters[j].mul_(1.0 - rates[j] * self.weight_decay)
            self.masters[j].add_(updates[j], alpha=-rates[j])

    # ---- whole matrices ----------------------------------------------------------------
    def _tp_group(self, p: torch.nn.Parameter):
        """The group ``p`` is sharded over (None: whole here, or --muon-tp-mode blockwise)."""
        if not getattr(p, "tensor_model_parallel", False) or self.config.muon_tp_mode == "blockwise":
            return None
        group = self.groups.etp if getattr(p, "expert", False) else self.groups.tp
        return group if group.size > 1 else None

    def _orthogonalized_local(self, local: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        """``local`` (this rank's shard of ``U``, ``p``'s shape) -> this rank's shard of the scaled
        orthogonalised whole matrix."""
        group = self._tp_group(p)
        full = gather_param(local, p, group) if group is not None else local
        out = self._scaled_orthogonal(full, p)
        return shard_param(out, p, group.size, group.rank) if group is not None else out

    def _scaled_orthogonal(self, full: torch.Tensor, p: torch.nn.Parameter) -> torch.Tensor:
        """``extra x scale x NS`` of the whole matrix ``full``; the QKV weight per q / k / v block."""
        c = self.config
        rows = getattr(p, "qkv_split_rows", None)
        if rows is not None and c.muon_split_qkv:
            g = full.shape[0] // sum(rows)
            return group_cat([self._scaled_orthogonal(part, None) for part in group_split(full, g, rows)], g)
        o = orthogonalize(full, self.ns_coefficients, bf16=c.muon_fp32_matmul_prec == "medium")
        return o.mul_(update_scale(full.shape[0], full.shape[1], c.muon_scale_mode) * c.muon_extra_scale_factor)

    def _orthogonalized(self, u: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Master index -> its part of the update, for every master in ``u``."""
        raise NotImplementedError


class Muon(MuonMixin, MixedPrecisionOptimizer):
    """:class:`MixedPrecisionOptimizer` with the Muon step (module docstring); masters are whole (tp-local)
    parameters."""

    def _param_of(self, j: int) -> int:
        return j

    def _orthogonalized(self, u: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        # NOTE: every rank of a tp group walks the same matrices in the same order (its collectives match)
        return {j: self._orthogonalized_local(x, self.params[j]) for j, x in sorted(u.items())}


class DistributedMuon(MuonMixin, DistributedOptimizer):
    """:class:`DistributedOptimizer` with the Muon step: masters and momenta are slices; whole matrices are
    gathered for the orthogonalisation (module docstring)."""

    def _param_of(self, j: int) -> int:
        return self.slices[j].param

    def _orthogonalized(self, u: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        empty = torch.zeros(0, device=self.backend.current_device())
        wanted = {self.slices[j].param for j in u}
        whole: dict[int, torch.Tensor] = {}

        def keep(i: int, flat: torch.Tensor) -> None:
            if i in wanted:
                whole[i] = flat.clone().view(self.params[i].shape)

        # every rank gathers every bucket (the same collectives everywhere), then keeps the matrices it owns part of
        wide = torch.float64 if self._norm_dtype() == torch.float64 else torch.float32  # a float64 model's U
        self._gather([u.get(j, empty.to(wide)) for j in range(len(self.slices))], wide, keep)
        # NOTE: tp peers hold the same bucket layout, hence the same ``wanted``: their tp gathers match
        done = {i: self._orthogonalized_local(whole[i], self.params[i]).reshape(-1) for i in sorted(wanted)}
        return {j: done[self.slices[j].param][self.slices[j].lo:self.slices[j].hi] for j in u}
