"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: the process groups and the layers of each
pipeline stage that omnitron's layout must reproduce.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used), torch, numpy and einops (Megatron's hierarchical
context-parallel groups use it); it runs on CPU, offline, and creates no process group (``create_group`` is
replaced by a function returning its ranks). Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/parallel/megatron_layout/make_fixtures.py

omnitron is not imported. Groups come from ``megatron.core.parallel_state``: the dense ``RankGenerator`` and the
expert one built as ``initialize_model_parallel`` builds them (order ``tp-cp-ep-dp-pp``, the expert generator with
``tp = etp``, ``cp = 1``, ``dp`` = the expert data-parallel size), the embedding ranks of each pipeline group
(``default_embedding_ranks``) and ``create_hierarchical_groups`` over each context-parallel group. Layers come from
``get_num_layers_to_build`` and ``get_transformer_layer_offset`` for every (pipeline rank, virtual stage).
"""
from __future__ import annotations

import json
import os
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
GROUP_CASES = [  # (world, tp, cp, pp, ep, etp or None: tp, hierarchical cp sizes or None)
    (8, 2, 1, 2, 1, None, None), (8, 2, 1, 2, 2, None, None), (8, 1, 2, 2, 2, 1, None), (12, 3, 1, 2, 2, None, None),
    (16, 2, 2, 2, 2, 1, None), (16, 4, 1, 2, 2, 2, None), (16, 2, 2, 1, 4, 1, None), (24, 2, 1, 3, 2, None, None),
    (24, 1, 2, 4, 3, 1, None), (32, 2, 2, 2, 4, 2, None), (32, 4, 2, 2, 8, 1, None), (64, 8, 1, 4, 16, 1, None),
    (16, 1, 4, 2, 2, 1, (2, 2)), (32, 2, 4, 1, 4, 1, (2, 2)), (16, 2, 4, 1, 2, 2, (4, 1)),
    (16, 2, 4, 2, 1, None, (1, 4)),
    (48, 2, 4, 2, 3, 2, (2, 2)), (4, 1, 1, 4, 1, None, None), (6, 1, 1, 1, 3, None, None), (1, 1, 1, 1, 1, None, None),
]
LAYER_CASES = [  # (num_layers, pp, vp or None, first or None, last or None, account embedding, account loss)
    (8, 2, None, None, None, 0, 0), (8, 4, 2, None, None, 0, 0), (12, 3, 2, None, None, 0, 0),
    (7, 4, None, None, None, 1, 0), (7, 4, None, None, None, 0, 1), (6, 4, None, None, None, 1, 1),
    (15, 4, 2, None, None, 1, 0), (14, 4, 2, None, None, 1, 1), (6, 2, 2, None, None, 1, 1),
    (10, 4, None, 1, None, 0, 0), (10, 4, None, None, 1, 0, 0), (10, 4, None, 2, 2, 0, 0), (9, 3, None, 3, 3, 0, 0),
    (14, 4, 2, 2, None, 0, 0), (20, 4, 2, None, 2, 0, 0), (14, 4, 2, 2, 4, 0, 0), (12, 3, 2, 4, 2, 0, 0),
    (8, 3, None, 0, None, 0, 0), (9, 4, None, 0, 1, 0, 0), (6, 2, None, 2, None, 0, 0), (6, 2, None, None, 4, 0, 0),
]


def groups_case(world, tp, cp, pp, ep, etp, hier):
    """Every group of one layout, named as omnitron's ``rank_grid`` names them (Megatron's token in comments)."""
    from megatron.core import parallel_state as ps

    etp = etp or tp
    dense = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * cp * pp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert = ps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    out = {name: dense.get_ranks(token) for name, token in (
        ("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "dp-cp"), ("tp_cp", "tp-cp"),
        ("mp", "tp-pp"), ("tp_pp_cp", "tp-cp-pp"), ("amax", "tp-dp-cp"))}
    out.update(ep=expert.get_ranks("ep"), etp=expert.get_ranks("tp"), edp=expert.get_ranks("dp"))
    out["embedding"] = [ps.default_embedding_ranks(r) for r in out["pp"]]
    if hier:
        ps.create_group = lambda ranks, **kw: list(ranks)  # the ranks of each group, no process group
        levels = [[], []]
        for ranks in out["cp"]:
            for r in ranks:  # every member's own groups: each level's groups over all members
                for level, g in enumerate(ps.create_hierarchical_groups(r, ranks, list(hier))[0]):
                    if g not in levels[level]:
                        levels[level].append(g)
        out["cp_a2a"], out["cp_p2p"] = levels
    return out


def layers_case(num_layers, pp, vp, first, last, embedding, loss):
    """``{"r,c": [offset, layers]}`` of every pipeline rank r and virtual stage c."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    cfg = types.SimpleNamespace(pipeline_model_parallel_layout=None, num_layers=num_layers,
                                pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                account_for_embedding_in_pipeline_split=bool(embedding),
                                account_for_loss_in_pipeline_split=bool(loss))
    return {f"{r},{c}": [get_transformer_layer_offset(cfg, vp_stage=c if vp else None, pp_rank=r),
                         get_num_layers_to_build(cfg, vp_stage=c if vp else None, pp_rank=r)]
            for r in range(pp) for c in range(vp or 1)}


def main() -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    data = {"megatron": "d98e8a64dd",
            "groups": [{"case": list(c), "groups": groups_case(*c)} for c in GROUP_CASES],
            "layers": [{"case": list(c), "layers": layers_case(*c)} for c in LAYER_CASES]}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
