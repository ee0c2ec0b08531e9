"""The benchmark report: one JSON schema for every ``omnitron bench`` subcommand and every machine.

::

    {"schema": "omnitron-bench", "version": 1, "kind": "gemm" | "comm" | "memory" | "kernels" | "attention"
     | "elementwise" | "train", "created": ISO time, "command": "omnitron bench ...",
     "machine": {backend, device_name, device_type, device_count, arch, torch, runtimes: {cuda, musa, ...},
                 processor, cpu_count, threads, python, omnitron, world_size},
     "rows": [one object per measurement; fields per kind: ROW_FIELDS], "extra": {kind-specific: peaks,
     copy bandwidth, ...}}

A report is checked on write and on read (:func:`validate`): a missing or mismatched file is one
:class:`ReportError` line naming the file and what is wrong.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import sys

SCHEMA, VERSION = "omnitron-bench", 1
ROW_FIELDS = {
    "memory": ("op", "bytes", "ms", "gbs"),
    "gemm": ("dtype", "shape", "m", "n", "k", "ms", "tflops"),
    "comm": ("op", "bytes", "ranks", "ms", "algbw_gbs", "busbw_gbs"),
    "kernels": ("op", "dtype", "mode", "impl", "ms"),
    "attention": ("impl", "dtype", "seq", "heads", "head_dim", "causal", "ms", "tflops"),
    "elementwise": ("op", "mode", "elements", "ms"),
    "train": ("model", "layout", "iterations", "step_ms", "tokens_per_s", "tflops_per_device", "peak_memory_bytes"),
}
"""The fields every row of a kind has (a figure may be None where it could not be measured, with a ``note``). Its keys
are the report kinds, in the order ``omnitron bench all`` runs them (:data:`omnitron.bench.suite.KINDS`)."""
FIGURES = ("ms", "tflops", "tflops_fa", "gbs", "algbw_gbs", "busbw_gbs", "slowdown", "bytes", "ranks", "m", "n", "k",
           "seq", "heads", "head_dim", "elements", "step_ms", "tokens_per_s", "tflops_per_device", "peak_memory_bytes")
"""Row fields that are numbers (or None) wherever a row has them: what tables, ratios and plots compute with."""


class ReportError(ValueError):
    """A report file that is missing, not JSON, or not of this schema (the message names the file)."""


def machine(backend, world_size: int = 1) -> dict:
    """The fingerprint of the machine a report was measured on."""
    import torch

    import omnitron

    caps = backend.capabilities()
    runtimes = {name: getattr(torch.version, name, None) for name in ("cuda", "hip")}
    return {"backend": backend.name, "device_name": caps.device_name, "device_type": backend.device_type,
            "device_count": backend.device_count(), "arch": caps.arch, "torch": torch.__version__,
            "runtimes": {k: v for k, v in runtimes.items() if v}, "processor": _processor(),
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "python": platform.python_version(),
            "omnitron": getattr(omnitron, "__version__", None), "world_size": world_size}


def _processor() -> str:
    from omnitron.backends.cpu.backend import _cpu_name  # the host processor, whatever the backend

    return _cpu_name()


def new_report(kind: str, backend, rows: list[dict], *, world_size: int = 1, **extra) -> dict:
    rep = {"schema": SCHEMA, "version": VERSION, "kind": kind,
           "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": " ".join(["omnitron"] + sys.argv[1:]) if sys.argv and "omnitron" in sys.argv[0] else None,
           "machine": machine(backend, world_size), "rows": rows, "extra": extra}
    validate(rep, "<new report>")
    return rep


def validate(rep, where: str) -> dict:
    """``rep`` if it is a report of this schema; ReportError naming ``where`` and the problem otherwise."""
    if not isinstance(rep, dict) or rep.get("schema") != SCHEMA:
        raise ReportError(f"{where}: not an omnitron bench report (no \"schema\": \"{SCHEMA}\")")
    if rep.get("version") != VERSION:
        raise ReportError(f"{where}: report version {rep.get('version')!r}; this omnitron reads version {VERSION}")
    kind = rep.get("kind")
    if kind not in ROW_FIELDS:
        raise ReportError(f"{where}: unknown kind {kind!r}; kinds are {', '.join(ROW_FIELDS)}")
    for key, typ, json_type in (("machine", dict, "object"), ("rows", list, "array"), ("extra", dict, "object")):
        if not isinstance(rep.get(key), typ):
            raise ReportError(f"{where}: {key!r} is {'missing' if key not in rep else 'not a JSON ' + json_type}")
    for i, row in enumerate(rep["rows"]):
        if not isinstance(row, dict):
            raise ReportError(f"{where}: row {i} is not an object")
        missing = [f for f in ROW_FIELDS[kind] if f not in row]
        if missing:
            raise ReportError(f"{where}: row {i} of a {kind} report lacks {', '.join(missing)}")
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise ReportError(f"{where}: row {i} holds a non-finite {bad[0]}")
        text = [k for k in FIGURES if row.get(k) is not None and (isinstance(row[k], bool)
                                                                  or not isinstance(row[k], (int, float)))]
        if text:
            raise ReportError(f"{where}: row {i}'s {text[0]} is {row[text[0]]!r}, not a number")
    return rep


def save(rep: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rep, f, indent=1)
    return path


def load(path: str) -> dict:
    if not os.path.isfile(path):
        raise ReportError(f"{path}: no such report file")
    try:
        with open(path) as f:
            rep = json.load(f)
    except ValueError as err:
        raise ReportError(f"{path}: not JSON ({err})") from None
    return validate(rep, path)


_NOISE = re.compile(r"\([^)]*\)|\b(?:CPU|Processor|\d+-Core)\b|@.*$", re.I)
"""What a device name holds besides the machine's model: parentheses ((R), (TM), sim's description), core counts
and clock rates."""


def label(rep: dict) -> str:
    """A short name of the machine (for table columns and plot legends; :func:`legend` has the whole name): the
    backend and the device's model, without parentheses, ``CPU``, core counts or clock rates, whole words only
    (a cut at a fixed width left names such as ``sim:sim (simulated accelerator over host``)."""
    m = rep["machine"]
    model = " ".join(_NOISE.sub(" ", m["device_name"]).split())
    if not model or model.lower() == m["backend"].lower():
        return m["backend"]
    return f"{m['backend']}:{model}"


def labels(reports: list[dict]) -> list[str]:
    """Each report's :func:`label`, numbered (``#1``, ``#2``) where reports share one: two runs of one machine."""
    names = [label(r) for r in reports]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(f"{name} #{seen[name]}" if names.count(name) > 1 else name)
    return out


def legend(columns: list[tuple[str, dict]]) -> list[str]:
    """One line per column name and machine of ``columns`` ((name, report) pairs, repeats dropped): the name, the
    machine's whole device name and the folder of its report (where it was read from a file)."""
    out = []
    for name, rep in columns:
        m = rep["machine"]
        where = f", in {os.path.dirname(rep['_path']) or '.'}" if rep.get("_path") else ""
        line = f"{name} = {m['backend']}: {m['device_name']}{where}"
        if line not in out:
            out.append(line)
    return out
