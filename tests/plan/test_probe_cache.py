"""The planner's probe timelines on disk (omnitron/plan/probe_cache.py): a second run reads what the first measured,
a change of code, torch or kernel selection reads nothing of it, a damaged file is measured again, nothing is
unpickled, and a plan made from the cache is the plan made without it."""
from __future__ import annotations

import json
import os

import pytest

from omnitron.plan import probe_cache, transients
from omnitron.plan.transients import Probe, _timeline


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(probe_cache.ENV, str(tmp_path))
    monkeypatch.setattr(transients, "_TIMELINES", {})
    return tmp_path


def _probe() -> Probe:
    from omnitron.core.models.gpt.config import GPTConfig

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
                    max_position_embeddings=16, vocab_size=128, make_vocab_size_divisible_by=128)
    return Probe(cfg, 1, True, True, 16, 2)


def test_a_second_run_reads_the_first_runs_measurement(cache, monkeypatch):
    p = _probe()
    first = transients.timeline(p)
    assert first == _timeline(p)  # what is stored is the measurement
    files = list(cache.rglob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["probe"] == repr(p)
    monkeypatch.setattr(transients, "_TIMELINES", {})  # a new process: nothing in memory
    monkeypatch.setattr(transients, "_timeline", lambda *a: pytest.fail("measured again"))
    assert transients.timeline(p) == first


def test_other_code_torch_or_kernels_read_nothing(cache, monkeypatch):
    p = _probe()
    transients.timeline(p)
    real = probe_cache.code_key
    key = real()
    monkeypatch.setattr(probe_cache, "code_key", lambda: key + "x")  # an edit of the package, or another torch
    assert probe_cache.load(repr(p)) is None
    uncached = real.__wrapped__  # computed afresh, not the process's memo
    assert uncached() == key
    monkeypatch.setenv("OMNITRON_KERNELS", "layer_norm=reference")
    assert uncached() != key


@pytest.mark.parametrize("damage", ['{"probe": "P", "events": [[null, 1], ["op", "2"]]}', "not json",
                                    '[[null, 1]]', '{"probe": "other", "events": []}'])
def test_a_damaged_or_foreign_file_is_measured_again(cache, monkeypatch, damage):
    p = _probe()
    want = transients.timeline(p)
    (path,) = cache.rglob("*.json")
    path.write_text(damage.replace('"P"', json.dumps(repr(p))))
    monkeypatch.setattr(transients, "_TIMELINES", {})
    assert transients.timeline(p) == want
    assert json.loads(path.read_text())["events"] == [list(e) for e in want]  # rewritten


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(probe_cache.ENV, "off")
    monkeypatch.setattr(transients, "_TIMELINES", {})
    transients.timeline(_probe())
    assert probe_cache.folder() is None and not any(tmp_path.iterdir())


def test_a_plan_from_the_cache_is_the_plan_without_it(cache, monkeypatch):
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import estimate

    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
                     "seq_length": 32, "max_position_embeddings": 32, "global_batch_size": 4, "micro_batch_size": 2,
                     "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "num_layers": 4,
                     "layout": "pp2"})
    want = estimate(s, transients=True)
    monkeypatch.setattr(transients, "_TIMELINES", {})
    monkeypatch.setattr(transients, "_timeline", lambda *a: pytest.fail("measured again"))
    assert estimate(s, transients=True) == want
    assert os.listdir(cache)
