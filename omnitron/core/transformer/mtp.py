"""Multi-token prediction (DeepSeek-V3, section 2.2; Megatron's ``MultiTokenPredictionBlock``).

Depth ``k = 1..D`` (``--mtp-num-layers D``) predicts token ``t_{i+k+1}`` at position ``i``:

    h'_k = W_k [norm_e(Emb(t_{i+k})) ; norm_h(h_{k-1})]      (eh_proj, no bias; [emb ; hidden] as Megatron)
    h_k  = final_norm_k(TransformerLayer_k(h'_k))
    L_k  = sum_i mask_k,i CE(OutHead(h_k)_i, t_{i+k+1}) / sum_i mask_k,i

``h_0`` is the main model's output after its final norm, ``Emb`` the (shared) word embedding and ``OutHead``
the (shared) output layer; ``mask_k`` is the loss mask shifted left by k, its last k positions 0. The loss
``lambda / D * sum_k L_k`` (``--mtp-loss-scaling-factor lambda``) joins the backward through
:func:`attach_aux_loss` with each micro-batch's LM-loss weight (``aux_loss_scale``, set by the step), as the
MoE router losses do, and is logged apart from the LM loss.

The modules live on the last pipeline stage; a last stage without the embedding keeps a copy of it, tied
to the first stage's (:meth:`GPTModel.shared_embedding_parameters`). Under sequence parallelism the shifted
tokens' embedding is reduce-scattered like the first stage's and ``eh_proj`` (replicated over tp) gets
partial gradients, summed over tp.

Under context parallelism each rank holds chunks ``r`` and ``2cp-1-r`` of the sequence, so the token ``k``
positions on may sit in another rank's chunk: the shift runs on the whole sequence (:class:`GlobalShift`:
the micro-batch's tokens, labels and mask all-gathered over cp, a few integers per token, shifted, and this
rank's positions taken back). ``L_k``'s denominator is the whole sequence's count and each rank's share is
``cp x`` its partial sum over it, as the LM loss's (:func:`omnitron.core.parallel.context.context_parallel_batch`):
the gradient average over dp x cp gives back the one-process loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.parallel.tensor.sharding import set_attributes
from omnitron.core.transformer.layer import TransformerLayer
from omnitron.core.transformer.moe.metrics import logged_loss
from omnitron.core.transformer.moe.router import attach_aux_loss
from omnitron.core.transformer.norm import Norm, norm_kwargs


def shift_left(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t [b, s]`` moved k positions left along the sequence, the last k positions 0 (Megatron's roll_tensor)."""
    out = torch.zeros_like(t)
    if k < t.shape[1]:
        out[:, : t.shape[1] - k] = t[:, k:]
    return out


