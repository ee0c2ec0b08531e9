"""Benchmark ``omnitron preprocess``: tokens/s with 1 and 2 workers vs a plain batch-encoding loop.

Input: the bundled Moby Dick documents written ``--repeat`` times as JSON lines. The baseline
is the same tokenizer's ``encode_batch`` over the same documents (parsed JSON, batches of 256)
in one process, with no file writing; preprocessing additionally streams, counts and writes the
``.bin``/``.idx``. One run each (this machine is noisy: compare the ratios).

    python benchmarks/preprocess.py --repeat 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omnitron.core.data import build_tokenizer  # noqa: E402
from omnitron.core.data.corpus import moby_dick_documents  # noqa: E402
from omnitron.core.data.preprocess import preprocess_files  # noqa: E402


def baseline(path: str) -> tuple[int, float]:
    """Plain loop: read, parse, encode_batch; returns (tokens, seconds)."""
    tok = build_tokenizer()
    start = time.perf_counter()
    tokens, batch = 0, []
    with open(path, encoding="utf-8") as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 256:
                tokens += sum(len(x) + 1 for x in tok.encode_batch(batch))
                batch = []
    if batch:
        tokens += sum(len(x) + 1 for x in tok.encode_batch(batch))
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4, help="copies of the corpus in the input")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(args.repeat):
                for d in moby_dick_documents():
                    f.write(json.dumps({"text": d}) + "\n")
        size = os.path.getsize(path)
        rows = []
        for workers in (2, 1):  # multi-worker first: forking after the in-process pool has run is avoided
            s = preprocess_files([path], os.path.join(tmp, f"w{workers}"), append_eod=True, workers=workers)
            rows.append((f"omnitron preprocess, {workers} worker(s)", s.tokens, s.seconds))
        tokens, secs = baseline(path)
        rows.append(("plain encode_batch loop, 1 process", tokens, secs))
    print(f"input: {size / 1e6:.1f} MB JSONL, {args.repeat}x Moby Dick; cores: {os.cpu_count()}; "
          f"TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM', 'unset')}")
    base = rows[-1][1] / rows[-1][2]
    print(f"{'run':40s} {'tokens':>10s} {'seconds':>8s} {'tokens/s':>12s} {'vs loop':>8s}")
    for name, tokens, secs in rows:
        print(f"{name:40s} {tokens:10d} {secs:8.2f} {tokens / secs:12,.0f} {tokens / secs / base:7.2f}x")


if __name__ == "__main__":
    main()
