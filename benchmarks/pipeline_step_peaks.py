"""Step peak memory of the pipeline schedules at pp4 (BENCHMARKS.md, "Step peak memory"; the README's ZB-H1 / ZB-V
factors): ``omnitron.plan.measure.train_step_peak`` (one warm step, then the peak of every storage one training
step creates) on each of 4 gloo ranks, 8 layers, hidden 128, sequence 128, micro-batch 2, 16 micro-batches.

    PYTHONPATH=. python benchmarks/pipeline_step_peaks.py [1f1b zb-h1 zb-v dualpipe-v]
"""
from __future__ import annotations

import sys
import tempfile
import time

from omnitron.testing.distributed import run_distributed

ARGS = ["--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--ffn-hidden-size", "512",
        "--seq-length", "128", "--max-position-embeddings", "128", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "200", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "2",
        "--global-batch-size", "32"]
TWO_CHUNKS = ("zb-v", "dualpipe-v")  # one layer a chunk, two chunks a rank


def step_peak(argv: list[str], root: str) -> tuple[int, int]:
    """(pipeline rank, step peak bytes) of this rank (run on each of the 4 processes)."""
    import torch

    from omnitron.plan.measure import train_step_peak

    torch.set_num_threads(1)
    return train_step_peak(argv, 4, root)


def main() -> None:
    peaks = {}
    for schedule in sys.argv[1:] or ["1f1b", "zb-h1", "zb-v", "dualpipe-v"]:
        extra = ["--pipeline-schedule", schedule]
        extra += ["--num-layers-per-virtual-pipeline-stage", "1"] if schedule in TWO_CHUNKS else []
        with tempfile.TemporaryDirectory() as root:
            start = time.perf_counter()
            ranks = run_distributed(step_peak, 4, ARGS + extra + ["--data-cache-path", root + "/cache"], root,
                                    env={"OMNITRON_STRICT_COLLECTIVES": "0"}, timeout_s=900)
        peaks[schedule] = max(p for _, p in ranks)
        print(f"{schedule:11s} MiB per rank {' / '.join(f'{p / 2**20:.2f}' for _, p in ranks)}  "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    if "1f1b" in peaks:
        print("most over ranks / 1F1B's: " + ", ".join(f"{s} {p / peaks['1f1b']:.2f}x" for s, p in peaks.items()))


if __name__ == "__main__":
    main()