class GlobalShift:
    """:func:`shift_left` on the whole sequence of cp-split ``[b, s/cp]`` tensors, each rank's positions kept
    (the identity split at cp 1). ``count(m)``: the whole sequence's sum of a shifted mask."""

    def __init__(self, group) -> None:
        self.group = group

    def full(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s/cp]`` -> ``[b, s]`` in sequence order (no gradient: tokens, labels and masks)."""
        if self.group is None or self.group.size == 1:
            return t
        from omnitron.core.parallel.context.layout import chunk_positions
        from omnitron.core.parallel.tensor.mappings import gather_from_sp

        cp, s = self.group.size, t.shape[1] * self.group.size
        rows = gather_from_sp(t.detach().t().contiguous(), self.group)  # [s, b]: the ranks' chunks in rank order
        order = torch.cat([chunk_positions(s, cp, r, t.device) for r in range(cp)])
        return rows.index_select(0, torch.argsort(order)).t()

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's positions of a ``[b, s]`` sequence."""
        if self.group is None or self.group.size == 1:
            return full
        from omnitron.core.parallel.context.layout import chunk_positions

        return full.index_select(1, chunk_positions(full.shape[1], self.group.size, self.group.rank, full.device))

    def shifted(self, full: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's positions of ``full`` shifted ``k`` left."""
        return self.local(shift_left(full, k))

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size


class MTPLayer(nn.Module):
    """One depth: ``(hidden [s, b, h], embedding of the shifted tokens [s, b, h]) -> [s, b, h]`` (``s/tp`` under
    sequence parallelism)."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, groups) -> None:
        super().__init__()
        nkw = norm_kwargs(c, backend, partial_grad=sequence_parallel)
        self.enorm, self.hnorm = Norm(c.hidden_size, **nkw), Norm(c.hidden_size, **nkw)
        self.eh_proj = nn.Module()
        w = torch.empty(c.hidden_size, 2 * c.hidden_size, dtype=c.params_dtype)
        self.eh_proj.weight = set_attributes(nn.Parameter(w), parallel=False, init=("normal", c.init_method_std))
        self.eh_proj.weight.sequence_parallel = sequence_parallel  # each tp rank sees its sequence shard
        # NOTE: the layer's kind (dense or MoE) is that of the decoder's last layer, as Megatron's MTP spec
        self.transformer_layer = TransformerLayer(c, group=group, sequence_parallel=sequence_parallel,
                                                  tracker=tracker, backend=backend, groups=groups,
                                                  layer_number=c.num_layers - 1)
        if hasattr(self.transformer_layer.mlp, "layer_number"):  # an MoE layer, but no decoder layer
            self.transformer_layer.mlp.layer_number = None
        self.final_layernorm = Norm(c.hidden_size, **nkw)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, freqs) -> torch.Tensor:
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x = F.linear(x, self.eh_proj.weight)
        return self.final_layernorm(self.transformer_layer(x, freqs))


class MultiTokenPrediction(nn.Module):
    """The D depths and their loss. ``aux_loss_scale``: the backward weight of a micro-batch's loss (the step's
    loss scale / micro-batches); ``loss_total``: the detached weighted losses since the last log."""

    def __init__(self, c, **layer_kw) -> None:
        super().__init__()
        self.scaling = c.mtp_loss_scaling_factor / c.mtp_num_layers
        self.layers = nn.ModuleList([MTPLayer(c, **layer_kw) for _ in range(c.mtp_num_layers)])
        self.aux_loss_scale = 1.0
        self.loss_total: torch.Tensor | None = None
        groups = layer_kw.get("groups")
        self.shift = GlobalShift(None if groups is None else groups.cp)

    def loss(self, hidden: torch.Tensor, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
             freqs, embed, per_token_loss) -> torch.Tensor:
        """``lambda / D * sum_k L_k`` (see the module docstring). ``embed(tokens [b, s]) -> [s, b, h]``;
        ``per_token_loss(hidden, labels [b, s]) -> [b, s]`` float32: the model's output head and loss."""
        total, sh = None, self.shift
        tokens, labels, mask = (sh.full(t) for t in (tokens, labels, loss_mask.float()))
        for k, layer in enumerate(self.layers, start=1):
            hidden = layer(hidden, embed(sh.shifted(tokens, k)), freqs)
            m = sh.shifted(mask, k)
            ce = per_token_loss(hidden, sh.shifted(labels, k))
            # this rank's share: cp x its partial sum over the whole sequence's count (the module docstring)
            depth = (ce * m).sum() * sh.size / shift_left(mask, k).sum().clamp(min=1.0)
            total = depth if total is None else total + depth
        return self.scaling * total

    def attach(self, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """``out`` unchanged; its backward also back-propagates ``aux_loss_scale * loss``; the value is logged."""
        self.loss_total = loss.detach() if self.loss_total is None else self.loss_total + loss.detach()
        return attach_aux_loss(out, loss, self.aux_loss_scale)


def mtp_blocks(modules) -> list[MultiTokenPrediction]:
    """Every :class:`MultiTokenPrediction` inside ``modules`` (model chunks, wrapped or not)."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, MultiTokenPrediction)]


def set_mtp_loss_scale(modules, scale: float) -> None:
    """Backward weight of each micro-batch's MTP loss: that of its LM loss (loss scale / micro-batches)."""
    for block in mtp_blocks(modules):
        block.aux_loss_scale = scale


def mtp_loss(modules, groups, collectives, num_microbatches: int) -> float:
    """Collective over pp and dp x cp: the MTP loss added to the LM loss this step (``lambda / D * sum_k L_k``,
    averaged over micro-batches and data-parallel replicas); resets the totals."""
    return logged_loss(modules, mtp_blocks(modules), "loss_total", groups, collectives, num_microbatches)
