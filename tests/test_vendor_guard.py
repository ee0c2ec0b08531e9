"""DESIGN rule 1: no vendor name inside omnitron/core (they live in omnitron/backends/<vendor>/)."""
import pathlib
import re

CORE = pathlib.Path(__file__).resolve().parents[1] / "omnitron" / "core"
PATTERN = re.compile(r"torch\.cuda|\.cuda\(|[\"']cuda[\"']|[\"']nccl[\"']|torch_musa|torch\.musa|[\"']mccl[\"']")


def test_core_names_no_vendor():
    hits = []
    for path in CORE.rglob("*.py"):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if PATTERN.search(line):
                hits.append(f"{path.relative_to(CORE.parent.parent)}:{no}: {line.strip()}")
    assert not hits, "vendor names in omnitron/core:\n" + "\n".join(hits)


def test_guard_pattern_catches_each_form():
    for bad in ("torch.cuda.synchronize()", "x.cuda()", 'dev = "cuda"', "backend='nccl'", "import torch_musa",
                "torch.musa.is_available()", 'pg = "mccl"'):
        assert PATTERN.search(bad), bad
    assert not PATTERN.search("backend.device_type")
