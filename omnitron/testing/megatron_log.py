"""A reader of Megatron-LM's console log, written as users write one for Megatron's lines: a regular expression
per field of training_log's line and one for evaluate_and_print_results' validation line (megatron/training/
training.py at d98e8a6). The tests read omnitron's console with it (so omnitron's lines stay readable by such
parsers), and the benchmarks that time a run from its console use it to find the lines."""
from __future__ import annotations

import re

_NUMBER = r"([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))"
_INT = r"\s*(\d+)"

_HEAD = re.compile(r"^ \[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6})\] iteration\s+(\d+)/\s*(\d+) \|")
TRAINING_FIELDS = {  # name in the result -> (regex, type), each of training_log's fields
    "consumed_samples": (r" consumed samples:" + _INT + r" \|", int),
    "elapsed_ms": (r" elapsed time per iteration \(ms\): " + _NUMBER + r" \|", float),
    "throughput": (r" throughput per GPU \(TFLOP/s/GPU\): " + _NUMBER + r" \|", float),
    "learning_rate": (r"\| learning rate: " + _NUMBER + r" \|", float),
    "global_batch_size": (r" global batch size:" + _INT + r" \|", int),
    "lm_loss": (r" lm loss: " + _NUMBER + r" \|", float),
    "sop_loss": (r" sop loss: " + _NUMBER + r" \|", float),
    "loss_scale": (r" loss scale: " + _NUMBER + r" \|", float),
    "grad_norm": (r" grad norm: " + _NUMBER + r" \|", float),
    "num_zeros": (r" num zeros: (\d+) \|", int),
    "params_norm": (r" params norm: " + _NUMBER + r" \|", float),
    "skipped_iterations": (r" number of skipped iterations:" + _INT + r" \|", int),
    "nan_iterations": (r" number of nan iterations:" + _INT + r" \|", int),
}
_VALIDATION = re.compile(r"^ validation loss at iteration (\d+)(?: on (validation|test) set)? \| (.*)$")
_LOSS_VALUE = re.compile(r"(\w[\w ]*?) value: " + _NUMBER + r" \| \1 PPL: " + _NUMBER + r" \| ")


def parse_training_line(line: str) -> dict | None:
    """The fields of one training_log line (None for any other line): ``time`` (the text in brackets),
    ``iteration``, ``train_iters`` and those of :data:`TRAINING_FIELDS` the line has."""
    head = _HEAD.match(line)
    if head is None:
        return None
    out = {"time": head.group(1), "iteration": int(head.group(2)), "train_iters": int(head.group(3))}
    for name, (pattern, kind) in TRAINING_FIELDS.items():
        m = re.search(pattern, line)
        if m is not None:
            out[name] = kind(m.group(1))
    return out


def parse_validation_line(line: str) -> dict | None:
    """One evaluate_and_print_results line (None for any other line): ``iteration``, ``split`` (None during
    training, ``"validation"`` or ``"test"`` after it) and ``{loss name: (value, PPL)}`` under ``losses``."""
    m = _VALIDATION.match(line)
    if m is None:
        return None
    losses = {name: (float(v), float(p)) for name, v, p in _LOSS_VALUE.findall(m.group(3))}
    return {"iteration": int(m.group(1)), "split": m.group(2), "losses": losses}


def extra_fields(line: str) -> dict[str, str]:
    """Every `` name: value |`` field of a training line after Megatron's last (``number of nan iterations``):
    omnitron's own (ETA, tokens per second, ...), as text."""
    tail = line.split(" number of nan iterations:", 1)[1].split(" |", 1)[1]
    return dict(re.findall(r" ([^:|]+): ([^|]*?) \|", tail))
