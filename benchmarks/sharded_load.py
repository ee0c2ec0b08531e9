"""Host memory of one tensor-parallel inference rank's load: the whole-tensor path against sliced loading.

A random GPT-3-125M-shaped model (``gpt3_125m``: 12 layers, hidden 768, 50257 tokens, fp32; ``--layers`` scales
it) is written once whole: a torch_dist checkpoint (``checkpoint convert`` to tp1: one chunk per tensor) and a
safetensors export. Each measurement is a fresh process loading tp rank 0's stage of a tp ``--tp`` layout (no
process group: loading communicates nothing) after importing everything:

* ``whole``: the path before sliced loading -- build the stage with its initialisation (every full tensor drawn,
  then cut), read every full tensor the stage owns (:func:`~omnitron.core.checkpoint.reshard.read_full_state`),
  cut this rank's shards;
* ``sliced torch_dist`` / ``sliced safetensors``: :func:`~omnitron.core.inference.loader.load_sharded` (stage on
  ``meta``, storage for its shards, only its slices read).

Columns: peak RSS over the RSS before the load (``VmHWM`` after minus ``VmRSS`` before, MiB), the rank's own
shard (its parameters' bytes), bytes read as the loader counts them, seconds. Page cache warm.

    python benchmarks/sharded_load.py [--layers 12] [--tp 2 4] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel import dump_json, print_table  # noqa: E402
from reshard import _rss_kib  # noqa: E402

MIB = 1 << 20


def _write(root: str, layers: int) -> tuple[str, str]:
    """(torch_dist directory, safetensors file) of a random model written whole."""
    import torch

    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout, convert, export_safetensors
    from omnitron.core.models.gpt.presets import gpt3
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = gpt3("125m", num_layers=layers, seq_length=256, max_position_embeddings=256)
    model = GPTModel(cfg, ParallelGroups.single(), seed=1)
    with torch.no_grad():
        full = gather_full_state(model, model.groups)
    del model
    write_weights_checkpoint(full, cfg, root + "/torch", Layout(), config={"tokenizer_type": "GPT2BPETokenizer"})
    del full
    dist = convert(root + "/torch/iter_0000000", root + "/dist", Layout(), "torch_dist")
    export_safetensors(dist, root + "/m.safetensors")
    return dist, root + "/m.safetensors"


def _child(mode: str, src: str, tp: int) -> dict:
    """One load in this process; what it cost."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.io import read_metadata
    from omnitron.core.checkpoint.reshard import Layout, _Seen, model_config, needed_owners, read_full_state
    from omnitron.core.inference.loader import load_sharded
    from omnitron.core.inference.sharded import build_stage
    from omnitron.core.models.gpt.state import shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    groups = ParallelGroups.single()
    groups.config = Layout(tp=tp).parallel_config()
    groups.groups.update(tp=_Seen("tp", tuple(range(tp)), None, me=0))
    before = _rss_kib()["VmRSS"]
    t0 = time.perf_counter()
    read = None
    if mode == "whole":
        meta = read_metadata(src)
        stage = build_stage(model_config(meta["model"]), groups, get_backend("cpu"))
        full = read_full_state(src, owners=needed_owners([stage]), with_optimizer=False)
        shard_full_state(stage, full.model, groups)
        del full
    else:
        loaded = load_sharded(src, groups, get_backend("cpu"))
        stage, read = loaded.model, loaded.read_bytes
    seconds = time.perf_counter() - t0
    own = sum(p.numel() * p.element_size() for p in stage.parameters())
    return {"peak_mib": (_rss_kib()["VmHWM"] - before) / 1024, "own_mib": own / MIB,
            "read_mib": None if read is None else read / MIB, "s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "SRC", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.child[1], int(args.child[2]))))
        return
    with tempfile.TemporaryDirectory() as root:
        dist, safe = _write(root, args.layers)
        from omnitron.core.checkpoint import find_latest

        dist = find_latest(root + "/dist")
        rows = []
        for tp in args.tp:
            for mode, src in (("whole", dist), ("sliced torch_dist", root + "/dist"), ("sliced safetensors", safe)):
                out = subprocess.run([sys.executable, __file__, "--child", mode.split()[0], src, str(tp)],
                                     capture_output=True, text=True, check=True)
                rows.append({"tp": tp, "path": mode, **json.loads(out.stdout.strip().splitlines()[-1])})
                print(rows[-1], flush=True)
        print_table(rows, [("tp", "tp", "d"), ("path", "path", "s"), ("peak MiB", "peak_mib", ".0f"),
                           ("own shard MiB", "own_mib", ".0f"), ("read MiB", "read_mib", ".0f"), ("s", "s", ".2f")])
        dump_json(args.json, rows)


if __name__ == "__main__":
    main()
