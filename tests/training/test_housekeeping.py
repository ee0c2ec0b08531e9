"""--manual-gc, --manual-gc-interval and --empty-unused-memory-level: when collections and cache releases
happen, and that automatic collection is back on after the run."""
from __future__ import annotations

import gc

from omnitron.backends import get_backend
from omnitron.core.config.training import TrainingConfig
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.housekeeping import Housekeeping
from omnitron.core.training.loop import train


class _Backend:
    def __init__(self):
        self.released = 0

    def empty_cache(self):
        self.released += 1


def test_collections_and_releases_at_their_points(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    be = _Backend()
    h = Housekeeping(TrainingConfig(manual_gc=True, manual_gc_interval=3, empty_unused_memory_level=2), be)
    assert gc.isenabled()
    h.start()
    assert not gc.isenabled() and len(collected) == 1
    for it in range(1, 8):
        h.after_step(it)
    assert len(collected) == 1 + 2 and be.released == 7  # iterations 3 and 6; a release after every step
    h.before_eval_or_save()
    h.after_eval()
    assert len(collected) == 4 and be.released == 8
    h.close()
    assert gc.isenabled()


def test_off_by_default_touches_nothing(monkeypatch):
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or 0)
    be = _Backend()
    h = Housekeeping(TrainingConfig(), be)
    h.start(), h.after_step(1), h.before_eval_or_save(), h.after_eval(), h.close()
    assert collected == [] and be.released == 0 and gc.isenabled()


def test_training_with_manual_gc_restores_collection(tmp_path, monkeypatch):
    seen = []
    real = Housekeeping.after_step
    monkeypatch.setattr(Housekeeping, "after_step", lambda self, it: (seen.append(gc.isenabled()), real(self, it)))
    args = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100",
            "--num-workers", "0", "--train-iters", "3", "--no-tensorboard", "--log-dir", str(tmp_path / "logs"),
            "--data-cache-path", str(tmp_path / "cache"), "--manual-gc", "--manual-gc-interval", "2",
            "--empty-unused-memory-level", "2"]
    train(parse_settings(args, 1), get_backend("cpu"))
    assert seen == [False, False, False] and gc.isenabled()
