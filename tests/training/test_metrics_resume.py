"""Resuming a run's metrics.jsonl: the records up to the checkpoint are kept, a cut-short last line is dropped."""
from __future__ import annotations

import json
import logging

import pytest

from omnitron.core.training.metrics import _open_metrics


def _write(path, iterations, tail: str = "") -> list[str]:
    lines = [json.dumps({"iteration": i, "lm_loss": 1.0 / i}) + "\n" for i in iterations]
    path.write_text("".join(lines) + tail)
    return lines


def test_truncated_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    """A run killed while writing a record leaves half a line: the resumed run keeps the records up to its
    checkpoint, warns once, and appends after them."""
    path = tmp_path / "metrics.jsonl"
    lines = _write(path, [1, 2, 3], tail='{"iteration": 4, "lm_lo')
    with caplog.at_level(logging.WARNING, logger="omnitron.train"):
        f = _open_metrics(str(path), start_iteration=3)
    f.write(json.dumps({"iteration": 4}) + "\n")
    f.close()
    assert path.read_text() == "".join(lines) + '{"iteration": 4}\n'
    assert any("cut short" in r.message for r in caplog.records)


def test_complete_last_record_without_newline_is_kept_on_its_own_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = _write(path, [1, 2])
    path.write_text("".join(lines).rstrip("\n"))
    f = _open_metrics(str(path), start_iteration=2)
    f.write(json.dumps({"iteration": 3}) + "\n")
    f.close()
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = _write(path, [1, 2, 3])
    path.write_text(lines[0] + "garbage\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        _open_metrics(str(path), start_iteration=3)
