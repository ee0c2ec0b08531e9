"""This rank's pipeline stage during sharded generation: its model chunk, its neighbours and the pick of the
next tokens on the last stage (see :mod:`omnitron.core.inference.sharded` for the decoding step).
"""
from __future__ import annotations

import torch

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

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, last: bool = False) -> torch.Tensor | None:
        """One step over ``ids [b, s]``: full-vocabulary logits ``[s, b, V_pad]`` (``last``: the last position's,
        ``[1, b, V_pad]``, the only ones computed and gathered) on the last stage, else None."""
        m, pp = self.model, self.pp
        if pp.size > 1 and not pp.is_first:
            hidden = torch.empty(ids.shape[1], ids.shape[0], m.config.hidden_size, dtype=m.config.params_dtype,
                                 device=ids.device)
            self.coll.recv(hidden, src=pp.global_rank(pp.rank - 1), group=pp.handle)
            out = m(hidden=hidden, position_ids=pos, last_position_only=last)
        else:
            out = m(tokens=ids, position_ids=pos, last_position_only=last)
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
    """This rank's stage of ``cfg`` (a GPT-family model) over ``groups``, in ``cfg.params_dtype``, weights
    uninitialised-safe; on the backend's device, or (not ``on_device``) where it was built (meta parameters stay
    meta)."""
    from omnitron.core.training.components import build_model_chunks

    chunks = build_model_chunks(cfg, groups, seed=0, backend=backend, on_device=on_device)
    if len(chunks) != 1:
        raise ValueError("sharded generation runs one stage per rank (no virtual pipeline stages)")
    return chunks[0]
