"""Cost of checkpoint checksums: save and load of a ~110M-parameter training checkpoint, with and without.

Setup (not timed): the GPT-2 style model of ``benchmarks/reshard.py`` (12 layers, hidden 768,
vocab 32000, fp32, Adam; ~110M parameters) trains one iteration in one process.

Measured side by side, interleaved over ``--rounds`` (default 1): ``save`` is the training loop's
``checkpointing.save`` of the live model + optimizer (torch.save + fsync of the one shard, then the
commit), ``load`` is ``load_checkpoint`` of that directory (metadata, shard, ``torch.load``).
``on``: as shipped (each shard hashed with SHA-256 after it is written, verified before it is
read). ``off``: the same code with the two hashing calls replaced by no-ops (the digest writer
does nothing, the commit records no checksums, so the reader skips verification). Page cache warm,
local disk; ``hash s`` is one :func:`integrity.file_digest` of the shard alone.

    python benchmarks/checkpoint_checksum.py [--rounds 1] [--workdir DIR] [--json FILE]
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel import dump_json, print_table  # noqa: E402
from reshard import MODEL, run_checkpoint_bench  # noqa: E402


@contextlib.contextmanager
def checksums_off():
    from omnitron.core.checkpoint import integrity

    saved = integrity.write_digest, integrity.collect_digests
    integrity.write_digest, integrity.collect_digests = (lambda path: None), (lambda directory, names: None)
    try:
        yield
    finally:
        integrity.write_digest, integrity.collect_digests = saved


def bench_worker(root: str, rounds: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import integrity, load_checkpoint
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(2)
    times: dict[str, list[float]] = {k: [] for k in ("save on", "save off", "load on", "load off", "hash")}
    out = {}
    for mode in ("on", "off"):  # one trained model per save directory, same seed: identical state
        out[mode] = train(parse_settings(MODEL + ["--save", os.path.join(root, mode), "--data-cache-path",
                                                  os.path.join(root, "cache")], 1), get_backend())["components"]
    params = sum(p.numel() for m in out["on"].modules for p in m.parameters())
    for _ in range(rounds):
        for mode in ("on", "off"):
            with checksums_off() if mode == "off" else contextlib.nullcontext():
                t = time.perf_counter()
                path = checkpointing.save(out[mode])
                times[f"save {mode}"].append(time.perf_counter() - t)
                t = time.perf_counter()
                meta, _ = load_checkpoint(path, 0)
                times[f"load {mode}"].append(time.perf_counter() - t)
            assert (meta.get("checksums") is None) == (mode == "off")
        shard = os.path.join(root, "on", "iter_0000001", "rank_00000.pt")
        t = time.perf_counter()
        integrity.file_digest(shard)
        times["hash"].append(time.perf_counter() - t)
    return {"params": params, "times": times, "shard_bytes": os.path.getsize(shard)}


def main() -> None:
    args, res = run_checkpoint_bench(bench_worker, __doc__.splitlines()[0], 1, "omnitron_checksum_")
    t = {k: min(v) for k, v in res["times"].items()}
    rows = [{"what": what, "on": t[f"{what} on"], "off": t[f"{what} off"], "ratio": t[f"{what} on"] / t[f"{what} off"]}
            for what in ("save", "load")]
    print(f"{res['params'] / 1e6:.1f}M parameters, fp32 + Adam, one shard of {res['shard_bytes'] / 2**20:.0f} MiB; "
          f"best of {args.rounds} interleaved round(s); SHA-256 of the shard alone {t['hash']:.2f} s "
          f"({res['shard_bytes'] / t['hash'] / 2**20:.0f} MiB/s)")
    print_table(rows, [("what", "what", ""), ("checksums on s", "on", ".2f"), ("off s", "off", ".2f"),
                       ("on / off", "ratio", ".2f")])
    dump_json(args.json, {"rows": rows, **res})


if __name__ == "__main__":
    main()
